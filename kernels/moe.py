"""Mixture-of-experts: top-k routing, and the experts' SwiGLU MLPs run over the tokens routed to each (fused MoE).

:func:`route` turns router logits into each token's experts and weights (:func:`route_tokens` the router's
weight and the hidden states, in one op on the CPU). :class:`Experts` holds one layer's stacked
expert weights and runs them: the tokens' expert assignments are grouped by expert, each expert's rows go through
one GEMM per projection (gate/up fused, SiLU-and-mul, down), and the results come back to their tokens weighted by
the routing weights. On CUDA (or under :func:`~spindle.kernels.force_triton`) that is a Triton grouped GEMM
(:mod:`spindle.kernels.triton.moe`); on the CPU a C++ op (``kernels/cpu/moe.cpp``): with bf16 weights in
``bf16_linear``'s tiles, or float32 ones in tiles of 16 outputs, OpenMP regions over (expert, rows, column tile)
work items, bf16 on AMX in blocks of 16 rows where the CPU has it, float32 on an 8-float-vector micro-kernel (AVX2
and FMA on x86); else ATen's matmul per expert. Within :func:`~spindle.kernels.eager` the torch loop over the
experts of :func:`fused_moe_reference`, which the tests hold the other two to.

Experts may be weight-only quantized (``--quantization int8`` / ``int4``, :func:`quantize_experts`): each expert's
matrices as :mod:`spindle.kernels.quant` quantizes a 2-D weight, stacked, and held in that form alone; or a GGUF
file's expert blocks, decoded exactly to the same layouts (int4 per group of 32; int8 per group of 32 or 16, with
offsets for Q5_1 and Q5_K). The Triton kernel runs every such layout as it is stored and dequantizes it in registers,
the reference one expert at a time. On a CPU with AVX2 the C++ op runs them as the quantized projections run, with
their activations quantized to int8 (``a8_linear``'s kernel, each expert laid out by ``a8_pack`` in place of the
stacks); within :func:`~spindle.kernels.linear.weight_only` it keeps the activations float and reads the stacks as
they are stored, dequantizing in registers.
"""

import dataclasses
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from spindle.kernels import cpu, is_eager, is_forced_triton, quant
from spindle.kernels.linear import a8_form, float_activations, runs_a8
from spindle.kernels.quant import QuantizedWeight, dequantize, quantize


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
    logits = router_logits.float()
    if renormalize:
        # The top-k of the softmax, renormalised, is the softmax of the top-k logits: two small ops instead of four.
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    return torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)


def route_tokens(
    hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights: :func:`route` of ``F.linear(hidden, router)``.

    On the CPU (outside :func:`~spindle.kernels.eager` and :func:`~spindle.kernels.force_triton`) one C++ op
    (``moe_route`` in ``kernels/cpu/moe.cpp``) computes the logits, rounded to ``hidden``'s dtype as ``F.linear``'s
    are, their top-k and the softmax, in place of four ATen calls (~25 us a layer in a decode step of 64 tokens). The
    decode stack calls the same op, so both give the same routing.

    Args:
        hidden: ``[tokens, hidden_size]`` normalised hidden states.
        router: ``[num_experts, hidden_size]``, of ``hidden``'s dtype.
        top_k: experts per token.
        renormalize: whether each token's ``top_k`` weights are scaled to sum to 1.

    Returns:
        ``(weights, ids)`` as :func:`route` returns them.

    """
    if hidden.is_cuda or is_eager() or is_forced_triton():
        return route(F.linear(hidden, router), top_k, renormalize)
    return cpu.moe_route(hidden, router, top_k, renormalize)


def quantize_experts(weights: torch.Tensor, bits: int) -> QuantizedWeight:
    """Each ``[out, in]`` matrix of ``weights [experts, out, in]`` quantized as a 2-D weight is, then stacked.

    Int8 per row, int4 per group of inputs (:func:`~spindle.kernels.quant.quantize`), as one
    :class:`~spindle.kernels.quant.QuantizedWeight` whose ``qweight``, ``scales`` and ``zeros`` have a leading
    experts dimension.

    Raises:
        ValueError: as :func:`~spindle.kernels.quant.quantize` does (bits, int4 group divisibility).

    """
    experts, outputs, inputs = weights.shape
    flat = quantize(weights.reshape(experts * outputs, inputs), bits)
    zeros = None if flat.zeros is None else flat.zeros.view(experts, outputs, -1)
    return QuantizedWeight(
        flat.qweight.view(experts, outputs, -1), flat.scales.view(experts, outputs, -1), zeros, flat.group_size
    )


def expert_matrix(weights: torch.Tensor | QuantizedWeight, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s dense ``[out, in]`` matrix of a stack, dequantized (in float32, rounded to ``dtype``)."""
    if isinstance(weights, torch.Tensor):
        return weights[expert]
    return dequantize(weights.select(expert), dtype)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """The experts' MLPs in torch, one expert at a time: the reference of the fused paths (and ``--enforce-eager``'s).

    With ``quantize_activations`` (quantized experts only), each projection's rows are quantized to int8 per 32
    inputs first (:func:`spindle.kernels.quant.a8_linear`): the reference of the C++ op where the experts run
    ``a8_linear``'s kernel (:attr:`Experts.activations_quantized`).

    Args:
        x: ``[tokens, hidden]``.
        w13: ``[num_experts, 2 * intermediate, hidden]``, each expert's gate rows, then its up rows; or its
            :func:`quantize_experts`, each expert dequantized to ``x``'s dtype when it runs.
        w2: ``[num_experts, hidden, intermediate]``, each expert's down projection (or quantized, as ``w13``).
        topk_weights: ``[tokens, top_k]``, each assignment's routing weight.
        topk_ids: int64 ``[tokens, top_k]``, each assignment's expert.
        quantize_activations: whether each projection's rows are quantized to int8 first (quantized experts only).

    Returns:
        ``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])``, ``[tokens, hidden]`` in ``x``'s dtype; the
        weighted outputs are summed in float32.

    """

    def project(rows: torch.Tensor, stack: torch.Tensor | QuantizedWeight, expert: int) -> torch.Tensor:
        if quantize_activations:
            return quant.a8_linear(rows, stack.select(expert))
        return F.linear(rows, expert_matrix(stack, expert, x.dtype))

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate, up = project(x[tokens], w13, expert).chunk(2, dim=-1)
        y = project(F.silu(gate) * up, w2, expert)
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slot, None].float())
    return out.to(x.dtype)


