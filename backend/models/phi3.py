"""Phi-3 / Phi-3.5 / Phi-4-mini decoder: Llama's maths with fused checkpoint projections and partial rotary."""

from collections.abc import Iterable, Iterator

import torch

from spindle.backend.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from spindle.kernels import attend, rotary_embedding


class Phi3Attention(LlamaAttention):
    """Llama attention that rotates only part of each head when the config says so.

    With a ``partial_rotary_factor`` below 1 (Phi-4-mini's 0.75) only the first ``rotary_dim`` dimensions of each
    query and key head are rotated; the rest pass through unrotated.
    """

    def attend_heads(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate the heads' rotary part, then cache and attend; a whole-head rotation goes through Llama's path."""
        rotary_dim = cos_sin_cache.shape[-1]
        if rotary_dim == self.head_dim:
            return super().attend_heads(positions, q, k, v, kv_cache, cos_sin_cache)
        q_rot, k_rot = rotary_embedding(
            positions, q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous(), cos_sin_cache
        )
        q = torch.cat((q_rot, q[..., rotary_dim:]), dim=-1)
        k = torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)
        return attend(q, k, v, *kv_cache, self.scale, sliding_window=self.sliding_window)


class Phi3DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`Phi3Attention`."""

    attention_cls = Phi3Attention


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4-mini: Llama's layers, LongRoPE (``build_cos_sin_cache``) and partial rotary.

    The checkpoints store each layer's q/k/v as one ``self_attn.qkv_proj`` and gate/up as one ``mlp.gate_up_proj``,
    in the order Spindle fuses them too; they are split at load into Llama's names, so that tensor parallelism,
    quantization and LoRA treat a Phi-3 exactly as a Llama (each rank takes its heads of q, k and v).
    """

    layer_cls = Phi3DecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, from Phi-3's fused tensors."""
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        config = self.config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        for name, tensor in weights:
            if name.endswith("self_attn.qkv_proj.weight"):
                prefix = name.removesuffix("qkv_proj.weight")
                for part, piece in zip("qkv", tensor.split([q_size, kv_size, kv_size]), strict=True):
                    yield f"{prefix}{part}_proj.weight", piece
            elif name.endswith("mlp.gate_up_proj.weight"):
                prefix = name.removesuffix("gate_up_proj.weight")
                gate, up = tensor.chunk(2)
                yield f"{prefix}gate_proj.weight", gate
                yield f"{prefix}up_proj.weight", up
            else:
                yield name, tensor
