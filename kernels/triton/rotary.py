"""Rotary position embedding (neox layout) in Triton: query and key heads of one token per program.

:func:`rotary_embedding_and_cache` also writes the rotated keys and the values into the paged KV cache, in the same
launch: the model's layers never need the rotated keys anywhere else, and one launch fewer per layer counts in the
steps that run eagerly (prefills and mixed prefill+decode steps are not captured in CUDA graphs).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src,
    dst,
    stride_src_h,
    stride_dst_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    x1 = tl.load(src + h * stride_src_h + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + h * stride_src_h + d + HALF, mask=mask, other=0.0).to(tl.float32)
    out = dst + h * stride_dst_h + d
    tl.store(out, (x1 * cos - x2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    cos_sin_ptr,
    query_out_ptr,
    key_out_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 before the strides: a step's query heads can hold more than 2**31 elements.
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    d = tl.arange(0, BLOCK)[None, :]
    row = cos_sin_ptr + position * stride_cos_sin + d
    cos = tl.load(row, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    query_out = query_out_ptr + token * NUM_HEADS * 2 * HALF
    _rotate_heads(
        query_ptr + token * stride_qt, query_out, stride_qh, 2 * HALF, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK
    )
    key = key_ptr + token * stride_kt
    # With WRITE_CACHE, key_out_ptr is the K cache and the keys go to their slots; without, to their token's rows.
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token)
        # A negative slot is a padding token (the CUDA-graph decode batch pads to a captured size): its query is
        # rotated (and ignored), its K/V written nowhere.
        if slot >= 0:
            # `slot` is int64, so the offset is too: a large cache holds more than 2**31 elements.
            cached = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            _rotate_heads(
                key, key_out_ptr + cached, stride_kh, stride_ch, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK
            )
            h = tl.arange(0, BLOCK_KV_H)[:, None]
            d_all = tl.arange(0, 2 * BLOCK)[None, :]
            mask = (h < NUM_KV_HEADS) & (d_all < 2 * HALF)
            value = tl.load(value_ptr + token * stride_vt + h * stride_vh + d_all, mask=mask)
            tl.store(v_cache_ptr + cached + h * stride_ch + d_all, value, mask=mask)
    else:
        key_out = key_out_ptr + token * NUM_KV_HEADS * 2 * HALF
        _rotate_heads(key, key_out, stride_kh, 2 * HALF, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the query and key heads by their tokens' positions (Triton; same contract as the torch one).

    Computed in float32 and rounded once, so in bf16 it is within a rounding step of the torch path, which rounds
    after every product. Rope scaling lives in ``cos_sin_cache`` (:func:`spindle.kernels.build_cos_sin_cache`).

    Args:
        positions: ``[num_tokens]`` int64, the absolute position of each token.
        query: ``[num_tokens, num_heads, head_size]``, the last dimension contiguous (a view of a fused qkv is fine).
        key: ``[num_tokens, num_kv_heads, head_size]``, the last dimension contiguous.
        cos_sin_cache: ``[max_position, head_size]``, cosines then sines, contiguous rows.

    Returns:
        The rotated ``(query, key)``, new contiguous tensors of the same shapes.

    """
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    query_out = _launch(positions, query, key, None, cos_sin_cache, key_out, None, None)
    return query_out, key_out


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
    """Rotate the query and key heads, and write the rotated keys and the values into their cache slots, in one launch.

    The same contract as the torch one (:func:`spindle.kernels.rotary.rotary_embedding_and_cache`), except that a
    negative slot is skipped, as :func:`~spindle.kernels.triton.reshape_and_cache` skips it.

    Args:
        positions: ``[num_tokens]`` int64, the absolute position of each token.
        query: ``[num_tokens, num_heads, head_size]``, the last dimension contiguous.
        key: ``[num_tokens, num_kv_heads, head_size]``, the last dimension contiguous.
        value: same shape as ``key``, the last dimension contiguous.
        cos_sin_cache: ``[max_position, head_size]``, cosines then sines, contiguous rows.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous, written in place.
        v_cache: same shape as ``k_cache``, contiguous, written in place.
        slot_mapping: ``[num_tokens]`` int64, the slot of each token, or ``-1`` to skip it.

    Returns:
        The rotated query, a new contiguous tensor of its shape.

    """
    if value.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("rotary_embedding_and_cache needs values with a contiguous last dimension, contiguous caches")
    return _launch(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping)


def _launch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    key_out: torch.Tensor,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> torch.Tensor:
    """Run the kernel: the keys go to ``key_out`` by token, or with ``v_cache`` given, by slot into the caches."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension in query, key and cos_sin_cache")
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if not num_tokens:
        return query_out
    # Without a cache the value and cache arguments are never read: any tensor stands in for them.
    value_rows = key if value is None else value
    cache = key_out if v_cache is None else v_cache
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        value_rows,
        cos_sin_cache,
        query_out,
        key_out,
        cache,
        positions if slot_mapping is None else slot_mapping,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value_rows.stride(0),
        value_rows.stride(1),
        cos_sin_cache.stride(0),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_size // 2,
        WRITE_CACHE=v_cache is not None,
        BLOCK_SIZE=cache.shape[1] if v_cache is not None else 1,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK=triton.next_power_of_2(head_size // 2),
    )
    return query_out
