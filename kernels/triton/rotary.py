"""Rotary position embedding (neox layout) in Triton: query and key heads of one token per program."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    stride_xt,
    stride_xh,
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
    src = x_ptr + token * stride_xt + h * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (token * NUM_HEADS + h) * (2 * HALF) + d
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    cos_sin_ptr,
    query_out_ptr,
    key_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos_sin,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
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
    _rotate_heads(query_ptr, query_out_ptr, token, stride_qt, stride_qh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK)
    _rotate_heads(key_ptr, key_out_ptr, token, stride_kt, stride_kh, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK)


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
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension in query, key and cos_sin_cache")
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions,
            query,
            key,
            cos_sin_cache,
            query_out,
            key_out,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos_sin_cache.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HALF=head_size // 2,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
            BLOCK=triton.next_power_of_2(head_size // 2),
        )
    return query_out, key_out
