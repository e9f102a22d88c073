"""Paged attention over a step's flat batch in Triton: the decode kernel, then one varlen launch for the prefills."""

import torch

from spindle.kernels.attention import AttentionMetadata
from spindle.kernels.triton.decode_attention import decode_attention, num_splits_for
from spindle.kernels.triton.prefill_attention import prefill_attention


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its own sequence's context (Triton; same contract as the torch one).

    Reads only ``meta``'s tensors and its host ``num_decodes``, ``max_seq_len`` and query lengths, never
    ``seq_lens_list``; a decode-only batch reads no host list at all, so it can be captured in a CUDA graph with
    ``max_seq_len`` set to the longest context the graph will see.

    Args:
        query: ``[num_tokens, num_heads, head_size]``; ``num_heads`` is a multiple of the cache's ``num_kv_heads``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, the new tokens already written.
        v_cache: same shape as ``k_cache``.
        meta: the batch layout.
        scale: the softmax scale.
        sliding_window: how many positions, its own included, a token attends to; None for the whole context.
        softcap: the scores' soft-cap (``softcap * tanh(s / softcap)``), or None.

    Returns:
        ``[num_tokens, num_heads, head_size]``, in the query's dtype.

    """
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_decodes = meta.num_decodes
    if num_decodes:
        num_splits = num_splits_for(num_decodes, k_cache.shape[2], meta.max_seq_len, query.device)
        decode_attention(
            query[:num_decodes],
            k_cache,
            v_cache,
            meta.block_tables[:num_decodes],
            meta.seq_lens[:num_decodes],
            scale,
            out[:num_decodes],
            num_splits,
            sliding_window,
            softcap,
        )
    if num_decodes < meta.seq_lens.shape[0]:
        prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            max(meta.query_lens_list[num_decodes:]),
            scale,
            out,
            first_seq=num_decodes,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    return out
