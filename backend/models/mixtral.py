"""Mixtral: Llama attention, and a sparse mixture-of-experts MLP in place of the dense one."""

import re

import torch
import torch.nn.functional as F
from torch import nn

from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard
from spindle.backend.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, _weight
from spindle.kernels import rms_norm
from spindle.kernels.moe import Experts, route
from spindle.kernels.quant import QuantizedWeight

_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


class MixtralDecoderLayer(nn.Module):
    """Pre-norm Llama attention, then the sparse MoE block: a router picks each token's ``top_k`` experts.

    The experts' weights are stacked, flat so that the loader fills them by rows: ``w13`` holds each expert's gate
    rows then up rows (``[experts * 2 * intermediate, hidden]``), ``w2`` its down projection
    (``[experts * hidden, intermediate]``). After :meth:`MixtralForCausalLM.prepare_weights` they run through
    :class:`~spindle.kernels.moe.Experts`.
    """

    def __init__(
        self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.num_experts = config.hf_config["num_local_experts"]
        self.top_k = config.hf_config["num_experts_per_tok"]
        self.intermediate = config.intermediate_size
        self.input_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.self_attn = LlamaAttention(config, shard, dtype, sliding_window)
        self.post_attention_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.router = _weight(self.num_experts, config.hidden_size, dtype=dtype)
        self.w13 = _weight(self.num_experts * 2 * self.intermediate, config.hidden_size, dtype=dtype)
        self.w2 = _weight(self.num_experts * config.hidden_size, self.intermediate, dtype=dtype)
        self.experts: Experts | None = None

    def prepare_experts(self) -> None:
        """Build the :class:`~spindle.kernels.moe.Experts` the forward runs; release the stacks it no longer reads."""
        hidden = self.w13.shape[1]
        self.experts = Experts(
            self.w13.data.view(self.num_experts, 2 * self.intermediate, hidden),
            self.w2.data.view(self.num_experts, hidden, self.intermediate),
        )
        if not self.experts.keeps_dense:
            self.w13.data = torch.empty(0, dtype=self.w13.dtype, device=self.w13.device)
            self.w2.data = torch.empty(0, dtype=self.w2.dtype, device=self.w2.device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one layer; ``residual`` is None for the first layer. Returns ``(hidden, residual)`` not yet summed."""
        if residual is None:
            residual = hidden
            hidden = rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = rms_norm(hidden, self.input_layernorm, self.eps, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, cos_sin_cache)
        hidden, residual = rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        topk_weights, topk_ids = route(F.linear(hidden, self.router), self.top_k)
        if self.experts is None:
            self.prepare_experts()
        return self.experts(hidden, topk_weights, topk_ids), residual  # type: ignore[misc]


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral over the paged KV cache: :class:`~spindle.backend.models.llama.LlamaForCausalLM` with MoE layers.

    Checkpoints name each expert's matrices ``model.layers.L.block_sparse_moe.experts.E.w1/w2/w3.weight`` (gate,
    down, up) and the router ``block_sparse_moe.gate.weight``; they load into each layer's stacked ``w13``, ``w2``
    and ``router``. ``--quantization`` quantizes the attention projections and the LM head; the experts stay in the
    model dtype. Tensor parallelism is refused: the experts' intermediate dimension is not sharded yet.
    """

    supports_tensor_parallel = False
    """The experts are not sharded over ranks (yet): a TP>1 engine refuses this class."""

    layer_cls = MixtralDecoderLayer

    def projections(self) -> dict[str, tuple[nn.Module, str]]:
        """The attention projections of every layer and the LM head, by name (the experts are not projections)."""
        found: dict[str, tuple[nn.Module, str]] = {}
        for i, layer in enumerate(self.layers):
            found.update({f"layers.{i}.self_attn.{name}": (layer.self_attn, name) for name in ("qkv_proj", "o_proj")})
        found["lm_head"] = (self, "embed_tokens" if self.lm_head is None else "lm_head")
        return found

    def prepare_weights(self, quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Prepare the projections as the parent does, and each layer's experts for the fused MoE path."""
        super().prepare_weights(quantized)
        for layer in self.layers:
            layer.prepare_experts()

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """Where a Hugging Face tensor goes; an expert's matrix is a block of rows of its layer's stack.

        ``model.layers.3.block_sparse_moe.experts.5.w3.weight`` -> ``("layers.3.w13", (2 * 5 + 1) * intermediate,
        intermediate)``; the router ``block_sparse_moe.gate.weight`` -> ``("layers.3.router", 0, None)``.
        """
        if ".block_sparse_moe." not in hf_name:
            return super().parameter_slice(hf_name)
        prefix, rest = hf_name.removeprefix("model.").split(".block_sparse_moe.", 1)
        if rest == "gate.weight":
            return f"{prefix}.router", 0, None
        found = _EXPERT.fullmatch("block_sparse_moe." + rest)
        if found is None:
            return hf_name, 0, None
        expert, matrix = int(found[1]), found[2]
        intermediate, hidden = self.config.intermediate_size, self.config.hidden_size
        if matrix == "w2":
            return f"{prefix}.w2", expert * hidden, hidden
        return f"{prefix}.w13", (2 * expert + (matrix == "w3")) * intermediate, intermediate
