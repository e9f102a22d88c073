"""Fused mixture-of-experts on Triton: a grouped GEMM over the rows routed to each expert (``spindle.kernels.moe``).

The assignments (token, k) are sorted by expert and each expert's run padded to a multiple of ``BLOCK_M`` (vLLM's
``moe_align_block_size``, here in torch ops without a host sync: the block count is bounded by
``ceil(assignments / BLOCK_M) + experts`` and the blocks past the last expert's exit at once). Every program of the
grouped GEMM owns ``BLOCK_M`` rows of one expert and ``BLOCK_N`` output columns: the gate/up GEMM gathers its rows
from the tokens, SiLU-and-mul runs on the result, and the down GEMM scales each row by its routing weight and writes
it to its assignment's row; each token's ``top_k`` rows are then summed in float32.
"""

import torch
import triton
import triton.language as tl

from spindle.kernels.triton.activation import silu_and_mul
from spindle.kernels.triton.attention_tile import dot_in_fp32

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_rows_ptr,
    block_experts_ptr,
    weights_ptr,
    num_experts,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    ROWS_PER_A: tl.constexpr,
    WEIGHTED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    rows = tl.load(sorted_rows_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    a_rows = a_ptr + (rows // ROWS_PER_A).to(tl.int64)[:, None] * stride_am
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + n.to(tl.int64)[None, :] * stride_bn
    k_range = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + k_range
        a = tl.load(a_rows + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")
    if WEIGHTED:
        acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


def _align(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The assignments sorted by expert in runs padded to ``BLOCK_M`` (``-1`` pads), and each block's expert.

    Blocks past the last run get expert ``num_experts``: the kernel skips them.
    """
    flat = topk_ids.flatten()
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_ends = torch.cumsum(blocks, 0)
    padded_starts = (block_ends - blocks) * BLOCK_M
    starts = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    experts = flat[order]
    position = padded_starts[experts] + torch.arange(flat.numel(), device=flat.device) - starts[experts]
    max_blocks = triton.cdiv(flat.numel(), BLOCK_M) + num_experts
    sorted_rows = torch.full((max_blocks * BLOCK_M,), -1, dtype=torch.int64, device=flat.device)
    sorted_rows[position] = order
    block_experts = torch.searchsorted(block_ends, torch.arange(max_blocks, device=flat.device), right=True)
    return sorted_rows, block_experts


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_experts: torch.Tensor,
    rows_per_a: int,
    weights: torch.Tensor | None,
) -> None:
    """``out[r] = a[r // rows_per_a] @ b[expert of r].T`` (times ``weights[r]`` if given) for each sorted row ``r``."""
    num_experts, n, k = b.shape
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        sorted_rows,
        block_experts,
        out if weights is None else weights,
        num_experts,
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        WEIGHTED=weights is not None,
        DOT_FP32=dot_in_fp32(a.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token (Triton; see ``spindle.kernels.moe``).

    Args:
        x: ``[tokens, hidden]``, dense rows.
        w13: ``[num_experts, 2 * intermediate, hidden]``, each matrix with dense rows.
        w2: ``[num_experts, hidden, intermediate]``, each matrix with dense rows.
        topk_weights: ``[tokens, top_k]``.
        topk_ids: int64 ``[tokens, top_k]``.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.

    """
    tokens, top_k = topk_ids.shape
    sorted_rows, block_experts = _align(topk_ids, w13.shape[0])
    gate_up = torch.empty(tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_rows, block_experts, top_k, None)
    act = silu_and_mul(gate_up)
    down = torch.empty(tokens * top_k, w2.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.float().flatten().contiguous()
    _grouped_gemm(act, w2, down, sorted_rows, block_experts, 1, weights)
    return down.view(tokens, top_k, -1).sum(1).to(x.dtype)