class Experts:
    """One MoE layer's expert weights in the form the step's path runs, and the call that runs them.

    Built within :func:`~spindle.kernels.eager` it runs :func:`fused_moe_reference`; on CUDA tensors (or within
    :func:`~spindle.kernels.force_triton`) the Triton grouped GEMM; else the C++ op, with bf16 weights laid out once
    in ``bf16_linear``'s tiles where that kernel runs and float32 ones in the op's tiles of 16 outputs (the dense
    stacks are then dropped: :attr:`keeps_dense`), and quantized ones in ``a8_pack``'s layout where they run with
    int8 activations (:attr:`activations_quantized`), else as they are.

    Args:
        w13: ``[num_experts, 2 * intermediate, hidden]``, gate rows then up rows per expert; or its
            :func:`quantize_experts` (then ``w2`` is quantized too).
        w2: ``[num_experts, hidden, intermediate]``.

    Raises:
        ValueError: when one of ``w13`` and ``w2`` is quantized and the other not, or when quantized experts are to
            run the C++ op in a layout it does not read (:func:`runs_on_cpu`).

    """

    def __init__(self, w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight) -> None:
        self.quantized = isinstance(w13, QuantizedWeight)
        if isinstance(w2, QuantizedWeight) != self.quantized:
            raise ValueError("w13 and w2 must both be quantized or both dense")
        self.num_experts, double_intermediate = w13.qweight.shape[:2] if self.quantized else w13.shape[:2]
        self.intermediate = double_intermediate // 2
        self.hidden = w2.scales.shape[1] if self.quantized else w13.shape[2]
        self.eager = is_eager()
        self.triton = is_forced_triton() or (w13.qweight if self.quantized else w13).is_cuda
        if self.quantized and not (self.eager or self.triton) and not (runs_on_cpu(w13) and runs_on_cpu(w2)):
            raise ValueError(
                f"quantized experts run on the CPU in groups of a multiple of 16 inputs (int8) or 32 (int4), not "
                f"int{w13.bits} in groups of {w13.group_size} and int{w2.bits} in groups of {w2.group_size}"
            )
        tile = not (self.quantized or self.eager or self.triton) and _can_tile(w13) and _can_tile(w2)
        self.tiled = tile
        self.w13 = cpu.moe_pack(w13) if tile else w13
        self.w2 = cpu.moe_pack(w2) if tile else w2
        self.group_sizes = (w13.group_size, w2.group_size) if self.quantized else None
        # Quantized experts on the CPU with int8 activations: a8_pack's tensors per stack, in place of the stacks.
        self.a8 = _a8_stacks(w13, w2) if self.quantized and not (self.eager or self.triton) else None
        if self.a8 is not None:
            self.w13 = self.w2 = None

    @property
    def activations_quantized(self) -> bool:
        """Whether the C++ op quantizes the activations to int8 (``a8_linear``'s kernel).

        Quantized projections do so by default on the CPU; :func:`fused_moe_reference`'s ``quantize_activations`` is
        the reference.
        """
        return self.a8 is not None

    @property
    def a8_operands(self) -> tuple[list[torch.Tensor | None], int, list[torch.Tensor | None], int, int]:
        """What ``fused_moe_a8`` and the decode stack's ``add_moe_a8_mlp`` take for these experts.

        That is ``(w13's a8_pack tensors, its group size, w2's, its group size, intermediate)``; only with
        :attr:`activations_quantized`.
        """
        (w13, w2), (up, down) = self.a8, self.group_sizes
        return w13, up, w2, down, self.intermediate

    @property
    def keeps_dense(self) -> bool:
        """Whether the caller's dense ``w13`` and ``w2`` are still read (else they may be released)."""
        return not (self.tiled or self.quantized)

    @property
    def _has_cpu_layout(self) -> bool:
        """Whether the C++ op runs the experts' own layout (tiles or quantized stacks), not the caller's tensors."""
        return not (self.eager or self.triton or self.keeps_dense)

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The tensors the C++ op reads, ``w13``'s then ``w2``'s: tiles or quantized stacks; none for another path."""
        if not self._has_cpu_layout:
            return []
        if self.tiled:
            return [self.w13, self.w2]
        if self.a8 is not None:
            return [t for stack in self.a8 for t in stack if t is not None]
        return [t for stack in (self.w13, self.w2) for t in (stack.qweight, stack.scales, stack.zeros) if t is not None]

    def move_kernel_tensors(self, moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace each of :meth:`kernel_tensors` by ``moved(tensor)``, a copy of it (``huge_pages.gather``)."""
        if not self._has_cpu_layout:
            return
        if self.tiled:
            self.w13, self.w2 = moved(self.w13), moved(self.w2)
            return
        if self.a8 is not None:
            self.a8 = tuple([None if t is None else moved(t) for t in stack] for stack in self.a8)
            return
        self.w13, self.w2 = (
            dataclasses.replace(
                stack,
                qweight=moved(stack.qweight),
                scales=moved(stack.scales),
                zeros=None if stack.zeros is None else moved(stack.zeros),
            )
            for stack in (self.w13, self.w2)
        )

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum of its routed experts, ``x [tokens, hidden]``: see :func:`fused_moe_reference`."""
        if self.triton:
            triton_moe = importlib.import_module("spindle.kernels.triton.moe")
            return triton_moe.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        if self.eager:
            return fused_moe_reference(x, self.w13, self.w2, topk_weights, topk_ids)
        if self.quantized:
            # The C++ ops take float32 or bf16 activations: float16 ones run as float32 (exactly) and are rounded back.
            given = x.float() if x.dtype == torch.float16 else x
            if self.a8 is not None:
                out = cpu.fused_moe_a8(given, *self.a8_operands, topk_weights, topk_ids)
            else:
                out = cpu.fused_moe_quantized(given, self.w13, self.w2, topk_weights, topk_ids)
            return out.to(x.dtype)
        return cpu.fused_moe(
            x, self.w13, self.w2, topk_weights, topk_ids, self.num_experts, self.intermediate, self.tiled
        )


def _a8_stacks(w13: QuantizedWeight, w2: QuantizedWeight) -> tuple[list[torch.Tensor | None], ...] | None:
    """Each stack's experts laid out by ``a8_pack`` (its four tensors, each stacked by expert), or None.

    They are where the C++ op runs them with int8 activations: the default of quantized CPU weights, unless the
    activations stay float (:func:`~spindle.kernels.linear.weight_only`) or a layout does not suit ``a8_linear``'s
    kernel.
    """
    stacks = (w13, w2)
    # float32 stands for every activation dtype: the call runs float16 as float32, and the kernel takes bf16 too.
    if float_activations() or not all(runs_a8(stack.select(0), torch.float32) for stack in stacks):
        return None
    packed = []
    for stack in stacks:
        experts = [a8_form(stack.select(e)) for e in range(stack.qweight.shape[0])]
        # a8_pack keeps an int8 matrix whose values all fit in 6 bits (Q6_K, Q5_K) in 6: the experts must agree.
        if len({tuple(None if t is None else tuple(t.shape) for t in form) for form in experts}) > 1:
            return None
        packed.append([None if parts[0] is None else torch.stack(parts) for parts in zip(*experts, strict=True)])
    return tuple(packed)


def runs_on_cpu(stack: QuantizedWeight) -> bool:
    """Whether the C++ op reads a quantized stack as it is stored.

    It reads every layout whose groups are a multiple of the inputs its micro-kernels step under one scale: 16 for
    int8 (per row or per group, with or without offsets), 32 for int4. Every kept GGUF type's decoding is one.
    """
    return stack.group_size % (16 if stack.bits == 8 else 32) == 0


def _can_tile(weight: torch.Tensor) -> bool:
    """Whether the stack ``weight`` runs the C++ op's tiles: bf16 where ``bf16_linear`` runs, float32 in 16 outputs."""
    _, outputs, inputs = weight.shape
    if weight.dtype == torch.float32:
        return outputs % 16 == 0
    return weight.dtype == torch.bfloat16 and outputs % 16 == 0 and inputs % 2 == 0 and cpu.bf16_linear_supported()
