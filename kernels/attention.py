"""Paged attention over a flat batch of decodes and prefill chunks: the torch reference and the CPU serving path.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_size]``; a sequence owns
a list of blocks (its block table) and the K/V of its token at position ``p`` lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. A step's tokens form one flat batch: the decodes first
(one query token each), then the prefill chunks, each of which may continue after a cached prefix.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch

from spindle.kernels.cpu import cpu_ops


@dataclass
class AttentionMetadata:
    """One flat batch of sequences, ordered decodes first, then prefill chunks.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, cache slot (``block_id * block_size + offset``) of each new token.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths (the query is the seq's new tokens).
        seq_lens: ``[num_seqs]`` int32, context length after this step (cached + new tokens).
        block_tables: ``[num_seqs, max_blocks]`` int32, padded with 0.
        num_decodes: the first ``num_decodes`` sequences have exactly one query token.
        max_seq_len: the largest of ``seq_lens``.
        query_lens_list: host copy of the query lengths, so the CPU path needs no ``.tolist()`` per layer.
        seq_lens_list: host copy of ``seq_lens``.

    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_seq_len: int
    query_lens_list: list[int]
    seq_lens_list: list[int]

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build the metadata of one step from host lists, one entry per sequence.

        Args:
            query_lens: new tokens of each sequence this step; the decodes (length 1) must come first.
            seq_lens: context length of each sequence after this step (cached + new tokens).
            block_tables: the blocks of each sequence, enough to hold ``seq_lens`` tokens.
            block_size: tokens per cache block.
            device: where the tensors go.

        Returns:
            The metadata, with the new tokens' slots computed from the block tables.

        Raises:
            ValueError: when a decode follows a prefill chunk, or a block table is too short.

        """
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if any(n == 1 for n in query_lens[num_decodes:]) or any(n < 1 for n in query_lens):
            raise ValueError(f"query lengths {query_lens} must be >= 1, with the decodes (length 1) first")
        slots = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if len(table) * block_size < seq_len or query_len > seq_len:
                raise ValueError(f"a sequence of {seq_len} tokens ({query_len} new) does not fit blocks {table}")
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)
            )
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).view(len(block_tables), max_blocks),
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens, default=0),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
        )


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the new tokens' keys and values into their cache slots.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``.
        value: ``[num_tokens, num_kv_heads, head_size]``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place.
        v_cache: same shape as ``k_cache``, written in place.
        slot_mapping: ``[num_tokens]`` int64, the slot of each token; every slot must be valid.

    """
    num_kv_heads, head_size = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its own sequence's context, read from the paged cache (torch).

    The reference (and ``--enforce-eager``'s path on the CPU): each sequence's context gathered from the cache and
    attended with torch's CPU flash attention (:func:`_flash_chunk`), one sequence at a time, or with explicit
    scores (:func:`_masked_chunk`) under a window or a soft-cap. The new tokens' K/V must already be in the cache
    (:func:`reshape_and_cache`); a query token at absolute position ``p`` attends to positions ``0..p`` of its
    sequence (``p - sliding_window + 1..p`` with a window), so a prefill chunk may start after a cached prefix.

    Args:
        query: ``[num_tokens, num_heads, head_size]``; ``num_heads`` is a multiple of the cache's ``num_kv_heads``.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``.
        v_cache: same shape as ``k_cache``.
        meta: the batch layout.
        scale: the softmax scale, usually ``head_size ** -0.5``.
        sliding_window: how many positions, its own included, a token attends to; None for the whole context. The
            cache blocks wholly before a query's window are never read (they may have been freed).
        softcap: when given, each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` before the softmax.

    Returns:
        ``[num_tokens, num_heads, head_size]``, in the query's dtype.

    """
    rows = query.split(meta.query_lens_list)
    tables, lens = meta.block_tables, meta.seq_lens_list
    if sliding_window is None and softcap is None:
        chunks = [_flash_chunk(q, k_cache, v_cache, tables[i], lens[i], scale) for i, q in enumerate(rows)]
    else:
        chunks = [
            _masked_chunk(q, k_cache, v_cache, tables[i], lens[i], scale, sliding_window, softcap)
            for i, q in enumerate(rows)
        ]
    return torch.cat(chunks)


def paged_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` as the CPU serves it: two C++ kernels that read every context where it lies.

    One call for the decodes (``spindle.kernels.cpu``'s decode attention), one for all prefill chunks, in every dtype.
    """
    # The chunks' kernel matches or beats gathering each context for torch's flash attention where measured: bf16 on
    # AVX-512 bf16 CPUs, float32 on AVX2-only ones; float32 on AVX-512 (the generic walk) is unmeasured
    # (python -m bench.cpu_attention; docs/architecture.rst, "The forward pass on the CPU").
    # The C++ kernels take 0 for "no window" and "no soft-cap".
    window, cap = sliding_window or 0, softcap or 0.0
    num_decodes = meta.num_decodes
    if num_decodes == len(meta.query_lens_list):
        return _decode_attention(query, k_cache, v_cache, meta, scale, window, cap)
    chunks = cpu_ops().prefill_attention(
        query[num_decodes:],
        k_cache,
        v_cache,
        meta.block_tables[num_decodes:],
        meta.query_start_loc[num_decodes:],
        meta.seq_lens[num_decodes:],
        scale,
        window,
        cap,
    )
    if not num_decodes:
        return chunks
    decodes = _decode_attention(query[:num_decodes], k_cache, v_cache, meta, scale, window, cap)
    return torch.cat([decodes, chunks])


def _flash_chunk(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """One prefill chunk's attention with torch's CPU flash attention, over its context gathered from the cache.

    The chunk attends causally to itself and fully to the cached prefix before it: two flash calls (the chunk's own
    keys with a causal mask, whose top-left alignment is right for a square; the prefix's with none), merged by
    their log-sum-exps, as flash-decoding merges partitions. The KV heads are repeated for the query heads.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    blocks = block_table[: -(-seq_len // block_size)].long()

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [1, num_heads, seq_len, head_size]
        context = cache[blocks].flatten(0, 1)[:seq_len]
        context = context.unsqueeze(2).expand(seq_len, num_kv_heads, group, head_size)
        return context.reshape(seq_len, num_heads, head_size).transpose(0, 1).unsqueeze(0)

    keys, values = gathered(k_cache), gathered(v_cache)
    q = query.transpose(0, 1).unsqueeze(0)
    cached = seq_len - num_tokens
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, keys[:, :, cached:], values[:, :, cached:], 0.0, True, scale=scale)
    if cached:
        prefix_out, prefix_lse = flash(q, keys[:, :, :cached], values[:, :, :cached], 0.0, False, scale=scale)
        top = torch.maximum(lse, prefix_lse)
        weight, prefix_weight = (lse - top).exp_().unsqueeze(-1), (prefix_lse - top).exp_().unsqueeze(-1)
        out = (out * weight + prefix_out * prefix_weight) / (weight + prefix_weight)  # float32, from the weights
    return out[0].transpose(0, 1).to(query.dtype)


def _masked_chunk(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One chunk's attention with explicit float32 scores: soft-capped, masked to each query's window.

    Only the positions from the first query's window on are gathered, so blocks wholly before it are never read.
    """
    num_tokens, num_heads, _ = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first = seq_len - num_tokens
    lowest = 0 if sliding_window is None else max(0, first - sliding_window + 1)
    positions = torch.arange(lowest, seq_len)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    group = num_heads // num_kv_heads
    keys = k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
    values = v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", query.float(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_positions = torch.arange(first, seq_len)[:, None]
    visible = positions[None, :] <= query_positions
    if sliding_window is not None:
        visible &= positions[None, :] > query_positions - sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", probs, values).to(query.dtype)


def _decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    # Each context is read in place from the paged cache, no padding to the longest: measured on 2 cores against the
    # earlier gather + padded SDPA (bf16, SmolLM2's 9/3 heads, ms per layer): 64 contexts of 40-104 tokens 0.58 vs
    # 1.5-2.6; one 2,000-token context beside 63 of 60 tokens 0.60 vs 60; 256 contexts of 40-300 tokens 3.3 vs 45.
    # The kernel reads the first len(query) rows of the tables and lengths: no slices of them (3 us a layer).
    return cpu_ops().decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window, softcap)
