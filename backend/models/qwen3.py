"""Qwen3 decoder: the Llama-family layers with an RMSNorm over each query and key head before the rotation."""

import torch

from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard
from spindle.backend.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, _weight
from spindle.kernels import rms_norm


class Qwen3Attention(LlamaAttention):
    """Llama attention whose query and key heads are each RMS-normalised (``q_norm``, ``k_norm``) before rope.

    The norm weights are ``[head_dim]``, shared by every head, so every tensor-parallel rank holds them whole.
    """

    def __init__(
        self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype, sliding_window: int | None = None
    ) -> None:
        super().__init__(config, shard, dtype, sliding_window)
        self.eps = config.rms_norm_eps
        self.q_norm = _weight(config.head_dim, dtype=dtype)
        self.k_norm = _weight(config.head_dim, dtype=dtype)

    def attend_heads(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Normalise each query and key head, then rotate, cache and attend as Llama does."""
        q = rms_norm(q.reshape(-1, self.head_dim), self.q_norm, self.eps).view(q.shape)
        k = rms_norm(k.reshape(-1, self.head_dim), self.k_norm, self.eps).view(k.shape)
        return super().attend_heads(positions, q, k, v, kv_cache, cos_sin_cache)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`Qwen3Attention`."""

    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): Llama's layout with per-head q/k RMSNorm, ``head_dim`` from the config, no q/k/v biases.

    The checkpoint's ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight`` load into each layer's
    ``self_attn.q_norm`` and ``self_attn.k_norm``; everything else loads, shards and quantizes as Llama's.
    """

    layer_cls = Qwen3DecoderLayer

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """As :meth:`LlamaForCausalLM.parameter_slice`, plus the q/k norms."""
        name, offset, rows = super().parameter_slice(hf_name)
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            name = name.removesuffix(".weight")
        return name, offset, rows
