"""C++ kernels for the CPU path: attention, cache writes, per-token ops, argmax, bf16/int8/int4/W8A8 projections, LoRA.

They build with torch's JIT extension builder on first use and are cached across runs.
The build takes about 45 s on a 2-core machine (85 s when the sources included all of ATen and the pybind11
bindings all of torch's C++ API: each file now includes the headers it uses, and the kernels are instantiated for
the three model dtypes only). The library is kept as
``$SPINDLE_CACHE_DIR/kernels/spindle_cpu_ops-<key>/spindle_cpu_ops.so`` (``_v1.so`` where torch numbered a
process' second build; default ``~/.cache/spindle``, the variable the model loader's cache uses too), where the key
hashes the sources, the compiler flags, torch's and Python's versions and the instruction sets of the CPU
(``torch.cpu.get_capabilities()``: AVX2, AVX-512 and its extensions, AMX, ...): every checkout and virtualenv with
the same build on the same kind of CPU shares it, and a changed source builds anew. It is compiled for the machine
it runs on (``-march=native``), so a cache on a volume that machines of other CPUs share holds one library per
instruction-set mix, and none runs where its instructions do not exist.

Each build runs in a private temporary directory and is committed as a crash-safe cache entry
(:mod:`spindle.kernels.cache_entry`): one process builds while another that needs the same library waits for it,
and one killed mid-build leaves nothing that is trusted, nor anything that blocks the next (torch's own shared build
directory keeps a lock file that does).
"""

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

from spindle.kernels.cache_entry import MARKER, build_entry, is_complete
from spindle.kernels.quant import QuantizedWeight

logger = logging.getLogger(__name__)

ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
"""Whether oneDNN runs bf16 natively on this CPU (AVX-512 bf16 or AVX-NE-CONVERT): where bf16 projections are
pre-packed for it (``spindle.kernels.linear.can_pack``)."""

_NAME = "spindle_cpu_ops"
_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "bindings.cpp",
        "decode_attention.cpp",
        "prefill_attention.cpp",
        "elementwise.cpp",
        "bf16_linear.cpp",
        "quant_linear.cpp",
        "quant_gemm.cpp",
        "a8_linear.cpp",
        "w8a8_linear.cpp",
        "lora.cpp",
        "argmax.cpp",
        "cache.cpp",
        "moe.cpp",
        "decode_stack.cpp",
    )
]
_HEADERS = [
    Path(__file__).with_name(name) for name in ("common.h", "bf16_tiles.h", "quant_rows.h", "decode_stack.h", "ops.h")
]
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


@functools.cache
def cpu_ops() -> ModuleType:
    """The compiled extension (the attention kernels and the ops below): loaded from the cache, or built first."""
    key = cache_key()
    cache_dir = Path(os.environ.get("SPINDLE_CACHE_DIR") or Path.home() / ".cache" / "spindle") / "kernels"
    entry = cache_dir / f"{_NAME}-{key[:16]}"
    if is_complete(entry, key):  # the lock is only taken to build: a read-only cache loads as well
        try:
            return _load(entry)
        except ImportError as error:  # damaged on disk since it was committed: rebuilt, not failed on at every start
            logger.warning("The cached CPU kernels %s could not be loaded (%s): building them again", entry, error)
            (entry / MARKER).unlink(missing_ok=True)
    built: list[ModuleType] = []
    build_entry(entry, key, lambda scratch: built.append(_build(scratch)))
    # Built here, it is loaded already (the same extension must not be initialised twice); else by another process.
    return built[0] if built else _load(entry)


def _load(entry: Path) -> ModuleType:
    """The extension library of a cache entry, imported under the module name it was built with (its file's)."""
    library = next(entry.glob(f"{_NAME}*.so"), entry / f"{_NAME}.so")
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_key() -> str:
    """The hash of what the library depends on: sources, flags, torch, Python, and the CPU's instruction sets."""
    # -march=native compiles for every instruction set the CPU has: a library built elsewhere may use one missing here.
    instruction_sets = sorted(name for name, value in torch.cpu.get_capabilities().items() if value is True)
    key = hashlib.sha256()
    for part in (*_CFLAGS, *_LDFLAGS, torch.__version__, sys.version, platform.machine(), *instruction_sets):
        key.update(part.encode() + b"\0")
    for source in (*_SOURCES, *_HEADERS):
        key.update(source.read_bytes())
    return key.hexdigest()


