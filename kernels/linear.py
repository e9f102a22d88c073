"""Projections (``x @ W.T + b``) as the forward runs them: dense, pre-packed, or quantized.

On the CPU a dense bf16 weight runs our kernel where the CPU has AVX-512 bf16 (``spindle.kernels.cpu.bf16_linear``,
its weight laid out once by :func:`~spindle.kernels.cpu.bf16_pack`: :func:`can_tile`), and any other float32 or bf16
weight is pre-packed into oneDNN's blocked layout (:func:`pack_weight`). A quantized
projection (:class:`~spindle.kernels.quant.QuantizedWeight`) runs a weight-only kernel (int8 ours,
``spindle.kernels.cpu.int8_linear``; int4 torch's) for small batches only, and keeps the dense copy for the rest: see
:data:`MAX_QUANTIZED_TOKENS` for what was measured. An int8 weight with one scale per row runs W8A8 instead
(``spindle.kernels.cpu.w8a8_linear``: the activations quantized per group of inputs on the fly) at every batch size
where the CPU has AVX-512 VNNI (outside :func:`weight_only`), and keeps no dense copy: it beats the bf16 kernel 1.3-1.9x
from 1 to 512 rows. On CUDA a quantized projection keeps no dense copy: the Triton kernel dequantizes in registers at
every batch size; one built within ``spindle.kernels.force_triton`` runs that kernel on CPU tensors too.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from spindle.kernels import cpu, is_eager, is_forced_triton, quantized_linear
from spindle.kernels.quant import ACTIVATION_GROUP_SIZE, QuantizedWeight

_CAPABILITY = torch.backends.cpu.get_cpu_capability()
if _CAPABILITY == "AVX512" and torch.cpu._is_avx512_bf16_supported():
    # The dense bf16 copy runs our kernel there (can_tile: the kernels are built for this CPU's instructions).
    _CAPABILITY = "AVX512_BF16"

TORCH_INT4 = _CAPABILITY in ("AVX512", "AVX512_BF16")
"""Whether int4 projections with bf16 activations run torch's CPU kernel (``_weight_int4pack_mm_for_cpu``, fast with
AVX-512 only) rather than ours (``spindle.kernels.cpu.int4_linear``). float32 ones always run ours: with float32
activations torch's took 100.7 ms over SmolLM2's 30 layers for one token on an AVX-512 bf16 EPYC (Zen 4), 782.6 for
8, against 8.3 and 19.6 (bf16 activations: torch's 5.5 and 13.9, ours 8.8 and 22.2)."""

_F32, _BF16 = torch.float32, torch.bfloat16
MAX_QUANTIZED_TOKENS: dict[tuple[torch.dtype, int], int] = {
    "AVX512_BF16": {(_BF16, 8): 1, (_BF16, 4): 1, (_F32, 8): 4, (_F32, 4): 8},
    "AVX512": {(_BF16, 8): 3, (_BF16, 4): 8, (_F32, 8): 4, (_F32, 4): 8},
    "AVX2": {(_F32, 8): 8, (_F32, 4): 8, (_BF16, 8): 8, (_BF16, 4): 8},
}.get(_CAPABILITY, dict.fromkeys([(_F32, 8), (_F32, 4), (_BF16, 8), (_BF16, 4)], 0))
"""Calls of at most this many tokens run the CPU quantized kernel, by compute dtype and bit width; larger ones (and
any dtype or CPU not listed) the dense weight.

Measured on 2 cores over SmolLM2's 30 layers of projections, weights streamed from memory as in a real step (ms per
step, medians). On an AVX-512 bf16 EPYC (Zen 4), bf16 in our kernel (``spindle.kernels.cpu.bf16_linear``) / int8
``spindle.kernels.cpu.int8_linear`` / int4 torch's kernel, group 32, two runs: 1 token 8.9, 7.4 / 6.5, 7.4 / 8.1,
10.0; 2 tokens 10.0, 6.9 / 10.2, 8.4 / 11.0, 10.2; 4 tokens 9.4, 7.6 / 18.8, 14.9 / 14.2, 12.4; 8 tokens 8.9 / 33.6 /
21.1; 16 tokens 12.9 / 47.2 / 34.6. One token stays quantized: the lm head's int8 copy reads half the bytes of its
bf16 one. With oneDNN's packed matmul for the dense copy (AVX-512 without bf16, or before our kernel):
bf16 oneDNN-packed / int8 / int4: 1 token 20.6 / 6.1 / 7.7, 2 tokens 23.6 / 11.2 / 7.9, 4 tokens 16.0 / 17.2 / 9.2,
8 tokens 16.6 / 30.8 / 20.0, 16 tokens 32.1 / - / 31.9. (torch's own int8 kernel took 14.2 ms for one token and 111
for 16.) On an
AVX2-only EPYC (Zen 3, no bf16: float32 dense / int8 ours / int4 ours): 1 token 40.6 / 12.5 / 12.5, 2 tokens 76.1 /
14.8 / 13.3, 4 tokens 75.5 / 20.1 / 19.1, 8 tokens 67.9 / 39.3 / 40.1; torch's int4 kernel there: 140, 262, 523 and
1,024 ms, which is why int4 runs ours on AVX2, and int8 a hand-written AVX2 loop (gcc left the generic one at 46 ms
for one token).
A float32 model on the AVX-512 bf16 EPYC (its dense copy oneDNN-packed float32): float32 dense / int8 / int4 ours:
1 token 23.1, 20.6 / 5.7 / 8.3, 2 tokens 24.3, 23.1 / 7.4 / 8.9, 4 tokens 19.8, 20.2 / 12.2 / 11.0, 8 tokens 22.2,
23.3 / 26.8 / 19.6; AVX-512 CPUs without bf16 get the same limits for float32 (the same oneDNN kernel), unmeasured.
Other CPUs (no AVX2) are unmeasured: their projections run dense.
"""


_weight_only = False


@contextmanager
def weight_only(enabled: bool = True) -> Iterator[None]:
    """Within the block, int8 projections built on the CPU run weight-only, never W8A8.

    Their activations then stay unquantized, as in the Triton kernel, which the GPU tests compare them with.
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

    One built within ``spindle.kernels.eager`` (``--enforce-eager``) runs torch's ops alone on the CPU: no tiles
    for our bf16 kernel (a weight oneDNN runs is still packed for it), and a quantized projection with a dense copy
    runs that copy at every size (the quantized kernels there are ours, or need a layout repacked by one of ours).
    One built within ``spindle.kernels.force_triton`` runs its quantized form through the dispatched
    ``quantized_linear`` at every size, as on CUDA (the tests' device under Triton's interpreter); one built within
    :func:`weight_only` never runs W8A8.

    Args:
        weight: the dense ``[out, in]`` weight in the compute dtype, or None when only the quantized form is kept.
            On the CPU it is laid out for our bf16 kernel where :func:`can_tile` says so, else pre-packed for oneDNN
            where :func:`can_pack` does (:func:`pack_weight`).
        bias: ``[out]`` or None.
        quantized: the weight-only quantized form, or None. On the CPU int4 is repacked into the layout of torch's
            kernel and int8 stays as it is, for ours, or is laid out for the W8A8 kernel where that runs (then no
            dense copy is kept); on CUDA both stay as they are, for the Triton kernel.

    Raises:
        ValueError: when neither form is given.

    """

    def __init__(
        self, weight: torch.Tensor | None, bias: torch.Tensor | None = None, quantized: QuantizedWeight | None = None
    ) -> None:
        if weight is None and quantized is None:
            raise ValueError("a projection needs a dense or a quantized weight")
        self.bias = bias
        self.out_features, self.in_features = quantized.shape if weight is None else weight.shape
        self.eager = is_eager()
        as_on_cuda = is_forced_triton()
        self.dtype = torch.float32 if weight is None else weight.dtype  # of the activations, on the CPU
        self.w8a8 = None if self.eager or as_on_cuda or _weight_only else _w8a8_form(quantized, self.dtype)
        if self.w8a8 is not None:
            weight = None  # the W8A8 kernel beats the dense copy at every batch size: none is kept
        self.dense = weight
        self.tiled = cpu.bf16_pack(weight) if weight is not None and not self.eager and can_tile(weight) else None
        usable = weight is not None and self.tiled is None and can_pack(weight)
        self.packed = pack_weight(weight) if usable else None
        if self.packed is not None or self.tiled is not None:
            self.dense = None  # the laid-out copy stands in for it; keeping both would double the memory
        self.quantized = quantized
        self.bits = 0 if quantized is None else quantized.bits
        self.torch_int4 = TORCH_INT4 and self.dtype == torch.bfloat16
        self._cpu_quantized: tuple[torch.Tensor, ...] | None = None
        on_cpu = quantized is not None and quantized.qweight.device.type == "cpu" and not as_on_cuda
        if on_cpu and not self.eager and self.w8a8 is None:
            self._cpu_quantized = _repack_for_cpu(quantized, self.torch_int4)

    def uses_quantized(self, num_tokens: int) -> bool:
        """Whether a call over ``num_tokens`` rows runs the quantized kernel (else the dense weight)."""
        if self.quantized is None:
            return False
        if self.w8a8 is not None or (self.dense is None and self.packed is None and self.tiled is None):
            return True
        limit = MAX_QUANTIZED_TOKENS.get((self.dtype, self.bits), 0)
        return not self.eager and (self._cpu_quantized is None or num_tokens <= limit)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        if self.w8a8 is not None:
            return cpu.w8a8_linear(_dense_rows(x), *self.w8a8, self.bias).view(*x.shape[:-1], -1)
        if not self.uses_quantized(x.numel() // x.shape[-1]):
            if self.tiled is not None:
                return cpu.bf16_linear(_dense_rows(x), self.tiled, self.out_features, self.bias).view(*x.shape[:-1], -1)
            if self.packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return F.linear(x, self.dense, self.bias)  # type: ignore[arg-type]
        if self._cpu_quantized is None:
            return quantized_linear(x, self.quantized, self.bias)  # type: ignore[arg-type]
        rows = x.reshape(-1, x.shape[-1])
        qweight, scales = self._cpu_quantized[:2]
        group_size = self.quantized.group_size  # type: ignore[union-attr]
        if self.bits == 4 and self.torch_int4:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, qweight, group_size, scales.to(x.dtype))
        elif rows.shape[0] <= cpu.MAX_INT8_TOKENS and x.dtype in (torch.float32, torch.bfloat16):
            kernel = cpu.int4_linear if self.bits == 4 else cpu.int8_linear
            out = kernel(rows, *self._cpu_quantized, group_size)
        elif self.bits == 8 and scales.shape[1] == 1:
            out = torch._weight_int8pack_mm(rows, qweight, scales[:, 0].to(x.dtype))
        else:  # past our kernels' token count, where torch has no kernel for the layout (Q8_0 groups, our int4)
            return quantized_linear(x, self.quantized, self.bias)  # type: ignore[arg-type]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` as ``[tokens, in]`` rows whose elements are adjacent, as our CPU kernels read them."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _w8a8_form(weight: QuantizedWeight | None, dtype: torch.dtype) -> tuple[torch.Tensor, ...] | None:
    """The tensors ``spindle.kernels.cpu.w8a8_linear`` takes for ``weight``, or None where that kernel does not apply.

    It applies to an int8 CPU weight with one scale per row (``--quantization int8``; GGUF's Q8_0 blocks keep their
    scale per 32 inputs and the weight-only kernel), float32 or bf16 activations, ``out % 16 == 0`` and ``in`` a
    multiple of :data:`~spindle.kernels.quant.ACTIVATION_GROUP_SIZE`, on a CPU with AVX-512 VNNI and bf16.
    """
    if weight is None or weight.bits != 8 or weight.qweight.device.type != "cpu":
        return None
    outputs, inputs = weight.shape
    if weight.group_size != inputs or outputs % 16 or inputs % ACTIVATION_GROUP_SIZE:
        return None
    if dtype not in (torch.float32, torch.bfloat16) or not cpu.w8a8_supported():
        return None
    tiles, sums = cpu.int8_pack(weight.qweight)
    return tiles, sums, weight.scales.float().reshape(-1).contiguous()


def _repack_for_cpu(weight: QuantizedWeight, torch_int4: bool) -> tuple[torch.Tensor | None, ...]:
    """The tensors the CPU kernel of ``weight`` takes (torch's int4 one only ever sees bf16 activations).

    int8: the int8 matrix, the float32 scales and offsets (None where it has none) as they are
    (``spindle.kernels.cpu.int8_linear`` takes them so).
    int4 for ours (``torch_int4`` false): the packed matrix, scales and offsets as they are. int4 for torch's: the
    matrix repacked by ``aten._convert_weight_to_int4pack_for_cpu`` and scales and offsets interleaved
    ``[in // group, out, 2]``, in bf16.
    """
    if weight.bits == 8:
        zeros = None if weight.zeros is None else weight.zeros.float().contiguous()
        return weight.qweight.contiguous(), weight.scales.float().contiguous(), zeros
    if not torch_int4:
        zeros = weight.zeros.float().contiguous()  # type: ignore[union-attr]
        return weight.qweight.contiguous(), weight.scales.float().contiguous(), zeros
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.unpacked().contiguous(), 1)
    scales_and_zeros = torch.stack([weight.scales.T, weight.zeros.T], dim=-1)  # type: ignore[union-attr]
    return packed, scales_and_zeros.to(torch.bfloat16).contiguous()


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
