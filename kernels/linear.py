"""Projections (``x @ W.T + b``) as the forward runs them: dense, pre-packed, or quantized.

On the CPU a dense bf16 weight runs our kernel where the CPU has AVX-512 bf16 (``spindle.kernels.cpu.bf16_linear``, its
weight laid out once by :func:`~spindle.kernels.cpu.bf16_pack`: :func:`can_tile`), and any other float32 or bf16 weight
is pre-packed into oneDNN's blocked layout (:func:`pack_weight`). A quantized projection
(:class:`~spindle.kernels.quant.QuantizedWeight`) keeps no dense copy anywhere. On a CPU with AVX2 it runs with int8
activations by default, as llama.cpp does: ``spindle.kernels.cpu.a8_linear`` (each call's rows quantized per 32 inputs,
integer dot products with the weight as stored) at every batch size where its layout suits the kernel; an int8 weight
with one scale per row runs W8A8 instead (``spindle.kernels.cpu.w8a8_linear``, activations quantized per group of 64)
where the CPU has AVX-512 VNNI: it beats the bf16 kernel 1.3-1.9x from 1 to 512 rows. Within :func:`weight_only`, and
where neither applies, the activations stay float: a weight-only kernel (``spindle.kernels.cpu.int8_linear``,
``int4_linear``: the weights read once, every token's products in registers) for a few tokens and the panel kernel
(``spindle.kernels.cpu.quant_gemm``: a panel of columns dequantized per work item, then multiplied by every row) for
more, at the crossover :data:`MAX_QUANTIZED_TOKENS`. On CUDA the Triton kernel dequantizes in registers at every batch
size; one built within ``spindle.kernels.force_triton`` runs that kernel on CPU tensors too.
"""

import dataclasses
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from spindle.kernels import cpu, is_eager, is_forced_triton, quantized_linear
from spindle.kernels.quant import A8_BLOCK, ACTIVATION_GROUP_SIZE, SUPER_BLOCK, QuantizedWeight, dequantize

_CAPABILITY = torch.backends.cpu.get_cpu_capability()
if _CAPABILITY == "AVX512" and torch.cpu._is_avx512_bf16_supported():
    # The dense bf16 copy runs our kernel there (can_tile: the kernels are built for this CPU's instructions).
    _CAPABILITY = "AVX512_BF16"

_F32, _BF16 = torch.float32, torch.bfloat16
MAX_QUANTIZED_TOKENS: dict[tuple[torch.dtype, int], int] = {
    "AVX512_BF16": {(_BF16, 8): 1, (_BF16, 4): 1, (_F32, 8): 4, (_F32, 4): 8},
    "AVX512": {(_BF16, 8): 3, (_BF16, 4): 8, (_F32, 8): 4, (_F32, 4): 8},
    "AVX2": {(_F32, 8): 8, (_F32, 4): 8, (_BF16, 8): 8, (_BF16, 4): 8},
}.get(_CAPABILITY, dict.fromkeys([(_F32, 8), (_F32, 4), (_BF16, 8), (_BF16, 4)], 0))
"""The crossover of a quantized CPU projection, by compute dtype and bit width: calls of at most this many tokens
(and at most ``spindle.kernels.cpu.MAX_INT8_TOKENS``) run the weight-only kernel
(``spindle.kernels.cpu.int8_linear``, ``int4_linear``), larger ones the panel kernel
(``spindle.kernels.cpu.quant_gemm``); neither needs a dense copy. bench/results/quant_linear.md has the tables.

AVX2-only EPYC (Zen 3), float32, 2 cores, SmolLM2's 30 layers of projections streamed as in a step, ms per step
(medians of 3; the machine was loaded by other jobs, times 10-70x a quiet one's), dense packed float32 / int8
weight-only, panel / int4 weight-only, panel: 1 token 57.4 / 40.3, 97.0 / 24.1, 131.3; 8 tokens 611 / 563, 1554 /
1660, 2202; 64 tokens 1568 / 1692 / 2122; 512 tokens 4756 / 6632 / 5994. The weight-only kernels won up to their
8 tokens in two runs; past them the panel kernel took 1.1-1.6x the dense weight's time. bf16 activations on AVX2
compute in float32 in both kernels: the same limits.
The AVX-512 limits are those measured against the dense bf16 copy, before the panel kernel existed (an AVX-512 bf16
EPYC, Zen 4, 2 cores, ms per step, dense bf16 ours / int8 / int4 torch's: 1 token 8.9 / 6.5 / 8.1, 2 tokens 10.0 /
10.2 / 11.0, 4 tokens 9.4 / 18.8 / 14.2, 8 tokens 8.9 / 33.6 / 21.1); the panel kernel is unmeasured there, its
limits too. Other CPUs (no AVX2) run the panel kernel at every size, unmeasured. The weight-only kernels against
dense weights on quiet machines, same steps: with oneDNN's packed bf16 (AVX-512 without bf16) bf16 / int8 / int4
torch's: 1 token 20.6 / 6.1 / 7.7, 2 tokens 23.6 / 11.2 / 7.9, 4 tokens 16.0 / 17.2 / 9.2, 8 tokens 16.6 / 30.8 /
20.0; a float32 model on the AVX-512 bf16 EPYC (oneDNN-packed float32 / int8 / int4 ours): 1 token 23.1 / 5.7 /
8.3, 4 tokens 19.8 / 12.2 / 11.0, 8 tokens 22.2 / 26.8 / 19.6; the AVX2 Zen 3 (float32 / int8 / int4 ours): 1 token
40.6 / 12.5 / 12.5, 2 tokens 76.1 / 14.8 / 13.3, 4 tokens 75.5 / 20.1 / 19.1, 8 tokens 67.9 / 39.3 / 40.1.

torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) is no longer used: on the AVX-512 bf16 EPYC it took 5.5 ms
for one token with bf16 activations against 8.8 for ours (13.9 against 22.2 for 8), but it reads a layout of its own
(``_convert_weight_to_int4pack_for_cpu``) that nothing else reads, and keeping it beside ours for larger batches
would double the int4 weights' memory; with float32 activations it was 12x slower than ours (100.7 ms against 8.3).
"""


