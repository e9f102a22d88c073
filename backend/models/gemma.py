"""Gemma 2 and Gemma 3 (text) decoders: Llama's projections with Gemma's norms, GeGLU, soft-capping and ropes."""

from collections.abc import Iterable
from typing import Any

import torch

from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard, _rope
from spindle.backend.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, _weight
from spindle.backend.models.qwen3 import Qwen3Attention
from spindle.kernels import attend, build_cos_sin_cache, gelu_tanh_and_mul, rms_norm


class Gemma2Attention(LlamaAttention):
    """Llama attention scaled by ``query_pre_attn_scalar ** -0.5`` with its scores soft-capped.

    ``attn_logit_softcapping`` (``cap * tanh(score / cap)`` before the softmax) is read with Gemma 2's default, 50;
    None turns it off.
    """

    default_softcap: float | None = 50.0
    """``attn_logit_softcapping`` when the config omits it (transformers' default for the family)."""

    def __init__(
        self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype, sliding_window: int | None = None
    ) -> None:
        super().__init__(config, shard, dtype, sliding_window)
        self.scale = config.hf_config.get("query_pre_attn_scalar", 256) ** -0.5
        self.softcap = config.hf_config.get("attn_logit_softcapping", self.default_softcap)

    def attend_heads(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate, cache and attend as Llama does, with the scores soft-capped."""
        return attend(q, k, v, *kv_cache, self.scale, positions, cos_sin_cache, self.sliding_window, self.softcap)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Sandwich norms around attention and a GeGLU MLP, the residual adds fused into the pre-norms.

    Each block's output is normalised (``post_attention_layernorm``, ``post_feedforward_layernorm``) before it joins
    the residual stream, and the MLP reads the stream through its own ``pre_feedforward_layernorm``.
    """

    attention_cls = Gemma2Attention
    act_and_mul = staticmethod(gelu_tanh_and_mul)

    def __init__(
        self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype, sliding_window: int | None = None
    ) -> None:
        super().__init__(config, shard, dtype, sliding_window)
        self.pre_feedforward_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.post_feedforward_layernorm = _weight(config.hidden_size, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one layer; ``residual`` is None for the first layer. Returns ``(hidden, residual)`` not yet summed."""
        hidden, residual = self.attention_block(positions, hidden, residual, kv_cache, cos_sin_cache)
        hidden = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        hidden, residual = rms_norm(hidden, self.pre_feedforward_layernorm, self.eps, residual)
        return rms_norm(self.mlp(hidden), self.post_feedforward_layernorm, self.eps), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: Llama's projections (loaded, sharded, quantized and adapted by LoRA as Llama's) in Gemma's layers.

    Gemma's RMSNorms weight by ``1 + w``: the one is added to every norm weight at load, so that the shared
    :func:`~spindle.kernels.rms_norm` (residual fusion included) serves them. The embeddings are scaled by
    ``sqrt(hidden_size)`` rounded to the model dtype, as transformers does; the final logits are soft-capped by
    ``final_logit_softcapping`` (30 by default, None to turn off). Sliding and global layers alternate as
    :attr:`~spindle.backend.models.checkpoint_config.CheckpointConfig.layer_windows` says.
    """

    layer_cls = Gemma2DecoderLayer
    default_final_softcap: float | None = 30.0
    """``final_logit_softcapping`` when the config omits it (transformers' default for the family)."""

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        self.final_softcap = config.hf_config.get("final_logit_softcapping", self.default_final_softcap)
        # A buffer, not a Python float: the product then rounds as transformers' and a captured graph holds no copy.
        self.register_buffer(
            "embed_scale", torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype), persistent=False
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``, scaled by ``sqrt(hidden_size)``."""
        return super()._embed(input_ids) * self.embed_scale

    def input_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """A prompt's own embeddings, scaled by ``sqrt(hidden_size)`` as token embeddings are."""
        return super().input_embeds(embeds) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As :meth:`LlamaForCausalLM.compute_logits`, soft-capped: ``cap * tanh(logits / cap)``."""
        logits = super().compute_logits(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, with one added to every norm weight (``1 + w``)."""
        super().load_weights(
            (name, tensor.float() + 1 if name.endswith("norm.weight") else tensor) for name, tensor in weights
        )

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """As :meth:`LlamaForCausalLM.parameter_slice`, plus the feed-forward sandwich norms (and Gemma 3's q/k)."""
        name, offset, rows = super().parameter_slice(hf_name)
        if name.endswith("norm.weight"):
            name = name.removesuffix(".weight")
        return name, offset, rows


class Gemma3Attention(Qwen3Attention, Gemma2Attention):
    """Gemma 2's attention with Qwen3's per-head q/k norms, not soft-capped unless the config says so.

    Its layer's rope table is picked from the two the model stacks (:class:`Gemma3ForCausalLM`): the global one for
    a full-attention layer, the local one for a sliding layer.
    """

    default_softcap = None

    def attend_heads(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Normalise the q/k heads, rotate them by this layer's table, cache and attend (soft-capped if set)."""
        table = cos_sin_cache[0 if self.sliding_window is None else 1]
        return super().attend_heads(positions, q, k, v, kv_cache, table)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """A Gemma 2 decoder layer with :class:`Gemma3Attention`."""

    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3, text-only checkpoints (``model_type`` ``gemma3_text``): Gemma 2 with q/k norms and two ropes.

    The full-attention layers rotate by the global base and scaling (``rope_theta`` and ``rope_scaling``, linear
    factor 8 in the larger checkpoints; v5: ``rope_parameters["full_attention"]``), the sliding layers by the local
    base (``rope_local_base_freq``; v5: ``rope_parameters["sliding_attention"]``). Both tables are stacked in
    ``cos_sin_cache`` (global first) and every layer picks its own. Neither soft-capping is on by default.
    """

    layer_cls = Gemma3DecoderLayer
    default_final_softcap = None

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        theta, scaling = _local_rope(config.hf_config)
        local = build_cos_sin_cache(config.head_dim, config.max_position_embeddings, theta, scaling, dtype)
        self.cos_sin_cache = torch.stack((self.cos_sin_cache, local))


def _local_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """The sliding layers' rope base and scaling: v5's ``rope_parameters["sliding_attention"]``, else v4's fields."""
    per_type = config.get("rope_parameters") or {}
    if "sliding_attention" in per_type:
        theta, scaling, _ = _rope({**config, "rope_parameters": per_type["sliding_attention"]})
        return theta, scaling
    return float(config.get("rope_local_base_freq", 10000.0)), None