def _build(out_dir: Path) -> ModuleType:
    """Compile the extension, copy its library into ``out_dir``, and return it loaded."""
    import ninja
    from torch.utils.cpp_extension import load

    # torch looks for ninja on PATH; the ninja wheel's binary sits in the venv, which need not be on it.
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix=f"{_NAME}-") as build_dir:
        module = load(
            name=_NAME,
            sources=[str(path) for path in _SOURCES],
            # Copies: torch appends its libraries to the list it is given, which would change cache_key() here.
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            build_directory=build_dir,
        )
        # torch names a second build in one process (after one that failed, in another directory) `<name>_v1`,
        # inside the library too: the file keeps the name it was built with, and is imported under it.
        library = Path(module.__file__)
        shutil.copyfile(library, out_dir / library.name)
    return module


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in one pass per token, with the residual add fused in; the contract of ``spindle.kernels.norm``'s."""
    if x.dim() == 2:
        # The model's own calls (flat [tokens, hidden] batches): no reshapes, at ~3 us each on 2 cores, 61 calls a step.
        if residual is None:
            return cpu_ops().rms_norm(x, weight, eps)
        return cpu_ops().add_rms_norm(x, residual, weight, eps)
    rows = x.reshape(-1, x.shape[-1])
    if residual is None:
        return cpu_ops().rms_norm(rows, weight, eps).view(x.shape)
    out, summed = cpu_ops().add_rms_norm(rows, residual.reshape(rows.shape), weight, eps)
    return out.view(x.shape), summed.view(x.shape)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy the new tokens' K/V heads into their cache slots; the contract of ``spindle.kernels.attention``'s.

    A slot outside the cache raises, and nothing is written then.
    """
    cpu_ops().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`rotary_embedding`, then :func:`reshape_and_cache` of the rotated keys, in one call; returns the query.

    The contract of ``spindle.kernels.rotary``'s.
    """
    return cpu_ops().rotary_embedding_and_cache(
        positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, as ``logits.argmax(-1)``: float32 ``[rows, width]``, dense rows."""
    return cpu_ops().argmax_rows(logits)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of the query and key heads in one pass; the contract of ``spindle.kernels.rotary``'s."""
    return cpu_ops().rotary_embedding(positions, query, key, cos_sin_cache)


@functools.cache
def bf16_linear_supported() -> bool:
    """Whether :func:`bf16_linear` runs on this CPU: the kernels were built for one with AVX-512 bf16."""
    return bool(cpu_ops().bf16_linear_supported())


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``[out, in]`` weight laid out for :func:`bf16_linear` (``out % 16 == 0``, ``in`` even), flat.

    Tiles of 48 output columns (the last of 16 or 32), each ``[in / 2][columns][2]``: for every pair of inputs the
    tile's columns side by side, the pair's two weights adjacent, as the bf16 dot product instruction reads them.
    """
    return cpu_ops().bf16_pack(weight)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, outputs: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for a bf16 weight in :func:`bf16_pack`'s layout, on AVX-512 bf16 (see its source for numbers).

    Args:
        x: ``[tokens, in]`` bf16, each row dense.
        packed: :func:`bf16_pack` of the ``[outputs, in]`` weight.
        outputs: the weight's output count.
        bias: ``[outputs]`` or None, added in float before the result is rounded to bf16.

    Returns:
        ``[tokens, outputs]`` bf16.

    """
    return cpu_ops().bf16_linear(x, packed, outputs, bias)


@functools.cache
def w8a8_supported() -> bool:
    """Whether :func:`w8a8_linear` runs on this CPU: the kernels were built for one with AVX-512 VNNI and bf16."""
    return bool(cpu_ops().w8a8_supported())


def int8_pack(qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 ``[out, in]`` weight laid out for :func:`w8a8_linear`: ``(tiles, sums)``, both flat.

    ``out % 16 == 0`` and ``in`` a multiple of ``spindle.kernels.quant.ACTIVATION_GROUP_SIZE``. Tiles of 48 output
    columns (the last of 16 or 32), each ``[in / 4][columns][4]``, as the int8 dot product instruction reads them;
    ``sums`` holds ``-128 * sum(w)`` over each group of each column, ``[groups][columns]`` per tile, which cancels the
    offset that makes the activations unsigned.
    """
    return cpu_ops().int8_pack(qweight)


def w8a8_linear(
    x: torch.Tensor, tiles: torch.Tensor, sums: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` for an int8 weight with one scale per row, ``x`` quantized to int8 on the fly (W8A8).

    Each row of ``x`` is quantized symmetrically with one scale per ``ACTIVATION_GROUP_SIZE`` inputs (its
    largest magnitude / 127, rounded to nearest even), as ``spindle.kernels.quant.w8a8_linear``, the reference, does;
    the products are summed exactly in int32 per group, then in float32. Needs AVX-512 VNNI (the source has numbers).

    Args:
        x: ``[tokens, in]``, float32 or bfloat16, dense rows.
        tiles: ``int8_pack(qweight)[0]``.
        sums: ``int8_pack(qweight)[1]``.
        scales: float32 ``[out]``, each row's weight scale.
        bias: ``[out]`` or None, added in float32.

    Returns:
        ``[tokens, out]`` in ``x``'s dtype.

    """
    return cpu_ops().w8a8_linear(x, tiles, sums, scales, bias)


MAX_INT8_TOKENS = 8
"""The most tokens :func:`int8_linear` and :func:`int4_linear` take (they keep a register accumulator per token)."""


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """``x @ dequantize(weight).T`` of an int8 weight, for 1 to :data:`MAX_INT8_TOKENS` rows, the weights read once.

    Args:
        x: ``[tokens, in]``, float32 or bfloat16, dense rows.
        qweight: int8 ``[out, in]``.
        scales: float32 ``[out, in // group_size]``.
        zeros: float32 ``[out, in // group_size]`` (``w = q * scale + zero``), or None for a symmetric weight.
        group_size: inputs per scale, a multiple of 16 (``in`` for one scale per row).

    Returns:
        ``[tokens, out]`` in ``x``'s dtype.

    """
    return cpu_ops().int8_linear(x, qweight, scales, zeros, group_size)


def int4_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x @ dequantize(weight).T`` of an int4 weight, for 1 to :data:`MAX_INT8_TOKENS` rows, the weights read once.

    Args:
        x: ``[tokens, in]``, float32 or bfloat16, dense rows.
        qweight: uint8 ``[out, in // 2]``, two values a byte (``spindle.kernels.quant``'s layout).
        scales: float32 ``[out, in // group_size]``.
        zeros: float32 ``[out, in // group_size]``: ``w = (q - 8) * scale + zero``.
        group_size: inputs per scale, a multiple of 32.

    Returns:
        ``[tokens, out]`` in ``x``'s dtype.

    """
    return cpu_ops().int4_linear(x, qweight, scales, zeros, group_size)


def dequantize_rows(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    ids: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``ids`` of an int8 or int4 weight (``spindle.kernels.quant``'s layout) dequantized: ``[T, in]``.

    One pass over the gathered rows, where ``spindle.kernels.quant.dequantize`` of the selected rows runs a dozen
    torch ops: a quantized embedding table's lookup, once a step.

    Args:
        qweight: int8 ``[out, in]``, or uint8 ``[out, in // 2]`` holding int4 two values a byte.
        scales: float32 ``[out, in // group_size]``.
        zeros: float32 ``[out, in // group_size]`` or None (required for int4).
        group_size: inputs per scale.
        ids: int64 ``[T]``, rows in ``[0, out)``.
        dtype: float32 or bfloat16, the result's.

    Raises:
        RuntimeError: for a row out of range or tensors not in that layout.

    """
    out = torch.empty(ids.shape[0], qweight.shape[1] * (1 if qweight.dtype == torch.int8 else 2), dtype=dtype)
    cpu_ops().dequantize_rows(qweight, scales, zeros, group_size, ids, out)
    return out


def a8_linear_supported() -> bool:
    """Whether :func:`a8_linear` runs on this CPU: the kernels were built for one with AVX2."""
    return bool(cpu_ops().a8_linear_supported())


def a8_pack(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    super_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """An int8 or int4 weight (``spindle.kernels.quant``'s layout) laid out for :func:`a8_linear`: 8 rows interleaved.

    Output rows go in panels of 8 (the last padded with zero rows); within a panel each block of 32 inputs is held
    as 32-byte chunks whose 32-bit lane ``j`` holds 4 consecutive inputs of row ``j`` (int4: the low nibbles inputs
    ``4c..4c+3`` of the block, the high ones ``16+4c..``). Scales and offsets go ``[panels, groups, 8]``; an int4
    weight's offsets absorb its ``- 8`` (``zero - 8 * scale``). An int8 weight whose values all lie in -32..31 (GGUF's
    Q6_K; Q5_K's and Q5_1's 0..31, with their offsets) packs in 6 bits (uint8, 6 bytes per input and panel):
    ``q + 32``'s low nibbles as int4's, its top 2 bits in two more chunks a block.

    With ``super_scales`` (GGUF's K-quants: :attr:`~spindle.kernels.quant.QuantizedWeight.super_scales`) the scales
    and offsets pack compact: int8 sub-scales ``scale / d`` and uint8 sub-minimums ``-offset / dmin`` per group,
    and ``(d, dmin)`` per 256 inputs, 2 bytes a group and row where float32 takes 8.

    Args:
        qweight: int8 ``[out, in]``, or uint8 ``[out, in // 2]`` holding int4 two values a byte.
        scales: float32 ``[out, in // group_size]``.
        zeros: float32 ``[out, in // group_size]`` (required for int4: ``w = (q - 8) * scale + zero``; int8
            ``w = q * scale + zero``), or None for symmetric int8.
        group_size: inputs per scale: a multiple of 32 that divides ``in`` (a multiple of 32), or 16 for int8.
        super_scales: float32 ``[out, in // 256, 2]`` or None; needs groups of 16 or 32, factors that float16 holds.

    Returns:
        ``(packed, scales, offsets, supers)`` for :func:`a8_linear` (``offsets`` None where ``zeros`` is, ``supers``
        where ``super_scales`` is).

    Raises:
        RuntimeError: for a layout the kernel cannot run, or ``super_scales`` whose integer multiples are not the
            scales and offsets (to rounding of the offsets) or that float16 does not hold exactly.

    """
    return cpu_ops().a8_pack(qweight, scales, zeros, group_size, super_scales)


def a8_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    supers: torch.Tensor | None,
    group_size: int,
    out_features: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequantize(weight).T`` of a weight laid out by :func:`a8_pack`, ``x`` quantized on the fly.

    Each row of ``x`` is quantized to int8 per block of 32 inputs (one scale a block, its largest magnitude / 127,
    rounded to nearest even), as ``spindle.kernels.quant.a8_linear``, the reference, does, and multiplied by the
    weight with integer dot products, 8 output rows at a time (``a8_linear.cpp`` has the design). Any number of rows.

    Args:
        x: ``[tokens, in]``, float32 or bfloat16, dense rows; ``in`` a multiple of 32.
        packed: :func:`a8_pack`'s weight.
        scales: :func:`a8_pack`'s scales (float32, or int8 sub-scales).
        offsets: :func:`a8_pack`'s offsets (float32, or uint8 sub-minimums), None for symmetric int8.
        supers: :func:`a8_pack`'s super-block factors, None for float32 scales.
        group_size: the weight's inputs per scale.
        out_features: the weight's output rows (before padding).
        out: where to write the result, ``[tokens, out_features]`` in ``x``'s dtype with dense rows (a column slice
            of a larger output may be given), or None for a new tensor.

    Returns:
        ``[tokens, out_features]`` in ``x``'s dtype (``out`` where given).

    """
    return cpu_ops().a8_linear(x, packed, scales, offsets, supers, group_size, out_features, out)


def quant_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` for any number of rows, from the quantized weight alone.

    Each OpenMP work item dequantizes a panel of output columns into float32 scratch and runs every row of ``x``
    against it (``quant_gemm.cpp`` has the design): the large-batch partner of :func:`int8_linear` and
    :func:`int4_linear`.

    Args:
        x: ``[tokens, in]``, float32, bfloat16 or float16, dense rows.
        qweight: int8 ``[out, in]``, or uint8 ``[out, in // 2]`` holding int4 two values a byte.
        scales: float32 ``[out, in // group_size]``.
        zeros: float32 ``[out, in // group_size]`` (required for int4: ``w = (q - 8) * scale + zero``; int8
            ``w = q * scale + zero``), or None for symmetric int8.
        group_size: inputs per scale, a multiple of 8 (16 for int4) that divides ``in``.
        bias: ``[out]`` or None, added in float32.

    Returns:
        ``[tokens, out]`` in ``x``'s dtype.

    """
    return cpu_ops().quant_gemm(x, qweight, scales, zeros, group_size, bias)


def lora_add_(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    segments: torch.Tensor,
    part_ends: list[int],
    ranks: torch.Tensor,
) -> None:
    """``y[t] += (x[t] @ lora_a[s].T) @ lora_bt[s]`` in place for the tokens of each ``(start, end, slot)`` segment.

    The rank is ``parts`` blocks (``len(part_ends)``), block ``p`` reaching only the output columns of part ``p``;
    only the first ``ranks[s, p]`` rows of each block are read (the rest, zeros by contract, are skipped).

    Args:
        y: ``[tokens, out]``, float32 or bfloat16, dense rows; written in place.
        x: ``[tokens, in]``, ``y``'s dtype, dense rows.
        lora_a: ``[slots, rank, in]``, dense.
        lora_bt: ``[slots, rank, out]``, dense.
        segments: int64 ``[num_segments, 3]``, each row a run of tokens ``[start, end)`` and its slot.
        part_ends: the end column of each part of the output, ascending, the last ``out``.
        ranks: int64 ``[slots, parts]``, each at most ``rank // parts``.

    """
    cpu_ops().lora_add_(y, x, lora_a, lora_bt, segments, part_ends, ranks)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU in one pass per token; the contract of ``spindle.kernels.activation``'s."""
    rows = x.reshape(-1, x.shape[-1])
    return cpu_ops().silu_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh GELU) in one pass per token; the contract of ``spindle.kernels.activation``'s."""
    rows = x.reshape(-1, x.shape[-1])
    return cpu_ops().gelu_tanh_and_mul(rows).view(*x.shape[:-1], x.shape[-1] // 2)


def moe_pack(weights: torch.Tensor) -> torch.Tensor:
    """Each matrix of an ``[experts, out, in]`` stack in the fused MoE op's tiles, as ``[experts, out * in]``.

    bf16 in :func:`bf16_pack`'s layout; float32 in tiles of 16 outputs, each ``[in][16]``.
    """
    return cpu_ops().moe_pack(weights)


def moe_route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and weights from the router's weight; ``spindle.kernels.moe.route_tokens``."""
    return cpu_ops().moe_route(x, router, top_k, renormalize)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    intermediate: int,
    tiled: bool,
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token; the contract of ``spindle.kernels.moe``'s.

    Args:
        x: ``[tokens, hidden]``, float32 or bfloat16.
        w13: ``[experts, 2 * intermediate, hidden]`` (gate rows, then up rows), or its :func:`moe_pack` when ``tiled``.
        w2: ``[experts, hidden, intermediate]``, or its :func:`moe_pack` when ``tiled``.
        topk_weights: ``[tokens, top_k]`` routing weights.
        topk_ids: int64 ``[tokens, top_k]`` expert ids.
        num_experts: the experts in ``w13`` and ``w2``.
        intermediate: each expert's intermediate size.
        tiled: whether the weights are :func:`moe_pack` ones (x then of their dtype): bf16 ones run on AMX or
            ``bf16_linear``'s kernel, float32 ones on the op's float micro-kernel.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.

    """
    return cpu_ops().fused_moe(x, w13, w2, topk_weights, topk_ids, num_experts, intermediate, tiled)


def fused_moe_a8(
    x: torch.Tensor,
    w13: list[torch.Tensor | None],
    w13_group_size: int,
    w2: list[torch.Tensor | None],
    w2_group_size: int,
    intermediate: int,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`fused_moe` of quantized experts laid out by :func:`a8_pack`, with int8 activations.

    The activations are quantized as :func:`a8_linear` quantizes them, and each expert's rows run its gate/up and
    down projections in ``a8_linear``'s kernel (one OpenMP region a projection, every expert's panels shared out in
    turn), in ``x``'s dtype.

    Args:
        x: ``[tokens, hidden]``, float32 or bfloat16.
        w13: :func:`a8_pack`'s four tensors (packed, scales, offsets, supers) of each expert's ``[2 * intermediate,
            hidden]`` matrix, each stacked by expert (None where ``a8_pack`` gave None).
        w13_group_size: the gate/up matrices' inputs per scale.
        w2: the same of each expert's ``[hidden, intermediate]`` matrix.
        w2_group_size: the down matrices' inputs per scale.
        intermediate: each expert's intermediate size.
        topk_weights: ``[tokens, top_k]`` routing weights.
        topk_ids: int64 ``[tokens, top_k]`` expert ids.

    """
    return cpu_ops().fused_moe_a8(x, w13, w13_group_size, w2, w2_group_size, intermediate, topk_weights, topk_ids)


def fused_moe_quantized(
    x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """:func:`fused_moe` of quantized experts, dequantized in registers, in float32 (output in ``x``'s dtype).

    Args:
        x: ``[tokens, hidden]``, float32 or bfloat16.
        w13: the ``[experts, 2 * intermediate, hidden]`` stack (``spindle.kernels.moe.quantize_experts``).
        w2: the ``[experts, hidden, intermediate]`` stack.
        topk_weights: ``[tokens, top_k]`` routing weights.
        topk_ids: int64 ``[tokens, top_k]`` expert ids.

    """
    return cpu_ops().fused_moe_quantized(
        x,
        w13.qweight,
        w13.scales,
        w13.zeros,
        w13.group_size,
        w2.qweight,
        w2.scales,
        w2.zeros,
        w2.group_size,
        topk_weights,
        topk_ids,
    )
