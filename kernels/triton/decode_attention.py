"""Paged decode attention in Triton, flash-decoding style: one query token per sequence, the context split in parts.

Grid ``(num_seqs, num_kv_heads, num_splits)``: a program takes one KV head and all the query heads that share it
(GQA: each K/V tile is loaded once for the whole group, which fills the rows of one ``tl.dot``), and one slice of
the context. Each slice writes its partial output and log-sum-exp; a second kernel merges the slices. With one
split the first kernel writes the output directly.

The number of splits depends only on shapes and the host's ``max_seq_len`` bound, never on the data in the
tensors (each sequence divides its own length into that many slices), so the launch can be captured in a CUDA
graph and replayed for other sequence lengths.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from spindle.kernels.triton.attention_tile import attend_tile, check_layout, dot_in_fp32, kv_offsets

BLOCK_N = 64
"""Keys per tile."""

SPLIT_COUNTS = (1, 2, 4, 8, 16)
"""Every number of slices a context is split into. ``NUM_SPLITS`` is a compile-time constant of both kernels, so each
count is a compile (seconds on a GPU): counts are powers of two, all compiled at start-up by :func:`warm_up`, and no
step meets a new one while serving."""

MAX_SPLITS = SPLIT_COUNTS[-1]
"""The most slices one sequence's context is split into."""

MIN_TOKENS_PER_SPLIT = 256
"""A slice gets at least this many tokens (four tiles), so that the merge stays small next to the work it splits."""


# The block tables' row stride follows the step's longest table: not specialised on, or each new width would compile.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2e,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # int64 before the strides, as in every kernel here: row x stride must not wrap at 2**31 elements.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Under a sliding window the slices cover the window only: the keys before it are never loaded.
    if SLIDING:
        lowest = tl.maximum(seq_len - window, 0)
    else:
        lowest = 0
    # Slices are whole tiles; a short context leaves the last slices empty.
    split_len = tl.cdiv(tl.cdiv(seq_len - lowest, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lowest + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_SIZE)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        kv_mask = positions < end
        offsets = kv_offsets(block_table_ptr, positions, kv_mask, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        m, row_sum, acc = attend_tile(
            q,
            k_cache_ptr,
            v_cache_ptr,
            offsets,
            kv_mask,
            kv_mask[None, :],
            m,
            row_sum,
            acc,
            scale_log2e,
            softcap,
            HEAD_SIZE,
            BLOCK_D,
            DOT_FP32,
            SOFTCAP,
        )

    # An empty slice (row_sum == 0, acc == 0, m == -inf) writes zeros and a log-sum-exp of -inf: the merge ignores it.
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    out = acc / row_sum[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(partial_out_ptr + row[:, None] * HEAD_SIZE + d[None, :], out, mask=q_mask)
        tl.store(partial_lse_ptr + row, m + tl.log2(row_sum), mask=g < GROUP)


@triton.jit
def _merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    lse = tl.load(partial_lse_ptr + row, mask=s < NUM_SPLITS, other=float("-inf"))
    # The first slice is never empty, so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    mask = (s < NUM_SPLITS)[:, None] & (d < HEAD_SIZE)[None, :]
    parts = tl.load(partial_out_ptr + row[:, None] * HEAD_SIZE + d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many slices to split each context into: enough programs for two waves over the GPU's SMs.

    Capped by :data:`MAX_SPLITS` and by ``max_seq_len / MIN_TOKENS_PER_SPLIT``, then rounded down to one of
    :data:`SPLIT_COUNTS`. On the CPU (the interpreter) there is nothing to fill, so short batches stay at one split.
    """
    processors = _multiprocessors(device) if device.type == "cuda" else 1
    for_occupancy = math.ceil(2 * processors / max(1, num_seqs * num_kv_heads))
    wanted = max(1, min(MAX_SPLITS, for_occupancy, math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT)))
    return max(count for count in SPLIT_COUNTS if count <= wanted)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Attention of one query token per sequence over its paged context (its window's end), written into ``out``.

    Args:
        query: ``[num_seqs, num_heads, head_size]``, the last dimension contiguous; ``num_heads`` is a multiple of
            the cache's ``num_kv_heads``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous.
        v_cache: same shape as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32, each >= 1, the query token's K/V already in the cache.
        scale: the softmax scale.
        out: ``[num_seqs, num_heads, head_size]``, the last dimension contiguous.
        num_splits: slices per context, e.g. from :func:`num_splits_for`.
        sliding_window: how many of the last positions, the query's own included, it attends to; None for all.
        softcap: the scores' soft-cap (``softcap * tanh(s / softcap)``), or None.

    """
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    if num_seqs == 0:
        return
    check_layout(query, k_cache, v_cache, out)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_size))
    if num_splits > 1:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_size, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused: the kernel writes `out` directly
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * math.log2(math.e),
        softcap or 1.0,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        GROUP=group,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        # Padded to 16 rows, the smallest tensor-core tile.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        DOT_FP32=dot_in_fp32(query.dtype),
        SOFTCAP=softcap is not None,
        SLIDING=sliding_window is not None,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )


def warm_up(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_splits: int,
    sliding_window: int | None = None,
) -> None:
    """Compile both kernels for ``num_splits`` slices now, at start-up, rather than in a request's step.

    Runs one decode of one sequence over the first cache block (the kernels' other compile-time constants are the
    model's: head size, GQA group, block size, dtype, and whether a layer's window applies). Call it for every count
    of :data:`SPLIT_COUNTS` and every kind of layer.

    Args:
        query: ``[1, num_heads, head_size]`` in the model's dtype (its values do not matter).
        k_cache: a layer's ``[num_blocks, block_size, num_kv_heads, head_size]`` cache.
        v_cache: same shape as ``k_cache``.
        num_splits: the count to compile for.
        sliding_window: a windowed layer's window, or None.

    """
    device = query.device
    block_tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    out = torch.empty_like(query)
    decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 1.0, out, num_splits, sliding_window)
