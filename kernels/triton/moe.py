"""Fused mixture-of-experts on Triton: a grouped GEMM over the rows routed to each expert (``spindle.kernels.moe``).

The assignments (token, k) are sorted by expert and each expert's run padded to a multiple of ``BLOCK_M`` (vLLM's
``moe_align_block_size``, here in torch ops without a host sync: the block count is bounded by
``ceil(assignments / BLOCK_M) + experts`` and the blocks past the last expert's exit at once). Every program of the
grouped GEMM owns ``BLOCK_M`` rows of one expert and ``BLOCK_N`` output columns: the gate/up GEMM gathers its rows
from the tokens, SiLU-and-mul runs on the result, and the down GEMM scales each row by its routing weight and writes
it to its assignment's row; each token's ``top_k`` rows are then summed in float32.

Quantized experts (``spindle.kernels.moe.quantize_experts``: int8 per row, int4 per group of inputs) are read as
they are stored and dequantized in registers as :mod:`spindle.kernels.triton.quant_linear` does: each weight in
float32 from its integer, its group's scale (and offset), then rounded once to the activation dtype for the dot.
"""

import torch
import triton
import triton.language as tl

from spindle.kernels.quant import QuantizedWeight
from spindle.kernels.triton.activation import silu_and_mul
from spindle.kernels.triton.attention_tile import dot_in_fp32

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    scales_ptr,
    zeros_ptr,
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
    stride_se,
    stride_sn,
    stride_cm,
    ROWS_PER_A: tl.constexpr,
    WEIGHTED: tl.constexpr,
    QUANTIZED: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
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
    n_valid = n < N
    # The expert's weight rows n: dense values, or quantized ones (int4: two inputs a byte) and their scales.
    b_rows = b_ptr + expert.to(tl.int64) * stride_be + n.to(tl.int64) * stride_bn
    s_rows = scales_ptr + expert.to(tl.int64) * stride_se + n.to(tl.int64) * stride_sn
    z_rows = zeros_ptr + expert.to(tl.int64) * stride_se + n.to(tl.int64) * stride_sn
    k_range = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + k_range
        a = tl.load(a_rows + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
        if QUANTIZED:
            # Inputs past K read q = 0 with the last group's scale: a finite weight, against a = 0.
            if PACKED:
                kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                q = tl.load(b_rows[:, None] + kb[None, :], mask=n_valid[:, None] & (kb < K // 2)[None, :], other=0)
                q = tl.interleave(q & 0xF, q >> 4)
            else:
                q = tl.load(b_rows[:, None] + k[None, :], mask=n_valid[:, None] & (k < K)[None, :], other=0)
            g = (tl.minimum(k, K - 1) // GROUP_SIZE)[None, :]
            s = tl.load(s_rows[:, None] + g, mask=n_valid[:, None], other=0.0)
            if HAS_ZEROS:
                z = tl.load(z_rows[:, None] + g, mask=n_valid[:, None], other=0.0)
                w = (q.to(tl.float32) - (8.0 if PACKED else 0.0)) * s + z
            else:
                w = q.to(tl.float32) * s
            # float32 as in the reference, then one rounding to the dtype the dot takes.
            b = tl.trans(w.to(a.dtype))
        else:
            b = tl.load(b_rows[None, :] + k[:, None], mask=(k < K)[:, None] & n_valid[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")
    if WEIGHTED:
        acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    out = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


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
    b: torch.Tensor | QuantizedWeight,
    out: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_experts: torch.Tensor,
    rows_per_a: int,
    weights: torch.Tensor | None,
) -> None:
    """``out[r] = a[r // rows_per_a] @ b[expert of r].T`` (times ``weights[r]`` if given) for each sorted row ``r``.

    ``b`` is a dense ``[experts, n, k]`` stack or a quantized one (``spindle.kernels.moe.quantize_experts``).
    """
    quantized = isinstance(b, QuantizedWeight)
    values = b.qweight if quantized else b
    scales = b.scales if quantized else values
    zeros = b.zeros if quantized and b.zeros is not None else scales
    num_experts, n, k = values.shape[0], values.shape[1], a.shape[1]
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        values,
        scales,
        zeros,
        out,
        sorted_rows,
        block_experts,
        out if weights is None else weights,
        num_experts,
        n,
        k,
        a.stride(0),
        values.stride(0),
        values.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        WEIGHTED=weights is not None,
        QUANTIZED=quantized,
        PACKED=quantized and b.bits == 4,
        HAS_ZEROS=quantized and b.zeros is not None,
        GROUP_SIZE=b.group_size if quantized else 1,
        DOT_FP32=dot_in_fp32(a.dtype),
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token (Triton; see ``spindle.kernels.moe``).

    Args:
        x: ``[tokens, hidden]``, dense rows.
        w13: ``[num_experts, 2 * intermediate, hidden]``, each matrix with dense rows, or its quantized stack
            (``spindle.kernels.moe.quantize_experts``, dense tensors).
        w2: ``[num_experts, hidden, intermediate]``, each matrix with dense rows (or quantized, as ``w13``).
        topk_weights: ``[tokens, top_k]``.
        topk_ids: int64 ``[tokens, top_k]``.

    Returns:
        ``[tokens, hidden]`` in ``x``'s dtype.

    """
    tokens, top_k = topk_ids.shape
    num_experts, double_intermediate = (w13.qweight if isinstance(w13, QuantizedWeight) else w13).shape[:2]
    hidden = x.shape[1]
    sorted_rows, block_experts = _align(topk_ids, num_experts)
    gate_up = torch.empty(tokens * top_k, double_intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_rows, block_experts, top_k, None)
    act = silu_and_mul(gate_up)
    down = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.float().flatten().contiguous()
    _grouped_gemm(act, w2, down, sorted_rows, block_experts, 1, weights)
    return down.view(tokens, top_k, -1).sum(1).to(x.dtype)
