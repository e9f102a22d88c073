"""Weight-only quantized GEMM in Triton: ``x @ dequantize(weight).T + bias`` without a float copy of the weight.

Reads a :class:`~spindle.kernels.quant.QuantizedWeight` as it is stored (int8 rows with a scale per row or per
group of 16 or more inputs, and per-group offsets where it has them, or int4 nibble pairs with per-group scales and
offsets). Grid ``(M tiles, N tiles)``: each program loops over K, loads a tile of integer
weights, turns it into the activation dtype in registers and feeds it with the activation tile to ``tl.dot``, which
accumulates in float32. The integers are the only weight bytes read, which is what makes this worth having: decode
steps are bound by weight bandwidth, and int4 reads a quarter of what bf16 would.

int8 with one scale per row takes a shortcut: the integers are exact in bf16/fp16, so the dot runs on them as they
are and the row scale multiplies the float32 sum once at the end: cheaper than scaling every element, and no
weight is rounded to the activation dtype.

Decode-sized batches (``M <= 16``) split K across programs (split-K): a 4096x4096 projection has only 64-128
column tiles, too few programs to keep an H200's 132 SMs streaming weights. Each program then sums a slice of K and
stores float32 partial sums; a second, small kernel adds them in split order and applies the row scale and the bias.
Two passes rather than atomics: the result does not depend on the order programs finish in (atomic float adds
would make a decode step's logits vary from run to run), and atomics would need a zeroed float32 buffer and a cast
pass, one launch more. The split count follows the shape and the SM count only, never ``M``.

Tile sizes come from a small fixed set, so a model compiles a handful of variants per layer shape, and the number
of tokens ``M`` is not specialised on: a new batch size does not recompile.
"""

import math

import torch
import triton
import triton.language as tl

from spindle.kernels.quant import QuantizedWeight
from spindle.kernels.triton.attention_tile import dot_in_fp32
from spindle.kernels.triton.decode_attention import _multiprocessors

BLOCK_K_CHOICES = (64, 32, 16)
"""Inputs per K step, largest first. A group-wise weight (int4) takes the largest that divides its group size, so
that a step stays inside one group and needs one scale per row (32 and a scale per element if none does); int8 with
one scale per row takes 64, or 32 for float32, whose tiles are twice the bytes."""

DECODE_ROWS = 16
"""Batches of up to this many tokens take the decode tiles (one 16-row tensor-core tile) and split K."""

DECODE_BLOCK_N = 64
"""Weight rows per decode program: with 16 activation rows, an int8 tile's weight bytes are twice its activation
bytes, int4's equal, so the activations re-read from L2 by every column tile stay below the weight stream."""

DECODE_BLOCK_K = 128
"""Inputs per decode K step: 8 KiB of int8 weights per step, 4 KiB of int4, so that a few programs per SM keep
enough loads in flight to stream from HBM. Group-wise weights take it when it holds whole groups or lies inside one.
float32 takes a quarter: its exact dots hold both operands in registers (at 64 inputs they spill)."""

PROGRAMS_PER_SM = 4
"""Decode programs wanted per SM: split K until the column tiles times the splits reach this many per SM."""

MIN_STEPS_PER_SPLIT = 4
"""A split covers at least this many K steps, so that its loads still pipeline and the partial sums stay few."""

REDUCE_BLOCK_N = 256
"""Columns per program of the split-K reduction."""


