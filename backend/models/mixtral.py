"""Mixtral: Llama attention, and a sparse mixture-of-experts MLP in place of the dense one.

:class:`MixtralDecoderLayer` and :class:`MixtralForCausalLM` are also the MoE building blocks of the other MoE
families (:mod:`spindle.backend.models.qwen3_moe`): a subclass names its attention class, how its config reads, and
its checkpoint's names for the router and the experts' matrices.
"""

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from spindle.backend import parallel
from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard
from spindle.backend.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM, _weight
from spindle.kernels import huge_pages
from spindle.kernels.moe import Experts, quantize_experts, route_tokens
from spindle.kernels.quant import QuantizedWeight


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Pre-norm attention, then the sparse MoE block: a router picks each token's ``top_k`` experts.

    The experts' weights are stacked, flat so that the loader fills them by rows: ``w13`` holds each expert's gate
    rows then up rows (``[experts * 2 * intermediate, hidden]``), ``w2`` its down projection
    (``[experts * hidden, intermediate]``). Under tensor parallelism each rank holds every expert's share of the
    intermediate dimension (``intermediate / ranks`` gate, up and down columns) and the experts' outputs are
    all-reduced. After :meth:`MixtralForCausalLM.prepare_weights` they run through
    :class:`~spindle.kernels.moe.Experts`.
    """

    def build_mlp(self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype) -> None:
        """The MoE block's weights in place of the dense MLP's: the router and the stacked experts."""
        self.num_experts, self.top_k, self.renormalize, intermediate = self.moe_config(config)
        if intermediate % shard.size:
            raise ValueError(
                f"tensor_parallel_size={shard.size} does not fit the model: its experts' intermediate size "
                f"{intermediate} is not divisible by {shard.size}"
            )
        self.intermediate = intermediate // shard.size
        self.router = _weight(self.num_experts, config.hidden_size, dtype=dtype)
        self.w13 = _weight(self.num_experts * 2 * self.intermediate, config.hidden_size, dtype=dtype)
        self.w2 = _weight(self.num_experts * config.hidden_size, self.intermediate, dtype=dtype)
        self.experts: Experts | None = None

    @staticmethod
    def moe_config(config: CheckpointConfig) -> tuple[int, int, bool, int]:
        """``(experts, top_k, renormalize, intermediate size of an expert)`` of the config: Mixtral's fields."""
        hf = config.hf_config
        return hf["num_local_experts"], hf["num_experts_per_tok"], True, config.intermediate_size

    def prepare_experts(
        self, bits: int | None = None, stacks: tuple[QuantizedWeight, QuantizedWeight] | None = None
    ) -> None:
        """Build the :class:`~spindle.kernels.moe.Experts` the forward runs; release the stacks it no longer reads.

        Args:
            bits: 8 or 4 to quantize the experts (:func:`~spindle.kernels.moe.quantize_experts`), which then hold
                their quantized form alone; None to run them in the model dtype.
            stacks: the experts' ``w13`` and ``w2`` already quantized (a GGUF file's blocks), ``[experts, out, in]``
                stacks held alone; ``bits`` is then not read.

        """
        hidden = self.w13.shape[1]
        w13 = self.w13.data.view(self.num_experts, 2 * self.intermediate, hidden)
        w2 = self.w2.data.view(self.num_experts, hidden, self.intermediate)
        if stacks is not None:
            self.experts = Experts(*stacks)
        elif bits is None:
            self.experts = Experts(w13, w2)
        else:
            self.experts = Experts(quantize_experts(w13, bits), quantize_experts(w2, bits))
        if not self.experts.keeps_dense:
            self.w13.data = torch.empty(0, dtype=self.w13.dtype, device=self.w13.device)
            self.w2.data = torch.empty(0, dtype=self.w2.dtype, device=self.w2.device)

    def stack_forms(self) -> dict[str, object] | None:
        """As :meth:`LlamaDecoderLayer.stack_forms`: Mixtral's own layer, its experts run by the C++ ``fused_moe``."""
        experts = self.experts
        if type(self) is not MixtralDecoderLayer or experts is None:
            return None
        if experts.quantized and not experts.activations_quantized:  # the float path is no op of the stack's
            return None
        return None if experts.eager or experts.triton else self._stack_forms({})

    def add_to_stack(self, stack: object, forms: dict[str, object], kv_cache: KVCache) -> None:
        """Append this layer, its :meth:`stack_forms`, to ``stack``, over its ``kv_cache``."""
        self.add_attention_to_stack(stack, forms, kv_cache)
        experts = self.experts
        if experts.activations_quantized:
            stack.add_moe_a8_mlp(self.router, self.top_k, self.renormalize, *experts.a8_operands)
            return
        stack.add_moe_mlp(
            self.router,
            self.top_k,
            self.renormalize,
            experts.w13,
            experts.w2,
            experts.num_experts,
            experts.intermediate,
            experts.tiled,
        )

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """Route each token of the normalised ``hidden [T, hidden_size]`` to its experts and sum their outputs."""
        topk_weights, topk_ids = route_tokens(hidden, self.router, self.top_k, self.renormalize)
        if self.experts is None:
            self.prepare_experts()
        return parallel.all_reduce(self.experts(hidden, topk_weights, topk_ids))  # type: ignore[misc]


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral over the paged KV cache: :class:`~spindle.backend.models.llama.LlamaForCausalLM` with MoE layers.

    Checkpoints name each expert's matrices ``model.layers.L.block_sparse_moe.experts.E.w1/w2/w3.weight`` (gate,
    down, up) and the router ``block_sparse_moe.gate.weight``; they load into each layer's stacked ``w13``, ``w2``
    and ``router``. ``--quantization int8`` / ``int4`` quantizes the attention projections (and any dense MLP), the
    LM head and the experts, which then hold their quantized form alone. Under tensor parallelism each rank holds its
    share of every expert's intermediate dimension.
    """

    layer_cls = MixtralDecoderLayer

    moe_block = "block_sparse_moe"
    """The checkpoint's name of a layer's MoE block (its router is ``<block>.gate.weight``)."""
    expert_matrices = {"w1": "gate", "w3": "up", "w2": "down"}
    """The checkpoint's names of an expert's matrices (``<block>.experts.E.<name>.weight``), by role."""

    def projections(self) -> dict[str, tuple[nn.Module, str]]:
        """The projections of every layer that has them and the LM head, by name (the experts are not projections)."""
        return {name: (module, attr) for name, (module, attr) in super().projections().items() if hasattr(module, attr)}

    def prepare_weights(self, quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Prepare the projections as the parent does, and each MoE layer's experts for the fused MoE path.

        Experts given as stacks (``layers.N.w13`` and ``layers.N.w2`` in ``quantized``, as
        :func:`~spindle.backend.models.loader.quantized_weights` gives them) are run as they are. Others are
        quantized to the bits of the layers' quantized projections (the LM head, int8 whatever ``--quantization``
        says, and an embedding table aside), and stay in the model dtype when those are not quantized.

        Raises:
            ValueError: when experts are to take the projections' bits and those are more than one width.

        """
        super().prepare_weights(quantized)
        quantized = quantized or {}
        projections = self.projections()
        widths = {w.bits for name, w in quantized.items() if name.startswith("layers.") and name in projections}
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, MixtralDecoderLayer):
                continue
            w13, w2 = quantized.get(f"layers.{i}.w13"), quantized.get(f"layers.{i}.w2")
            if w13 is not None and w2 is not None:
                layer.prepare_experts(stacks=(w13, w2))
                continue
            if len(widths) > 1:
                raise ValueError(
                    f"the layers' projections are quantized to {sorted(widths)} bits: the experts take one"
                )
            layer.prepare_experts(next(iter(widths), None))
        # The experts in a block of their own on huge pages, as the projections are (spindle.kernels.huge_pages).
        huge_pages.gather([layer.experts for layer in self.layers if getattr(layer, "experts", None) is not None])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load as the parent does; transformers v5's fused expert tensors are first split into this family's names.

        v5 saves (with ``save_original_format=False``) a layer's experts as ``mlp.experts.gate_up_proj``
        ``[experts, 2 * intermediate, hidden]`` and ``mlp.experts.down_proj`` ``[experts, hidden, intermediate]``, and
        its router as ``mlp.gate.weight``: split per expert, each matrix then shards and loads as a per-expert one.
        """
        super().load_weights(self._split_fused_experts(weights))

    def _split_fused_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with each v5 fused expert tensor split into per-expert matrices of this family's names."""
        names = {role: name for name, role in self.expert_matrices.items()}
        for hf_name, tensor in weights:
            found = re.fullmatch(
                r"(model\.layers\.\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)", hf_name
            )
            if found is None:
                yield hf_name, tensor
                continue
            block = f"{found[1]}.{self.moe_block}"
            if found[2] == "gate.weight":
                yield f"{block}.gate.weight", tensor
                continue
            for expert, matrix in enumerate(tensor):
                if found[2] == "experts.down_proj":
                    yield f"{block}.experts.{expert}.{names['down']}.weight", matrix
                else:
                    gate, up = matrix.chunk(2)
                    yield f"{block}.experts.{expert}.{names['gate']}.weight", gate
                    yield f"{block}.experts.{expert}.{names['up']}.weight", up

    def _expert_matrix(self, hf_name: str) -> tuple[str, int, str] | None:
        """``(layer prefix, expert, role)`` of an expert's matrix in the checkpoint, else None."""
        found = re.fullmatch(rf"model\.(layers\.\d+)\.{self.moe_block}\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if found is None or found[3] not in self.expert_matrices:
            return None
        return found[1], int(found[2]), self.expert_matrices[found[3]]

    def shard_range(self, hf_name: str) -> tuple[int, int, int] | None:
        """As the parent's, and this rank's share of an expert's intermediate dimension: gate/up rows, down columns."""
        matrix = self._expert_matrix(hf_name)
        if matrix is None or self.shard.size == 1:
            return super().shard_range(hf_name)
        prefix, _, role = matrix
        rows = self.layers[int(prefix.split(".")[1])].intermediate
        return (1 if role == "down" else 0), self.shard.rank * rows, rows

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """Where a Hugging Face tensor goes; an expert's matrix is a block of rows of its layer's stack.

        ``model.layers.3.block_sparse_moe.experts.5.w3.weight`` -> ``("layers.3.w13", (2 * 5 + 1) * intermediate,
        intermediate)`` (this rank's intermediate size); the router ``block_sparse_moe.gate.weight`` ->
        ``("layers.3.router", 0, None)``.
        """
        router = re.fullmatch(rf"model\.(layers\.\d+)\.{self.moe_block}\.gate\.weight", hf_name)
        if router is not None:
            return f"{router[1]}.router", 0, None
        matrix = self._expert_matrix(hf_name)
        if matrix is None:
            return super().parameter_slice(hf_name)
        prefix, expert, role = matrix
        intermediate = self.layers[int(prefix.split(".")[1])].intermediate
        if role == "down":
            return f"{prefix}.w2", expert * self.config.hidden_size, self.config.hidden_size
        return f"{prefix}.w13", (2 * expert + (role == "up")) * intermediate, intermediate