_weight_only = False

FLOAT_ACTIVATIONS = "SPINDLE_FLOAT_ACTIVATIONS"
"""The environment variable that, set to ``1``, keeps every quantized CPU projection's activations float (as
:func:`weight_only` does within a block): for exact comparisons with a float reference, at the speed of the
weight-only kernels."""


@contextmanager
def weight_only(enabled: bool = True) -> Iterator[None]:
    """Within the block, quantized projections built on the CPU run weight-only, never W8A8 nor ``a8_linear``.

    Their activations then stay unquantized, as in the Triton kernel, which the GPU tests compare them with. The
    environment variable :data:`FLOAT_ACTIVATIONS` set to ``1`` does the same for a whole process and the processes
    it starts (tensor-parallel workers).
    """
    global _weight_only
    previous, _weight_only = _weight_only, enabled
    try:
        yield
    finally:
        _weight_only = previous


def can_tile(weight: torch.Tensor) -> bool:
    """Whether the weight runs ``spindle.kernels.cpu.bf16_linear`` (it is then laid out once by ``bf16_pack``).

    That is a bf16 ``[out, in]`` weight on a CPU with AVX-512 bf16, ``out`` a multiple of 16 and ``in`` even. The
    kernel replaces oneDNN's packed matmul there: 1.1-1.3x faster from 16 to 64 rows over SmolLM2's layers, about
    even from 512 rows on (its source and the docs' architecture page have the numbers).
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 2 == 0
        and cpu.bf16_linear_supported()
    )


def can_pack(weight: torch.Tensor) -> bool:
    """Whether :func:`pack_weight` applies: a CPU weight in float32, or in bf16 where oneDNN runs bf16 (AVX-512)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu.ONEDNN_BF16)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Return oneDNN's blocked copy of ``weight [out, in]``, which :class:`Projection` runs in place of it.

    ``F.linear`` reorders a plain bf16 weight into this layout on every call, and runs a float32 one through MKL's
    sgemm, which is slower at small batches. Measured on 2 cores over SmolLM2's projections, ms per step (plain /
    packed). bf16 on an AVX-512 EPYC (30 layers and the lm head): batch 1 17.5 / 10.4, batch 64 68.4 / 56.4, a
    512-token prefill 463 / 436. float32 on an AVX2-only EPYC (Zen 3), the 30 layers: batch 1 38.0 / 25.5, batch 8
    62.7 / 38.2, batch 64 130 / 128, batch 256 375 / 362, 512 tokens 823 / 754; its lm head: batch 1 8.0 / 4.0,
    batch 8 18.3 / 6.6, batch 64 39.5 / 25.9, batch 256 127 / 117. Packed float32 sums in another order than MKL:
    results differ from ``F.linear`` by float32 rounding (~1e-4 relative), not bit for bit.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class Projection:
    """One projection's weight in the forms its forward may take, and the choice between them per call.

    A quantized projection keeps its quantized form alone, on every device and CPU. On the CPU it runs with int8
    activations where the CPU allows (``a8_linear`` on AVX2, W8A8 for int8 per row on AVX-512 VNNI); else a call of
    few tokens runs the weight-only kernel and a larger one the panel kernel, by the crossover
    :data:`MAX_QUANTIZED_TOKENS`. One built within
    ``spindle.kernels.eager`` (``--enforce-eager``) runs torch's ops alone on the CPU: no tiles for our bf16 kernel
    (a weight oneDNN runs is still packed for it), and a quantized projection multiplies by its weight dequantized
    :data:`EAGER_PANEL_ROWS` output rows at a time. One built within ``spindle.kernels.force_triton`` runs its
    quantized form through the dispatched ``quantized_linear`` at every size, as on CUDA (the tests' device under
    Triton's interpreter); one built within :func:`weight_only` never quantizes its activations.

    Args:
        weight: the dense ``[out, in]`` weight in the compute dtype, or None when only the quantized form is given.
            Given with a quantized form, only its dtype is read (the activations' on the CPU; float32 without it).
            Alone, on the CPU it is laid out for our bf16 kernel where :func:`can_tile` says so, else pre-packed for
            oneDNN where :func:`can_pack` does (:func:`pack_weight`).
        bias: ``[out]`` or None.
        quantized: the weight-only quantized form, or None. On the CPU it is used as it is stored, or laid out for
            the W8A8 kernel where that runs; on CUDA it stays as it is, for the Triton kernel.

    Raises:
        ValueError: when neither form is given.

    """

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, quantized: QuantizedWeight | None = None
    ) -> None:
        if weight is None and quantized is None:
            raise ValueError("a projection needs a dense or a quantized weight")
        self.bias = bias
        self.out_features, self.in_features = quantized.shape if quantized is not None else weight.shape
        self.eager = is_eager()
        as_on_cuda = is_forced_triton()
        self.dtype = torch.float32 if weight is None else weight.dtype  # of the activations, on the CPU
        if quantized is not None:
            weight = None  # the quantized form serves every batch size: no dense copy is kept
        self.w8a8 = None if self.eager or as_on_cuda or float_activations() else _w8a8_form(quantized, self.dtype)
        self.dense = weight
        self.tiled = cpu.bf16_pack(weight) if weight is not None and not self.eager and can_tile(weight) else None
        usable = weight is not None and self.tiled is None and can_pack(weight)
        self.packed = pack_weight(weight) if usable else None
        if self.packed is not None or self.tiled is not None:
            self.dense = None  # the laid-out copy stands in for it; keeping both would double the memory
        self.quantized = quantized
        self.bits = 0 if quantized is None else quantized.bits
        self.group_size = 0 if quantized is None else quantized.group_size
        self.on_cpu = quantized is not None and quantized.qweight.device.type == "cpu" and not as_on_cuda
        self._cpu_quantized: tuple[torch.Tensor | None, ...] | None = None
        # Per part: a8_pack's tensors, its output rows and group size.
        self._a8_parts: list[tuple[tuple[torch.Tensor | None, ...], int, int]] = []
        self.a8 = False
        if self.on_cpu and not self.eager and self.w8a8 is None:
            parts = quantized.parts or (quantized,)
            self.a8 = not float_activations() and all(runs_a8(part, self.dtype) for part in parts)
            if self.a8:  # the interleaved copies replace the weight's own tensors: no second copy is kept
                self._a8_parts = [(a8_form(part), part.shape[0], part.group_size) for part in parts]
                self.quantized = None
            else:
                self._cpu_quantized = _repack_for_cpu(quantized)
        if self.quantized is not None and self.quantized.parts is not None:
            self.quantized = dataclasses.replace(self.quantized, parts=None)  # only the a8 layout reads them

    @property
    def a8_parts(self) -> list[tuple[tuple[torch.Tensor | None, ...], int, int]] | None:
        """The parts ``a8_linear`` runs, ``(a8_pack's tensors, output rows, group size)`` each, in output order.

        None where the projection runs another kernel.
        """
        return self._a8_parts if self.a8 else None

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The tensors the CPU kernels read for this projection's weight, in the order they take them.

        Its a8 parts', its bf16 tiles or its W8A8 form; none where another layout runs it.
        """
        tensors = [tensor for packed, _, _ in self._a8_parts for tensor in packed if tensor is not None]
        return [*tensors, *([] if self.tiled is None else [self.tiled]), *(self.w8a8 or ())]

    def move_kernel_tensors(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each of :meth:`kernel_tensors` by ``moved(tensor)``, a copy of it (``huge_pages.gather``)."""
        self._a8_parts = [
            (tuple(None if tensor is None else moved(tensor) for tensor in packed), outputs, group_size)
            for packed, outputs, group_size in self._a8_parts
        ]
        if self.tiled is not None:
            self.tiled = moved(self.tiled)
        if self.w8a8 is not None:
            self.w8a8 = tuple(moved(tensor) for tensor in self.w8a8)

    def runs_weight_only(self, num_tokens: int) -> bool:
        """Whether a call over ``num_tokens`` rows runs the CPU weight-only kernel (else, if quantized, the panel one).

        False for W8A8, ``a8_linear``, eager and non-CPU projections, which have one path at every size.
        """
        if self.a8:
            return False
        limit = min(MAX_QUANTIZED_TOKENS.get((self.dtype, self.bits), 0), cpu.MAX_INT8_TOKENS)
        return self._cpu_quantized is not None and num_tokens <= limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        if self.w8a8 is not None:
            return cpu.w8a8_linear(_dense_rows(x), *self.w8a8, self.bias).view(*x.shape[:-1], -1)
        if self.a8:
            rows = _dense_rows(x)
            if len(self._a8_parts) == 1:
                packed, outputs, group_size = self._a8_parts[0]
                return self._finish(cpu.a8_linear(rows, *packed, group_size, outputs), x)
            out = torch.empty(rows.shape[0], self.out_features, dtype=rows.dtype)
            start = 0
            for packed, outputs, group_size in self._a8_parts:  # each part into its columns
                cpu.a8_linear(rows, *packed, group_size, outputs, out[:, start : start + outputs])
                start += outputs
            return self._finish(out, x)
        if self.quantized is None:
            if self.tiled is not None:
                return cpu.bf16_linear(_dense_rows(x), self.tiled, self.out_features, self.bias).view(*x.shape[:-1], -1)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return F.linear(x, self.dense, self.bias)  # type: ignore[arg-type]
        if self._cpu_quantized is None:
            if self.on_cpu:  # eager
                return _panel_linear(x, self.quantized, self.bias)
            return quantized_linear(x, self.quantized, self.bias)
        rows = _dense_rows(x)
        if not self.runs_weight_only(rows.shape[0]):
            out = cpu.quant_gemm(rows, *self._cpu_quantized, self.group_size, self.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        kernel = cpu.int4_linear if self.bits == 4 else cpu.int8_linear
        return self._finish(kernel(rows, *self._cpu_quantized, self.group_size), x)

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A kernel's ``[tokens, out]`` result with the bias added, shaped as ``x``'s leading dimensions."""
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


EAGER_PANEL_ROWS = 1024
"""Output rows of a quantized weight that an eager CPU projection dequantizes at a time (a transient float panel
of ``1024 x in`` values, 2.4 MB for SmolLM2's 576 inputs in float32), never the whole matrix."""


def _panel_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` by torch's ops, :data:`EAGER_PANEL_ROWS` output rows at a time."""
    outputs = weight.shape[0]
    parts = [
        F.linear(x, dequantize(weight.narrow(0, start, min(EAGER_PANEL_ROWS, outputs - start)), x.dtype))
        for start in range(0, outputs, EAGER_PANEL_ROWS)
    ]
    out = torch.cat(parts, dim=-1)
    return out if bias is None else out + bias


def quantized_embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (``[T]``) of the matrix ``weight`` stands for, dequantized to ``dtype``: ``[T, in]``.

    An embedding lookup that gathers the quantized rows alone, where a model keeps its table quantized (a tied LM
    head), the same values as a lookup in the dequantized table. On the CPU one C++ pass
    (``spindle.kernels.cpu.dequantize_rows``) does it, outside ``eager``.
    """
    floats = weight.scales.dtype == torch.float32 and (weight.zeros is None or weight.zeros.dtype == torch.float32)
    on_cpu = weight.qweight.device.type == "cpu" and not is_eager() and not is_forced_triton()
    if on_cpu and floats and dtype in (torch.float32, torch.bfloat16):
        return cpu.dequantize_rows(weight.qweight, weight.scales, weight.zeros, weight.group_size, ids, dtype)
    return dequantize(weight.select(ids), dtype)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` as ``[tokens, in]`` rows whose elements are adjacent, as our CPU kernels read them."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _w8a8_form(weight: QuantizedWeight | None, dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """The tensors ``spindle.kernels.cpu.w8a8_linear`` takes for ``weight``, or None where that kernel does not apply.

    It applies to an int8 CPU weight with one scale per row (``--quantization int8``; GGUF's Q8_0 blocks keep their
    scale per 32 inputs and the weight-only kernel), float32 or bf16 activations, ``out % 16 == 0`` and ``in`` a
    multiple of :data:`~spindle.kernels.quant.ACTIVATION_GROUP_SIZE`, on a CPU with AVX-512 VNNI and bf16.
    """
    if weight is None or weight.bits != 8 or weight.zeros is not None or weight.qweight.device.type != "cpu":
        return None
    outputs, inputs = weight.shape
    if weight.group_size != inputs or outputs % 16 or inputs % ACTIVATION_GROUP_SIZE:
        return None
    if dtype not in (torch.float32, torch.bfloat16) or not cpu.w8a8_supported():
        return None
    tiles, sums = cpu.int8_pack(weight.qweight)
    return tiles, sums, weight.scales.float().reshape(-1).contiguous()


def float_activations() -> bool:
    """Whether quantized CPU weights built now keep their activations float rather than quantizing them to int8.

    They do within :func:`weight_only` and where :data:`FLOAT_ACTIVATIONS` is set.
    """
    return _weight_only or os.environ.get(FLOAT_ACTIVATIONS) == "1"


def a8_form(weight: QuantizedWeight) -> tuple[torch.Tensor | None, ...]:
    """``spindle.kernels.cpu.a8_pack``'s tensors of the 2-D CPU ``weight`` (compact with super-block factors)."""
    return cpu.a8_pack(*_repack_for_cpu(weight), weight.group_size, _compact_factors(weight))


def runs_a8(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether a CPU projection of ``weight`` runs ``spindle.kernels.cpu.a8_linear`` (int8 activations) at every size.

    It does where the CPU has AVX2, the activations are float32 or bf16 and the layout suits the kernel (``in`` a
    multiple of :data:`~spindle.kernels.quant.A8_BLOCK`, groups of 16 int8 inputs or of a multiple of 32): the
    quantized formats' default, as llama.cpp's, unless the activations are kept float (:func:`weight_only`,
    :data:`FLOAT_ACTIVATIONS`). On a Zen 3 it ran one token 1.6x faster than the weight-only kernels and about even
    with the panel kernel from 64 tokens (bench/results/a8_linear.md).
    """
    _, inputs = weight.shape
    if inputs % A8_BLOCK or dtype not in (torch.float32, torch.bfloat16) or not cpu.a8_linear_supported():
        return False
    return weight.group_size % A8_BLOCK == 0 or (weight.bits == 8 and weight.group_size == 16)


def _compact_factors(weight: QuantizedWeight) -> torch.Tensor | None:
    """``weight``'s super-block factors where ``a8_pack`` can keep its scales compact with them, else None.

    That is groups of 16 or 32 and ``in`` a multiple of 256; without them the kernel reads float32 scales and offsets.
    """
    if weight.super_scales is None or weight.group_size not in (16, 32) or weight.shape[1] % SUPER_BLOCK:
        return None
    return weight.super_scales.float().contiguous()


def _repack_for_cpu(weight: QuantizedWeight) -> tuple[torch.Tensor | None, ...]:
    """The tensors the CPU kernels of ``weight`` take, as they are stored.

    The matrix, the float32 scales and the float32 offsets (None for an int8 matrix without them), for
    ``spindle.kernels.cpu.int8_linear``, ``int4_linear`` and ``quant_gemm``.
    """
    zeros = None if weight.zeros is None else weight.zeros.float().contiguous()
    return weight.qweight.contiguous(), weight.scales.float().contiguous(), zeros


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prepared: Projection | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias``, through ``prepared`` when the model has prepared its weights.

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]``; unread when ``prepared`` is given (it may then be an empty placeholder).
        bias: ``[out]`` or None; unread when ``prepared`` is given (it holds its own).
        prepared: the projection's prepared forms, or None to run ``F.linear`` on ``weight``.

    """
    return F.linear(x, weight, bias) if prepared is None else prepared(x)
