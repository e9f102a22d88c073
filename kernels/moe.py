"""Mixture-of-experts: top-k routing, and the experts' SwiGLU MLPs run over the tokens routed to each (fused MoE).

:func:`route` turns router logits into each token's experts and weights. :class:`Experts` holds one layer's stacked
expert weights and runs them: the tokens' expert assignments are grouped by expert, each expert's rows go through
one GEMM per projection (gate/up fused, SiLU-and-mul, down), and the results come back to their tokens weighted by
the routing weights. On CUDA (or under :func:`~spindle.kernels.force_triton`) that is a Triton grouped GEMM
(:mod:`spindle.kernels.triton.moe`); on the CPU a C++ op (``kernels/cpu/moe.cpp``): with bf16 weights in
``bf16_linear``'s tiles, one OpenMP region over (expert, rows, column tile) work items, on AMX in blocks of 16 rows
where the CPU has it; else ATen's matmul per expert. Within :func:`~spindle.kernels.eager` the torch loop over the
experts of :func:`fused_moe_reference`, which the tests hold the other two to.
"""

import importlib

import torch
import torch.nn.functional as F

from spindle.kernels import cpu, is_eager, is_forced_triton


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights: softmax over all experts, top-k, renormalised if asked.

    Mixtral renormalises (the same as a softmax over the top-k logits); Qwen3-MoE does when its config's
    ``norm_topk_prob`` is set.

    Args:
        router_logits: ``[tokens, num_experts]``.
        top_k: experts per token.
        renormalize: whether each token's ``top_k`` weights are scaled to sum to 1.

    Returns:
        ``(weights, ids)``: float32 ``[tokens, top_k]`` and int64 ``[tokens, top_k]``, by descending weight.

    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The experts' MLPs in torch, one expert at a time: the reference of the fused paths (and ``--enforce-eager``'s).

    Args:
        x: ``[tokens, hidden]``.
        w13: ``[num_experts, 2 * intermediate, hidden]``, each expert's gate rows, then its up rows.
        w2: ``[num_experts, hidden, intermediate]``, each expert's down projection.
        topk_weights: ``[tokens, top_k]``, each assignment's routing weight.
        topk_ids: int64 ``[tokens, top_k]``, each assignment's expert.

    Returns:
        ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``, ``[tokens, hidden]`` in ``x``'s dtype; the
        weighted outputs are summed in float32.

    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slot, None].float())
    return out.to(x.dtype)


class Experts:
    """One MoE layer's expert weights in the form the step's path runs, and the call that runs them.

    Built within :func:`~spindle.kernels.eager` it runs :func:`fused_moe_reference`; on CUDA tensors (or within
    :func:`~spindle.kernels.force_triton`) the Triton grouped GEMM; else the C++ op, with bf16 weights laid out once
    in ``bf16_linear``'s tiles where that kernel runs (the dense stacks are then dropped: :attr:`keeps_dense`).

    Args:
        w13: ``[num_experts, 2 * intermediate, hidden]``, gate rows then up rows per expert.
        w2: ``[num_experts, hidden, intermediate]``.

    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.num_experts, double_intermediate, self.hidden = w13.shape
        self.intermediate = double_intermediate // 2
        self.eager = is_eager()
        self.triton = is_forced_triton() or w13.is_cuda
        tile = not (self.eager or self.triton) and _can_tile(w13) and _can_tile(w2)
        self.tiled = tile
        self.w13 = cpu.moe_pack(w13) if tile else w13
        self.w2 = cpu.moe_pack(w2) if tile else w2

    @property
    def keeps_dense(self) -> bool:
        """Whether the caller's dense ``w13`` and ``w2`` are still read (else they may be released)."""
        return not self.tiled

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum of its routed experts, ``x [tokens, hidden]``: see :func:`fused_moe_reference`."""
        if self.triton:
            triton_moe = importlib.import_module("spindle.kernels.triton.moe")
            return triton_moe.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        if self.eager:
            return fused_moe_reference(x, self.w13, self.w2, topk_weights, topk_ids)
        return cpu.fused_moe(
            x, self.w13, self.w2, topk_weights, topk_ids, self.num_experts, self.intermediate, self.tiled
        )


def _can_tile(weight: torch.Tensor) -> bool:
    """Whether each expert's ``[out, in]`` matrix of the bf16 stack ``weight`` runs ``bf16_linear``."""
    _, outputs, inputs = weight.shape
    return weight.dtype == torch.bfloat16 and outputs % 16 == 0 and inputs % 2 == 0 and cpu.bf16_linear_supported()
