"""Cache write (``reshape_and_cache``) in Triton: scatter each new token's K/V into its paged cache slot."""

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # int64 before the strides, as `slot` is: a step's fused qkv rows can hold more than 2**31 elements.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    # A negative slot is a padding token (the CUDA-graph decode batch pads to a captured size): nothing to write.
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
        # `slot` is int64, so the offset is too: a large cache holds more than 2**31 elements.
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        key = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
        value = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + dst, key, mask=mask)
        tl.store(v_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the new tokens' keys and values into their cache slots (Triton; same contract as the torch one).

    Unlike the torch reference, a negative slot is skipped, so padded batches need no special casing.

    Args:
        key: ``[num_tokens, num_kv_heads, head_size]``, the last dimension contiguous.
        value: same shape as ``key``, the last dimension contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous, written in place.
        v_cache: same shape and strides as ``k_cache``, written in place.
        slot_mapping: ``[num_tokens]`` int64, the slot of each token, or ``-1`` to skip it.

    """
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = k_cache.shape[1]
    if key.stride(-1) != 1 or value.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("reshape_and_cache needs K/V with a contiguous last dimension and contiguous caches")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
    )
