"""Batched LoRA in Triton: a shrink and an expand kernel over a step's tokens grouped by adapter slot (as SGMV).

Same contract as :func:`spindle.kernels.lora.add_lora`. The mapping lists the adapted tokens grouped by slot
(``token_indices``, ``group_starts``, ``slot_ids``); the grid's last axis is the group, so one launch serves every
adapter of the step, and a program gathers up to ``BLOCK_M`` token rows of its group, which all read the same slot's
weights: ``tl.dot`` tiles as in a dense GEMM, however the batch mixes adapters. Programs past their group's end
return at once (the grid is sized for the largest group). Base-model tokens are in no group: their rows of ``y``
are never read or written.

- Shrink: ``t[tok, :] = x[tok, :] @ lora_a[slot].T``, grid ``(M tiles, K tiles, groups)``, looping over the input
  features. ``t`` is rounded to ``x``'s dtype, as PEFT's ``lora_A`` output is (and the torch reference's; the C++
  CPU kernel keeps it in float32).
- Expand: ``y[tok, n] += t[tok, :] @ lora_b[slot, :, n]``, grid ``(M tiles, N tiles, groups)``, looping over the
  (small) rank; each ``(token, column)`` belongs to one program, so the read-modify-write of ``y`` needs no atomics.

The integers that change from step to step (how many tokens, groups) only size the grid; the kernels' integer
arguments are per-layer constants (feature counts, strides), so a new batch compiles nothing.
"""

import torch
import triton
import triton.language as tl

from spindle.kernels.lora import LoraMapping, LoraSlots
from spindle.kernels.triton.attention_tile import dot_in_fp32


@triton.jit
def _group_rows(starts_ptr, tokens_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """The program's block of its group's tokens: ``(first, end, tokens, in_group, slot)``; none when ``first >= end``.

    Group ``program_id(2)`` holds the tokens ``starts[g]`` to ``starts[g + 1]`` of the token list, all of one adapter
    ``slot``; block ``program_id(0)`` is the ``BLOCK_M`` of them from ``first``, masked by ``in_group``.
    """
    group = tl.program_id(2)
    end = tl.load(starts_ptr + group + 1)
    first = tl.load(starts_ptr + group) + tl.program_id(0) * BLOCK_M
    idx = first + tl.arange(0, BLOCK_M)
    in_group = idx < end
    # int64 before the strides: a step's activations can hold more than 2**31 elements.
    tokens = tl.load(tokens_ptr + idx, mask=in_group, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + group).to(tl.int64)
    return first, end, tokens, in_group, slot


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    t_ptr,
    tokens_ptr,
    starts_ptr,
    slots_ptr,
    K_IN,
    RANK,
    stride_xm,
    stride_as,
    stride_ar,
    stride_tm,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    first, end, tokens, in_group, slot = _group_rows(starts_ptr, tokens_ptr, slots_ptr, BLOCK_M)
    if first >= end:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_range = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xm
    a_rows = a_ptr + slot * stride_as + r[:, None].to(tl.int64) * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K_IN, BLOCK_K):
        k = k0 + k_range
        x = tl.load(x_rows + k[None, :], mask=in_group[:, None] & (k < K_IN)[None, :], other=0.0)
        a = tl.load(a_rows + k[None, :], mask=(r < RANK)[:, None] & (k < K_IN)[None, :], other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")
    out = t_ptr + tokens[:, None] * stride_tm + r[None, :]
    tl.store(out, acc.to(t_ptr.dtype.element_ty), mask=in_group[:, None] & (r < RANK)[None, :])


@triton.jit
def _lora_expand_kernel(
    t_ptr,
    b_ptr,
    y_ptr,
    tokens_ptr,
    starts_ptr,
    slots_ptr,
    N,
    RANK,
    stride_tm,
    stride_bs,
    stride_br,
    stride_ym,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    first, end, tokens, in_group, slot = _group_rows(starts_ptr, tokens_ptr, slots_ptr, BLOCK_M)
    if first >= end:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_range = tl.arange(0, BLOCK_R)
    t_rows = t_ptr + tokens[:, None] * stride_tm
    b_cols = b_ptr + slot * stride_bs + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        r = r0 + r_range
        t = tl.load(t_rows + r[None, :], mask=in_group[:, None] & (r < RANK)[None, :], other=0.0)
        b = tl.load(
            b_cols + r[:, None].to(tl.int64) * stride_br, mask=(r < RANK)[:, None] & (cols < N)[None, :], other=0.0
        )
        if DOT_FP32:
            t = t.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(t, b, input_precision="ieee")
    out = y_ptr + tokens[:, None] * stride_ym + cols[None, :]
    mask = in_group[:, None] & (cols < N)[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, mapping: LoraMapping) -> None:
    """``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]`` for every token ``t`` of slot ``s >= 0``, in place (Triton).

    The whole padded rank is computed (a GPU has the FLOPs to spare; the zeros cost no launch).

    Args:
        y: ``[num_tokens, out]``, the base projection's output, last dimension contiguous; written in place.
        x: ``[num_tokens, in]``, last dimension contiguous.
        slots: the projection's adapter slots, ``lora_a`` and ``lora_b`` with a contiguous last dimension.
        mapping: the step's slots per token (its tensors on ``x``'s device).

    """
    lora_a, lora_b = slots.lora_a, slots.lora_b
    num_tokens, in_features = x.shape
    rank, out_features = lora_a.shape[1], lora_b.shape[2]
    if not mapping.slots or rank == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = torch.empty(num_tokens, rank, dtype=x.dtype, device=x.device)
    # 16 rows is the smallest tensor-core tile, and holds a decode step's group unless one adapter has many
    # sequences; two sizes only, so that two variants per projection shape cover every step (compiled at start-up).
    block_m = 16 if mapping.max_group <= 16 else 64
    # float32 tiles are twice the bytes: 64-row ones with 64-wide rank and column tiles spill registers on sm_80.
    wide = 32 if x.dtype == torch.float32 else 64
    block_r = min(wide, max(16, triton.next_power_of_2(rank)))
    dot_fp32 = dot_in_fp32(x.dtype)
    groups, m_tiles = len(mapping.slots), triton.cdiv(mapping.max_group, block_m)
    _lora_shrink_kernel[(m_tiles, triton.cdiv(rank, block_r), groups)](
        x,
        lora_a,
        t,
        mapping.token_indices,
        mapping.group_starts,
        mapping.slot_ids,
        in_features,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        t.stride(0),
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=32 if x.dtype == torch.float32 else 64,
    )
    block_n = 32 if block_m == 16 else wide
    _lora_expand_kernel[(m_tiles, triton.cdiv(out_features, block_n), groups)](
        t,
        lora_b,
        y,
        mapping.token_indices,
        mapping.group_starts,
        mapping.slot_ids,
        out_features,
        rank,
        t.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        DOT_FP32=dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
    )
