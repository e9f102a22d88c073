"""Paged varlen causal attention in Triton: prefill chunks, after a cached prefix or not, and decodes alike.

Grid ``(num_seqs, num_kv_heads, query tiles)``. A program takes one KV head and a tile of a sequence's new tokens
together with every query head of that KV head's group: its ``BLOCK_M`` rows are ``BLOCK_M // group`` tokens x
``group`` heads, so each K/V tile is loaded once per group (GQA) and the rows fill a ``tl.dot``. A new token at
absolute position ``p`` attends to positions ``0..p`` of its sequence (``p - window + 1..p`` under a sliding
window), all read from the paged cache: the cached prefix and the chunk's own K/V, which
:func:`~spindle.kernels.reshape_and_cache` wrote first. Any mix of query lengths (1 included) goes in one launch.

The key tiles below a query tile's first position are seen whole by every row and go through an unmasked loop; only
the last few, which the causal diagonal or the context's end cross, are masked (under a sliding window every tile is
masked, and the keys before the window are not loaded). Tile sizes, warps and pipeline
stages come from :func:`prefill_tiles`, by head size and dtype.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spindle.kernels.triton.attention_tile import attend_tile, check_layout, dot_in_fp32, kv_offsets


@dataclass(frozen=True)
class PrefillTiles:
    """Tile sizes and launch shape of the prefill kernel for one head size and dtype."""

    block_m: int
    """Query rows (tokens x heads of a group) per program; a group larger than this takes a tile of its own."""
    block_n: int
    """Keys per K/V tile."""
    num_warps: int
    """Warps per program."""
    num_stages: int
    """Software-pipeline depth of the K/V loop: loads of later tiles in flight while one is folded."""


def prefill_tiles(head_size: int, dtype: torch.dtype) -> PrefillTiles:
    """The prefill kernel's tiles for ``head_size`` in ``dtype``: a fixed choice, so one compile per model.

    Chosen from the compiled kernels (``compile_check`` prints their shared memory, registers and spills) for sm_80 and
    sm_90, not autotuned: autotuning would compile and time every candidate when a shape first shows up, mid-request.
    """
    block_d = max(16, triton.next_power_of_2(head_size))
    if dtype == torch.float32:
        # Exact float32 dots run on the FMA units with both operands in registers: small tiles, or they spill.
        if block_d <= 64:
            return PrefillTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)
        return PrefillTiles(block_m=32, block_n=16, num_warps=8, num_stages=2)
    # 16-bit: 128 rows x 64 keys fill the tensor cores, and 8 warps hold the scores and the float32 accumulator
    # without spilling (4 warps spill at head 128, and at head 64 on sm_80; a group of 3 spills 64 B on sm_80 at head
    # 128). At head 128 (80 and 96 pad to it) shared memory (Q, and K and V per stage in flight) is 64.5 KiB on
    # sm_80, the layout consumer GPUs (~100 KiB per block) compile to too, and 96.5 KiB on sm_90, whose pipeline keeps
    # two K/V tiles in flight (H100/H200: 227 KiB).
    if block_d <= 128:
        return PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return PrefillTiles(block_m=64, block_n=32, num_warps=8, num_stages=2)


# The first prefill's index follows the step's number of decodes and the block tables' row stride its longest table:
# neither is specialised on, or each new value (1, a multiple of 16, other) would compile mid-request.
@triton.jit(do_not_specialize=["first_seq", "stride_bt", "window"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    first_seq,
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
    HEAD_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    # The grid covers the longest query of the batch; shorter ones leave their last tiles idle.
    if q_tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        cached_len = seq_len - query_len
        r = tl.arange(0, BLOCK_M)
        token = q_tile * BLOCK_Q + r // GROUP
        heads = kv_head * GROUP + r % GROUP
        row_mask = (r < BLOCK_Q * GROUP) & (token < query_len)
        d = tl.arange(0, BLOCK_D)
        q_mask = row_mask[:, None] & (d < HEAD_SIZE)[None, :]
        # int64 before the stride: a long step's flat batch can hold more than 2**31 query elements.
        q_rows = (query_start + token).to(tl.int64)
        q_offsets = q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        # Rows past the query (masked on store) get positions past the tile's keys and so see at least key 0 too.
        first_position = cached_len + q_tile * BLOCK_Q
        q_positions = first_position + r // GROUP

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        block_table_ptr = block_tables_ptr + seq * stride_bt
        kv_end = tl.minimum(seq_len, cached_len + (q_tile + 1) * BLOCK_Q)
        if SLIDING:
            # Every tile is masked: to the window of each row, and below the first row's window the keys are not
            # even loaded (their blocks may have been freed).
            lowest = tl.maximum(first_position - window + 1, 0)
            for tile_start in range(lowest // BLOCK_N * BLOCK_N, kv_end, BLOCK_N):
                positions = tile_start + tl.arange(0, BLOCK_N)
                kv_mask = (positions >= lowest) & (positions < kv_end)
                offsets = kv_offsets(
                    block_table_ptr, positions, kv_mask, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
                )
                distance = q_positions[:, None] - positions[None, :]
                visible = kv_mask[None, :] & (distance >= 0) & (distance < window)
                m, row_sum, acc = attend_tile(
                    q,
                    k_cache_ptr,
                    v_cache_ptr,
                    offsets,
                    kv_mask,
                    visible,
                    m,
                    row_sum,
                    acc,
                    scale_log2e,
                    softcap,
                    HEAD_SIZE,
                    BLOCK_D,
                    DOT_FP32,
                    SOFTCAP,
                    True,
                )
        else:
            # Whole tiles up to the tile's first query position are in the context and seen by every row: the
            # common case (a long context or chunk) runs unmasked; only the tiles the causal diagonal crosses carry
            # masks.
            interior_end = (first_position + 1) // BLOCK_N * BLOCK_N
            for tile_start in range(0, interior_end, BLOCK_N):
                positions = tile_start + tl.arange(0, BLOCK_N)
                offsets = kv_offsets(
                    block_table_ptr, positions, None, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
                )
                m, row_sum, acc = attend_tile(
                    q,
                    k_cache_ptr,
                    v_cache_ptr,
                    offsets,
                    None,
                    None,
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
            for tile_start in range(interior_end, kv_end, BLOCK_N):
                positions = tile_start + tl.arange(0, BLOCK_N)
                kv_mask = positions < kv_end
                offsets = kv_offsets(
                    block_table_ptr, positions, kv_mask, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE
                )
                causal = kv_mask[None, :] & (positions[None, :] <= q_positions[:, None])
                m, row_sum, acc = attend_tile(
                    q,
                    k_cache_ptr,
                    v_cache_ptr,
                    offsets,
                    kv_mask,
                    causal,
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

        out = acc / row_sum[:, None]
        o_offsets = q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    first_seq: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of the new tokens of sequences ``first_seq..`` over their paged contexts, into ``out``.

    Args:
        query: ``[num_tokens, num_heads, head_size]``, the whole step's flat batch, last dimension contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous, the new tokens already in it.
        v_cache: same shape as ``k_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32, context length of each sequence after this step.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths over the flat batch.
        max_query_len: the longest query among the sequences attended (sizes the grid).
        scale: the softmax scale.
        out: like ``query``; only the rows of the attended sequences are written.
        first_seq: sequences before this one are left alone (the decodes, when a decode kernel takes them).
        sliding_window: how many positions, its own included, a token attends to; None for the whole context.
        softcap: the scores' soft-cap (``softcap * tanh(s / softcap)``), or None.

    """
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0 or max_query_len == 0:
        return
    check_layout(query, k_cache, v_cache, out)
    group = num_heads // num_kv_heads
    tiles = prefill_tiles(head_size, query.dtype)
    block_m = max(tiles.block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        first_seq,
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
        HEAD_SIZE=head_size,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=max(16, triton.next_power_of_2(head_size)),
        BLOCK_N=tiles.block_n,
        DOT_FP32=dot_in_fp32(query.dtype),
        SOFTCAP=softcap is not None,
        SLIDING=sliding_window is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