# Only M changes from step to step; the strides are per-layer constants (x's rows are K apart whatever M is), so they
# keep Triton's divisibility specialisation, which lets the loads vectorise.
@triton.jit(do_not_specialize=["M"])
def _quant_linear_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    stride_os,
    GROUP_SIZE: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    GROUPS_PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge wrap onto valid ones instead of being masked: the loads in the K loop stay
    # unmasked (and vectorised), and the store below drops the duplicates.
    x_rows = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm
    n = (cols % N).to(tl.int64)
    w_rows = qweight_ptr + n[:, None] * stride_qn
    s_rows = scales_ptr + n * stride_sn
    z_rows = zeros_ptr + n * stride_sn
    k_range = tl.arange(0, BLOCK_K)
    # int4 stores inputs 2i and 2i+1 in one byte: a K step reads half as many bytes as it has inputs.
    b_range = tl.arange(0, BLOCK_K // 2) if PACKED else k_range

    # Program (.., .., s) sums inputs [s * k_per_split, (s + 1) * k_per_split): all of K without split-K.
    k_start = tl.program_id(2) * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + k_range
        if PACKED:
            b = k0 // 2 + b_range
        else:
            b = k
        if EVEN_K:
            x = tl.load(x_rows + k[None, :])
            q = tl.load(w_rows + b[None, :])
        else:
            x = tl.load(x_rows + k[None, :], mask=(k < K)[None, :], other=0.0)
            # Masked inputs read q = 0, a weight of 0 (or of the zero point): harmless against x = 0.
            q = tl.load(w_rows + b[None, :], mask=(b < (K // 2 if PACKED else K))[None, :], other=0)
        if PACKED:
            q = tl.interleave(q & 0xF, q >> 4)
        if ROW_SCALE:
            # |q| <= 128 is exact in every activation dtype. Under the interpreter bf16 dots run in float32 and its
            # integer-to-bf16 cast gives wrong bits, so q goes to float32 directly.
            if DOT_FP32:
                w = q.to(tl.float32)
            else:
                w = q.to(x.dtype)
        else:
            if SCALE_PER_TILE:
                # The step lies inside one group (BLOCK_K divides GROUP_SIZE): one scale per weight row.
                g = k0 // GROUP_SIZE
                s = tl.load(s_rows + g)[:, None]
                if HAS_ZEROS:
                    z = tl.load(z_rows + g)[:, None]
            elif GROUPS_PER_TILE > 1:
                # The step holds whole groups: one scale per row and group, broadcast over the group in registers
                # (a scale load per weight would cost more load instructions than the weights themselves).
                g = k0 // GROUP_SIZE + tl.arange(0, GROUPS_PER_TILE)[None, :]
                g_mask = g < K // GROUP_SIZE
                s = tl.load(s_rows[:, None] + g, mask=g_mask, other=0.0)[:, :, None]
                if HAS_ZEROS:
                    z = tl.load(z_rows[:, None] + g, mask=g_mask, other=0.0)[:, :, None]
                q = tl.reshape(q, [BLOCK_N, GROUPS_PER_TILE, GROUP_SIZE])
            else:
                g = tl.minimum(k, K - 1)[None, :] // GROUP_SIZE
                s = tl.load(s_rows[:, None] + g)
                if HAS_ZEROS:
                    z = tl.load(z_rows[:, None] + g)
            # float32 as in the reference, then one rounding to the dtype the dot takes.
            if HAS_ZEROS and PACKED:
                w = ((q.to(tl.float32) - 8.0) * s + z).to(x.dtype)
            elif HAS_ZEROS:  # int8 with offsets (GGUF's Q5_K): no centre
                w = (q.to(tl.float32) * s + z).to(x.dtype)
            else:
                w = (q.to(tl.float32) * s).to(x.dtype)
            if GROUPS_PER_TILE > 1:
                w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        # "ieee" keeps fp32 products exact on GPUs that would round them to TF32 (bf16/fp16 are unaffected).
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")

    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT_K:
        # The partial sum as it is: _split_k_reduce_kernel scales, adds the bias and rounds once.
        out = out_ptr + tl.program_id(2) * stride_os + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc, mask=mask)
    else:
        if ROW_SCALE:
            acc *= tl.load(s_rows)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    partials_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    N,
    num_splits,
    stride_ps,
    stride_sn,
    stride_om,
    ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    partials = partials_ptr + row * N + cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Always in split order: the same inputs give the same bits, whichever program finished first.
    for split in range(num_splits):
        acc += tl.load(partials + split * stride_ps, mask=mask, other=0.0)
    if ROW_SCALE:
        acc *= tl.load(scales_ptr + cols * stride_sn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with the weight dequantized in registers (Triton; same contract as torch's).

    The weight tiles are rounded to ``x``'s dtype for the tensor cores (the reference keeps them in float32), except
    int8 with one scale per row, whose integers go in exactly. Accumulation is float32, the output rounded once.

    Args:
        x: ``[..., in_features]``, float32, bfloat16 or float16.
        weight: the quantized ``[out_features, in_features]`` matrix, on ``x``'s device.
        bias: ``[out_features]`` or None.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.

    Raises:
        ValueError: when ``x``'s last dimension is not ``in_features``.

    """
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {in_features}")
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    qweight, scales = _last_dim_contiguous(weight.qweight), _last_dim_contiguous(weight.scales)
    zeros = None if weight.zeros is None else _last_dim_contiguous(weight.zeros)
    if zeros is not None and zeros.stride(0) != scales.stride(0):
        zeros = zeros.contiguous()
        scales = scales.contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0]
    if num_rows == 0 or out_features == 0:
        return out
    if in_features == 0:
        # Nothing to multiply: the bias alone, as the reference gives.
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    row_scale = weight.zeros is None and weight.group_size == in_features
    if num_rows <= DECODE_ROWS:
        block_m, block_n, block_k = DECODE_ROWS, DECODE_BLOCK_N, _decode_block_k(x.dtype, row_scale, weight.group_size)
        processors = _multiprocessors(x.device) if x.device.type == "cuda" else 1
        num_splits, k_per_split = split_k(triton.cdiv(out_features, block_n), in_features, block_k, processors)
    else:
        block_m, block_n, block_k = _prefill_block_sizes(num_rows, x.dtype, row_scale, weight.group_size)
        num_splits, k_per_split = 1, triton.cdiv(in_features, block_k) * block_k
    out_rows = out.view(num_rows, out_features)
    target = out_rows
    if num_splits > 1:
        # DECODE_ROWS rows per split whatever M is, so that no stride follows the batch size.
        target = torch.empty((num_splits, DECODE_ROWS, out_features), dtype=torch.float32, device=x.device)
    _quant_linear_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n), num_splits)](
        rows,
        qweight,
        scales,
        scales if zeros is None else zeros,
        out if bias is None else bias,
        target,
        num_rows,
        out_features,
        in_features,
        k_per_split,
        # One row's stride is never used; K keeps it from being specialised on as 1 or a new value.
        rows.stride(0) if num_rows > 1 else in_features,
        qweight.stride(0),
        scales.stride(0),
        out_features if num_splits > 1 else out_rows.stride(0),
        DECODE_ROWS * out_features,
        GROUP_SIZE=weight.group_size,
        PACKED=weight.bits == 4,
        HAS_ZEROS=zeros is not None,
        ROW_SCALE=row_scale,
        SCALE_PER_TILE=weight.group_size % block_k == 0,
        GROUPS_PER_TILE=block_k // weight.group_size if block_k % weight.group_size == 0 else 1,
        HAS_BIAS=bias is not None,
        SPLIT_K=num_splits > 1,
        EVEN_K=in_features % block_k == 0,
        DOT_FP32=dot_in_fp32(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    if num_splits > 1:
        _split_k_reduce_kernel[(num_rows, triton.cdiv(out_features, REDUCE_BLOCK_N))](
            target,
            scales,
            out if bias is None else bias,
            out_rows,
            out_features,
            num_splits,
            DECODE_ROWS * out_features,
            scales.stride(0),
            out_rows.stride(0),
            ROW_SCALE=row_scale,
            HAS_BIAS=bias is not None,
            BLOCK_N=REDUCE_BLOCK_N,
        )
    return out


def split_k(column_tiles: int, in_features: int, block_k: int, processors: int) -> tuple[int, int]:
    """``(splits, inputs per split)`` of a decode-sized product: enough programs for the SMs, never an empty split.

    Splits until ``column_tiles * splits`` reaches :data:`PROGRAMS_PER_SM` programs per SM, with at least
    :data:`MIN_STEPS_PER_SPLIT` K steps per split; the inputs per split are a whole number of K steps, and the last
    split takes what is left. A function of the shape and the GPU only, so every batch size of a layer launches
    the same programs (and a CUDA graph captured at one size holds for all).
    """
    k_steps = triton.cdiv(in_features, block_k)
    wanted = math.ceil(PROGRAMS_PER_SM * processors / column_tiles)
    steps_per_split = triton.cdiv(k_steps, max(1, min(wanted, k_steps // MIN_STEPS_PER_SPLIT)))
    return triton.cdiv(k_steps, steps_per_split), steps_per_split * block_k


def _decode_block_k(dtype: torch.dtype, row_scale: bool, group_size: int) -> int:
    """The decode K step: :data:`DECODE_BLOCK_K` (a quarter in float32) unless groups fit it neither way."""
    block_k = DECODE_BLOCK_K // 4 if dtype == torch.float32 else DECODE_BLOCK_K
    if row_scale or block_k % group_size == 0 or group_size % block_k == 0:
        return block_k
    return next((b for b in BLOCK_K_CHOICES if group_size % b == 0), 32)


def _prefill_block_sizes(num_rows: int, dtype: torch.dtype, row_scale: bool, group_size: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of a batch of more than :data:`DECODE_ROWS` tokens: 32 or 64 rows, 64 columns."""
    block_m = min(64, triton.next_power_of_2(num_rows))
    if row_scale:
        block_k = 32 if dtype == torch.float32 else 64
    else:
        block_k = next((b for b in BLOCK_K_CHOICES if group_size % b == 0), 32)
    return block_m, 64, block_k


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
