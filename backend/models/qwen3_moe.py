"""Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm) and Mixtral's MoE block, dense MLPs where the config says."""

from typing import Any

import torch
from torch import nn

from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.mixtral import MixtralDecoderLayer, MixtralForCausalLM
from spindle.backend.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    """A sparse Qwen3-MoE layer: :class:`Qwen3Attention`, and experts of ``moe_intermediate_size``.

    The top-k weights are renormalised only when the config's ``norm_topk_prob`` is set.
    """

    attention_cls = Qwen3Attention

    @staticmethod
    def moe_config(config: CheckpointConfig) -> tuple[int, int, bool, int]:
        """``(experts, top_k, renormalize, intermediate size of an expert)`` from Qwen3-MoE's fields."""
        hf = config.hf_config
        # transformers v5 saves the expert count as num_local_experts, earlier versions as num_experts.
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        return experts, hf["num_experts_per_tok"], bool(hf.get("norm_topk_prob", False)), hf["moe_intermediate_size"]


def is_sparse_layer(hf_config: dict[str, Any], index: int) -> bool:
    """Whether layer ``index`` of a Qwen3-MoE config has experts (else a dense MLP), as transformers decides."""
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts", 0))
    step = hf_config.get("decoder_sparse_step", 1)
    return index not in hf_config.get("mlp_only_layers", []) and experts > 0 and (index + 1) % step == 0


class Qwen3MoeForCausalLM(MixtralForCausalLM, Qwen3ForCausalLM):
    """Qwen3-MoE over the paged KV cache: dense MLP layers where ``decoder_sparse_step`` / ``mlp_only_layers`` say.

    Checkpoints name the router ``model.layers.L.mlp.gate.weight`` and each expert's matrices
    ``mlp.experts.E.gate_proj/up_proj/down_proj.weight``; a dense layer's MLP and the q/k norms load as Qwen3's.
    """

    layer_cls = Qwen3MoeDecoderLayer
    moe_block = "mlp"
    expert_matrices = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        # The parent built every layer sparse (its layer class gets no index); the dense ones are rebuilt here. The
        # replaced layers' uninitialised tensors were never touched.
        self.layers = nn.ModuleList(
            layer
            if is_sparse_layer(config.hf_config, i)
            else Qwen3DecoderLayer(config, self.shard, dtype, config.layer_windows[i])
            for i, layer in enumerate(self.layers)
        )
