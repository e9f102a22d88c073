"""Paged varlen causal attention in Triton: prefill chunks, after a cached prefix or not, and decodes alike.

Grid ``(num_seqs, num_kv_heads, query tiles)``. A program takes one KV head and a tile of a sequence's new tokens
together with every query head of that KV head's group: its ``BLOCK_M`` rows are ``BLOCK_M // group`` tokens x
``group`` heads, so each K/V tile is loaded once per group (GQA) and the rows fill a ``tl.dot``. A new token at
absolute position ``p`` attends to positions ``0..p`` of its sequence, all read from the paged cache: the cached
prefix and the chunk's own K/V, which :func:`~spindle.kernels.reshape_and_cache` wrote first. Any mix of query lengths
(1 included) goes in one launch.
"""

import math

import torch
import triton
import triton.language as tl

from spindle.kernels.triton.attention_tile import attend_tile, check_layout, dot_in_fp32, kv_offsets

BLOCK_M = 64
"""Query rows (tokens x heads of a group) per program."""

BLOCK_N = 64
"""Keys per tile; half that in float32, so that the Q, K, P and V tiles fit the ~100 KiB of shared memory of
consumer GPUs at head size 128."""


# The first prefill's index follows the step's number of decodes and the block tables' row stride its longest table:
# neither is specialised on, or each new value (1, a multiple of 16, other) would compile mid-request.
@triton.jit(do_not_specialize=["first_seq", "stride_bt"])
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
        q_offsets = (query_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        # Rows past the query (masked on store) get positions past the tile's keys and so see at least key 0 too.
        q_positions = cached_len + token

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        block_table_ptr = block_tables_ptr + seq * stride_bt
        kv_end = tl.minimum(seq_len, cached_len + (q_tile + 1) * BLOCK_Q)
        for tile_start in range(0, kv_end, BLOCK_N):
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
                HEAD_SIZE,
                BLOCK_D,
                DOT_FP32,
            )

        out = acc / row_sum[:, None]
        o_offsets = (query_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
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

    """
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0] - first_seq
    if num_seqs <= 0 or max_query_len == 0:
        return
    check_layout(query, k_cache, v_cache, out)
    group = num_heads // num_kv_heads
    block_m = max(BLOCK_M, triton.next_power_of_2(group))
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
        BLOCK_N=BLOCK_N // 2 if query.element_size() == 4 else BLOCK_N,
        DOT_FP32=dot_in_fp32(query.dtype),
    )
