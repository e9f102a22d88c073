"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, with fused qkv and gate/up projections."""

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.backend.models.config import ModelConfig
from spindle.kernels import (
    AttentionMetadata,
    attend,
    attention_metadata,
    build_cos_sin_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from spindle.kernels.linear import can_pack, linear, pack_weight

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``."""


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Left uninitialised: every weight comes from a checkpoint through load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, rotary, cache write, paged attention, output projection."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype)
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size, dtype=dtype) if config.qkv_bias else None
        self.o_proj = _weight(config.hidden_size, self.q_size, dtype=dtype)
        self.packed: dict[str, torch.Tensor] = {}

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attend the flat batch ``hidden [T, hidden_size]`` over the cache; returns ``[T, hidden_size]``."""
        num_tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_proj, self.qkv_bias, self.packed.get("qkv_proj"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary_embedding(
            positions,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            cos_sin_cache,
        )
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, *kv_cache, self.scale)
        return linear(out.view(num_tokens, self.q_size), self.o_proj, packed=self.packed.get("o_proj"))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP blocks, with the residual adds fused into the norms."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.gate_up_proj = _weight(2 * config.intermediate_size, config.hidden_size, dtype=dtype)
        self.down_proj = _weight(config.hidden_size, config.intermediate_size, dtype=dtype)
        self.packed: dict[str, torch.Tensor] = {}

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
        gate_up = linear(hidden, self.gate_up_proj, packed=self.packed.get("gate_up_proj"))
        hidden = linear(silu_and_mul(gate_up), self.down_proj, packed=self.packed.get("down_proj"))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM that reads and writes a paged KV cache.

    Parameters are created uninitialised on the current default device (build it under ``with torch.device(...)``)
    and filled by :meth:`load_weights`. Their names are the Hugging Face ones, except that each layer's q/k/v
    projections are stacked into ``self_attn.qkv_proj`` (bias ``self_attn.qkv_bias``) and its gate/up projections
    into ``gate_up_proj``. On the CPU in bf16 the model runner calls :meth:`pack_weights` after loading; every
    ``packed`` dict then holds the oneDNN copies that the forward uses instead of the plain weights.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = _weight(config.hidden_size, dtype=dtype)
        self.lm_head = (
            None if config.tie_word_embeddings else _weight(config.vocab_size, config.hidden_size, dtype=dtype)
        )
        cos_sin_cache = build_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, dtype
        )
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self.packed: dict[str, torch.Tensor] = {}

    def pack_weights(self) -> bool:
        """Pre-pack every projection and the lm head into oneDNN's layout (:func:`~spindle.kernels.linear.pack_weight`).

        Only for bf16 weights on the CPU; returns whether it packed. The plain copies of the projections are
        released (they would double the weights' memory), so load weights before packing; the embedding table
        stays, and a tied lm head gets its own packed copy.
        """
        if not can_pack(self.embed_tokens):
            return False
        projections = [(layer.self_attn, ("qkv_proj", "o_proj")) for layer in self.layers]
        projections += [(layer, ("gate_up_proj", "down_proj")) for layer in self.layers]
        for module, names in projections:
            for name in names:
                weight = getattr(module, name)
                module.packed[name] = pack_weight(weight)
                weight.data = torch.empty(0, dtype=weight.dtype)
        self.packed["lm_head"] = pack_weight(self.embed_tokens if self.lm_head is None else self.lm_head)
        if self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Run the flat batch through the decoder, writing the new tokens' K/V into ``kv_caches``.

        Args:
            input_ids: ``[T]`` int64, the new tokens of every sequence, laid out as ``meta`` says.
            positions: ``[T]`` int64, the absolute position of each token in its sequence.
            meta: the batch layout and cache slots.
            kv_caches: one ``(k_cache, v_cache)`` per layer.

        Returns:
            The final-norm hidden states ``[T, hidden_size]``; pass the rows to sample to :meth:`compute_logits`.

        """
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        with attention_metadata(meta):
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, self.cos_sin_cache)
        hidden, _ = rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states ``[N, hidden_size]`` to float32 logits ``[N, vocab_size]``."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head, packed=self.packed.get("lm_head")).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters, stacking q/k/v and gate/up.

        Args:
            weights: ``(name, tensor)`` pairs, e.g. from the safetensors shards; any dtype or device.

        Raises:
            ValueError: on a name the model does not know, or when a parameter is left unloaded.

        """
        params = dict(self.named_parameters())
        config = self.config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        intermediate = config.intermediate_size
        # HF name part -> (our name part, offset, rows) of a slice of a fused parameter.
        fused = {
            "self_attn.q_proj.weight": ("self_attn.qkv_proj", 0, q_size),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj", q_size, kv_size),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj", q_size + kv_size, kv_size),
            "self_attn.q_proj.bias": ("self_attn.qkv_bias", 0, q_size),
            "self_attn.k_proj.bias": ("self_attn.qkv_bias", q_size, kv_size),
            "self_attn.v_proj.bias": ("self_attn.qkv_bias", q_size + kv_size, kv_size),
            "mlp.gate_proj.weight": ("gate_up_proj", 0, intermediate),
            "mlp.up_proj.weight": ("gate_up_proj", intermediate, intermediate),
        }
        renamed = {
            "self_attn.o_proj.weight": "self_attn.o_proj",
            "mlp.down_proj.weight": "down_proj",
            "input_layernorm.weight": "input_layernorm",
            "post_attention_layernorm.weight": "post_attention_layernorm",
            "model.embed_tokens.weight": "embed_tokens",
            "model.norm.weight": "norm",
            "lm_head.weight": "lm_head",
        }
        loaded: dict[str, int] = {}
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and self.lm_head is None):
                continue
            prefix, layer_part = _split_layer_name(hf_name)
            if layer_part in fused:
                part, offset, rows = fused[layer_part]
                name = prefix + part
                target = params[name].data[offset : offset + rows] if name in params else None
            else:
                name = prefix + renamed.get(layer_part, layer_part)
                target = params[name].data if name in params else None
            if target is None or target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name} {tuple(tensor.shape)} does not fit this model")
            target.copy_(tensor)
            loaded[name] = loaded.get(name, 0) + tensor.shape[0]
        missing = [name for name, p in params.items() if loaded.get(name, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"the checkpoint left these parameters unloaded (or part loaded): {missing}")


def _split_layer_name(hf_name: str) -> tuple[str, str]:
    """``model.layers.3.mlp.up_proj.weight`` -> ``("layers.3.", "mlp.up_proj.weight")``; others -> ``("", name)``."""
    if hf_name.startswith("model.layers."):
        index, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        return f"layers.{index}.", rest
    return "", hf_name
