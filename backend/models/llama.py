"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, with fused qkv and gate/up projections."""

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from spindle.backend import parallel
from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard
from spindle.kernels import (
    AttentionMetadata,
    add_lora,
    attend,
    attention_metadata,
    build_cos_sin_cache,
    cpu,
    huge_pages,
    is_eager,
    is_forced_triton,
    rms_norm,
    silu_and_mul,
)
from spindle.kernels.linear import Projection, linear, quantized_embedding
from spindle.kernels.lora import LoraSlots, current_lora_mapping
from spindle.kernels.quant import QuantizedWeight

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One layer's ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``."""


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Left uninitialised: every weight comes from a checkpoint through load_weights.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _with_lora(y: torch.Tensor, x: torch.Tensor, lora: LoraSlots | None) -> torch.Tensor:
    """``y``, the projection of ``x``, plus the step's LoRA deltas in place (none without slots or adapters)."""
    if lora is not None:
        mapping = current_lora_mapping()
        if mapping is not None:
            add_lora(y, x, lora, mapping)
    return y


EMBEDDING_TABLE = "embed_tokens"
"""The key of :meth:`LlamaForCausalLM.prepare_weights`' ``quantized`` under which an untied embedding table's
quantized form goes (a GGUF file's ``token_embd`` blocks), looked up row by row instead of a dense table."""


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, rotary, cache write, paged attention, output projection.

    Under tensor parallelism it holds its rank's query and KV heads (``shard``); the output projection is
    row-parallel: each rank's partial sum is all-reduced. ``sliding_window`` is its layer's window
    (:attr:`CheckpointConfig.layer_windows`), None to attend to the whole context.
    """

    def __init__(
        self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = shard.num_heads * config.head_dim
        self.kv_size = shard.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = _weight(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype)
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size, dtype=dtype) if config.qkv_bias else None
        self.o_proj = _weight(config.hidden_size, self.q_size, dtype=dtype)
        self.prepared: dict[str, Projection] = {}
        # LoRA adapter slots by projection, set by spindle.backend.lora_manager once an adapter is loaded.
        self.lora: dict[str, LoraSlots] = {}

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attend the flat batch ``hidden [T, hidden_size]`` over the cache; returns ``[T, hidden_size]``."""
        num_tokens = hidden.shape[0]
        qkv = linear(hidden, self.qkv_proj, self.qkv_bias, self.prepared.get("qkv_proj"))
        qkv = _with_lora(qkv, hidden, self.lora.get("qkv_proj"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attend_heads(
            positions,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            kv_cache,
            cos_sin_cache,
        )
        out = out.view(num_tokens, self.q_size)
        out = _with_lora(linear(out, self.o_proj, prepared=self.prepared.get("o_proj")), out, self.lora.get("o_proj"))
        return parallel.all_reduce(out)

    def attend_heads(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate, cache and attend the projected heads ``[T, heads, head_dim]``.

        A family that treats its q/k heads otherwise (norms, partial rotary) overrides this.
        """
        return attend(q, k, v, *kv_cache, self.scale, positions, cos_sin_cache, self.sliding_window)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP blocks, with the residual adds fused into the norms.

    Under tensor parallelism the MLP holds its rank's intermediate columns (``shard``): gate/up column-parallel,
    down row-parallel with an all-reduce. ``sliding_window`` is the layer's attention window (None: the whole context).
    """

    attention_cls: type[LlamaAttention] = LlamaAttention
    """The attention block; a family with other q/k treatment names its subclass here."""
    act_and_mul: Callable[[torch.Tensor], torch.Tensor] = staticmethod(silu_and_mul)
    """The MLP's gated activation on the fused gate/up rows (SwiGLU); Gemma's GeGLU names its own."""

    def __init__(
        self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.input_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.self_attn = self.attention_cls(config, shard, dtype, sliding_window)
        self.post_attention_layernorm = _weight(config.hidden_size, dtype=dtype)
        self.prepared: dict[str, Projection] = {}
        self.lora: dict[str, LoraSlots] = {}
        self.build_mlp(config, shard, dtype)

    def build_mlp(self, config: CheckpointConfig, shard: Shard, dtype: torch.dtype) -> None:
        """The MLP's weights: fused gate/up rows and the down projection (this rank's intermediate columns)."""
        self.gate_up_proj = _weight(2 * shard.intermediate_size, config.hidden_size, dtype=dtype)
        self.down_proj = _weight(config.hidden_size, shard.intermediate_size, dtype=dtype)

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
        hidden, residual = rms_norm(hidden, self.post_attention_layernorm, self.eps, residual)
        return self.mlp(hidden), residual

    def attention_block(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (with the previous layer's residual add fused in) and attention: ``(output, residual)``."""
        if residual is None:
            residual = hidden
            hidden = rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = rms_norm(hidden, self.input_layernorm, self.eps, residual)
        return self.self_attn(positions, hidden, kv_cache, cos_sin_cache), residual

    def stack_forms(self) -> dict[str, object] | None:
        """The layer's projections as the C++ ``DecodeStack`` runs them, or None where it cannot run the layer.

        It runs the plain Llama layer (a family's subclass has maths of its own) whose projections all run a kernel
        it calls (:func:`stack_projection`).
        """
        if type(self) is not LlamaDecoderLayer:
            return None
        return self._stack_forms({"gate_up": self.prepared.get("gate_up_proj"), "down": self.prepared.get("down_proj")})

    def _stack_forms(self, mlp: dict[str, object]) -> dict[str, object] | None:
        """The stack's forms of the attention's projections and of ``mlp``'s, None if one has none."""
        attn = self.self_attn
        if type(attn) is not LlamaAttention:
            return None
        projections = {"qkv": attn.prepared.get("qkv_proj"), "o": attn.prepared.get("o_proj"), **mlp}
        forms = {name: stack_projection(projection) for name, projection in projections.items()}
        return None if any(form is None for form in forms.values()) else forms

    def add_to_stack(self, stack: object, forms: dict[str, object], kv_cache: KVCache) -> None:
        """Append this layer, its :meth:`stack_forms`, to ``stack``, over its ``kv_cache``."""
        self.add_attention_to_stack(stack, forms, kv_cache)
        stack.add_dense_mlp(forms["gate_up"], forms["down"])

    def add_attention_to_stack(self, stack: object, forms: dict[str, object], kv_cache: KVCache) -> None:
        """Append this layer's norms and attention to ``stack``; its MLP follows."""
        stack.add_attention(
            self.input_layernorm,
            self.post_attention_layernorm,
            forms["qkv"],
            forms["o"],
            *kv_cache,
            self.self_attn.sliding_window or 0,
        )

    def mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        """The gated MLP of the normalised ``hidden [T, hidden_size]``: gate/up, :attr:`act_and_mul`, down."""
        gate_up = linear(hidden, self.gate_up_proj, prepared=self.prepared.get("gate_up_proj"))
        gate_up = _with_lora(gate_up, hidden, self.lora.get("gate_up_proj"))
        act = self.act_and_mul(gate_up)
        hidden = _with_lora(
            linear(act, self.down_proj, prepared=self.prepared.get("down_proj")), act, self.lora.get("down_proj")
        )
        return parallel.all_reduce(hidden)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM that reads and writes a paged KV cache.

    Parameters are created uninitialised on the current default device (build it under ``with torch.device(...)``)
    and filled by :meth:`load_weights`. Their names are the Hugging Face ones, except that each layer's q/k/v
    projections are stacked into ``self_attn.qkv_proj`` (bias ``self_attn.qkv_bias``) and its gate/up projections
    into ``gate_up_proj``. The model runner calls :meth:`prepare_weights` after loading; every ``prepared`` dict then
    holds the :class:`~spindle.kernels.linear.Projection` (oneDNN-packed, quantized) that the forward runs instead of
    the plain weight.

    Under tensor parallelism (:func:`spindle.backend.parallel.current`, read when the model is built) each rank
    holds its :class:`~spindle.backend.models.checkpoint_config.Shard`: :meth:`shard_range` says which part of each
    checkpoint tensor, and the parameters have the shard's shapes. The embedding and the LM head hold the rank's rows
    of the vocabulary padded to a multiple of the ranks.
    """

    supports_tensor_parallel = True
    """This class shards itself over the ranks (a registered class may not)."""
    supports_images = False
    """It takes text only."""
    is_pooling_model = False
    """It has an LM head: it generates."""
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    """The decoder layer class, built with each layer's window; a family whose layers differ names its own."""

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        place = parallel.current()
        self.shard = Shard.of(config, place.rank, place.size)
        vocab = self.shard.vocab_size
        self.embed_tokens = _weight(vocab, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            self.layer_cls(config, self.shard, dtype, window) for window in config.layer_windows
        )
        self.norm = _weight(config.hidden_size, dtype=dtype)
        self.lm_head = None if config.tie_word_embeddings else _weight(vocab, config.hidden_size, dtype=dtype)
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        cos_sin_cache = build_cos_sin_cache(
            rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, dtype
        )
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self.prepared: dict[str, Projection] = {}
        self.embed_quantized: QuantizedWeight | None = None
        # The decode step's C++ layers (_decode_stack), the layers' forms in them (empty where it cannot run them;
        # None until asked) and the caches they hold.
        self._stack: object | None = None
        self._layer_forms: list[dict[str, object]] | None = None
        self._stack_caches: list[KVCache] | None = None
        # Every layer's LoRA slots (dicts that the LoRA manager fills in place): checked each decode step, where a
        # walk over the modules after a forward has emptied the caches took ~90 us.
        self._lora_slots = [slots for layer in self.layers for slots in (layer.lora, layer.self_attn.lora)]

    def projections(self) -> dict[str, tuple[nn.Module, str]]:
        """Every projection by name (``layers.3.self_attn.qkv_proj``, ``lm_head``): ``(module, attribute)``.

        The lm head of a model with tied embeddings is ``(self, "embed_tokens")``.
        """
        found: dict[str, tuple[nn.Module, str]] = {}
        for i, layer in enumerate(self.layers):
            for module, prefix, names in [
                (layer.self_attn, f"layers.{i}.self_attn.", ("qkv_proj", "o_proj")),
                (layer, f"layers.{i}.", ("gate_up_proj", "down_proj")),
            ]:
                found.update({prefix + name: (module, name) for name in names})
        found["lm_head"] = (self, "embed_tokens" if self.lm_head is None else "lm_head")
        return found

    def prepare_weights(self, quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Give every projection its :class:`~spindle.kernels.linear.Projection`, built from the loaded weights.

        Plain weights that the projection no longer reads are released (a packed or quantized-only copy stands in
        for them), so load weights before preparing. The embedding table stays, unless it is a tied LM head given a
        quantized form, or an untied table given one under :data:`EMBEDDING_TABLE`: then lookups gather and
        dequantize its quantized rows (``embed_quantized``).

        Args:
            quantized: weight-only quantized forms by :meth:`projections` name (all, some or none of them), and an
                untied embedding table's under :data:`EMBEDDING_TABLE`.

        """
        quantized = quantized or {}
        table = quantized.get(EMBEDDING_TABLE)
        if table is not None and self.lm_head is not None:
            self.embed_quantized = table
            self.embed_tokens.data = torch.empty(0, dtype=self.embed_tokens.dtype, device=self.embed_tokens.device)
        built: list[Projection] = []
        for name, (module, attr) in self.projections().items():
            weight = getattr(module, attr)
            form = quantized.get(name)
            # On CUDA the Triton kernel wins at every batch size: no dense copy beside the quantized one.
            dense = None if form is not None and weight.is_cuda else weight.data
            bias = getattr(module, "qkv_bias", None) if attr == "qkv_proj" else None
            projection = Projection(dense, bias, form)
            target = self if name == "lm_head" else module
            target.prepared[name.rsplit(".", 1)[-1]] = projection
            built.append(projection)
            if attr == "embed_tokens" and form is not None:
                self.embed_quantized = form
            if projection.dense is None and (attr != "embed_tokens" or form is not None):
                weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        # In the order a decode step reads them: one stream of weights on huge pages (spindle.kernels.huge_pages).
        huge_pages.gather(built)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the flat batch through the decoder, writing the new tokens' K/V into ``kv_caches``.

        Args:
            input_ids: ``[T]`` int64, the new tokens of every sequence, laid out as ``meta`` says.
            positions: ``[T]`` int64, the absolute position of each token in its sequence.
            meta: the batch layout and cache slots.
            kv_caches: one ``(k_cache, v_cache)`` per layer.
            image_rows: ``[R]`` int64, rows of the flat batch whose token embedding is replaced (a vision-language
                model's image placeholders), or None.
            image_embeds: ``[R, hidden_size]``, the embeddings that go into those rows (cast to the model dtype).

        Returns:
            The final-norm hidden states ``[T, hidden_size]``; pass the rows to sample to :meth:`compute_logits`.

        """
        hidden = self._embed(input_ids)
        if image_rows is not None:  # the one test a text-only step pays
            hidden[image_rows] = image_embeds.to(hidden.dtype)
        residual = None
        stack = self._decode_stack(kv_caches) if meta.num_decodes == len(meta.query_lens_list) else None
        if stack is not None:
            hidden, residual = stack.run(hidden, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        else:
            with attention_metadata(meta):
                for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                    hidden, residual = layer(positions, hidden, residual, kv_cache, self.cos_sin_cache)
        hidden, _ = rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def _decode_stack(self, kv_caches: list[KVCache]) -> object | None:
        """The C++ ``DecodeStack`` that runs a decode step's layers in one call, or None where the layers run it.

        ``kernels/cpu/decode_stack.cpp`` calls the same ops in the same order as the layers' forward, without the
        Python between them. It runs where every layer can be stacked (:meth:`LlamaDecoderLayer.stack_forms`: the
        plain Llama layer, or Mixtral's, whose projections run a kernel :func:`stack_projection` takes), on one rank,
        with our ops (not within ``eager`` or ``force_triton``) and no LoRA adapter loaded. Built on the first such
        step, and again for new caches.
        """
        if is_eager() or is_forced_triton() or any(self._lora_slots):
            return None
        if self._stack is not None and self._stack_caches is kv_caches:
            return self._stack
        if self._layer_forms is None:  # the prepared weights do not change: asked once
            forms = [layer.stack_forms() for layer in self.layers] if self.shard.size == 1 else [None]
            self._layer_forms = forms if all(form is not None for form in forms) else []
        if not self._layer_forms:
            return None
        first = self.layers[0].self_attn
        stack = cpu.cpu_ops().DecodeStack(
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            first.scale,
            self.config.rms_norm_eps,
            self.cos_sin_cache,
        )
        for layer, forms, kv_cache in zip(self.layers, self._layer_forms, kv_caches, strict=True):
            layer.add_to_stack(stack, forms, kv_cache)
        self._stack, self._stack_caches = stack, kv_caches
        return stack

    def input_embeds(self, embeds: torch.Tensor) -> torch.Tensor:
        """A prompt's own embeddings (``prompt_embeds``) as they replace token embeddings: as given, in the model dtype.

        A family that scales its token embeddings scales these too, as transformers does ``inputs_embeds``.
        """
        return embeds.to(self.embed_tokens.dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``.

        Over several ranks each looks up the tokens of its vocabulary rows, zeros the others, and the ranks' results
        are summed.
        """
        if self.shard.size == 1:
            return self._rows(input_ids)
        start = self.shard.rank * self.shard.vocab_size
        local = input_ids - start
        outside = (local < 0) | (local >= self.shard.vocab_size)
        hidden = self._rows(local.masked_fill(outside, 0))
        return parallel.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's embedding table, from its quantized form where only that is kept."""
        if self.embed_quantized is None:
            return F.embedding(ids, self.embed_tokens)
        return quantized_embedding(ids, self.embed_quantized, self.embed_tokens.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Project hidden states ``[N, hidden_size]`` to float32 logits ``[N, vocab_size]``.

        Over several ranks every rank must call it with the same rows: each computes its vocabulary shard, and
        rank 0 gets the whole logits; the other ranks get None.
        """
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = parallel.gather_columns(linear(hidden, head, prepared=self.prepared.get("lm_head")).float())
        if logits is None or self.shard.size == 1:
            return logits
        return logits[:, : self.config.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the parameters, stacking q/k/v and gate/up.

        Args:
            weights: ``(name, tensor)`` pairs, e.g. from the safetensors shards; any dtype or device.

        Raises:
            ValueError: on a name the model does not know, or when a parameter is left unloaded.

        """
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq") or (hf_name == "lm_head.weight" and self.lm_head is None):
                continue
            full_shape = tuple(tensor.shape)
            spec = self.shard_range(hf_name)
            if spec is not None:
                dim, start, length = spec
                tensor = tensor.narrow(dim, start, max(0, min(length, tensor.shape[dim] - start)))
            name, offset, rows = self.parameter_slice(hf_name)
            end = None if rows is None else offset + rows
            target = params[name].data[offset:end] if name in params else None
            if target is not None and name in ("embed_tokens", "lm_head") and self.shard.size > 1:
                # The last shard of a vocabulary that does not divide by the ranks ends in padding rows: zeros.
                target[tensor.shape[0] :].zero_()
                target = target[: tensor.shape[0]]
                loaded[name] = loaded.get(name, 0) + len(params[name]) - tensor.shape[0]
            if target is None or target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name} {full_shape} does not fit this model")
            target.copy_(tensor)
            loaded[name] = loaded.get(name, 0) + tensor.shape[0]
        missing = [name for name, p in params.items() if loaded.get(name, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"the checkpoint left these parameters unloaded (or part loaded): {missing}")

    def shard_range(self, hf_name: str) -> tuple[int, int, int] | None:
        """The part of the full checkpoint tensor ``hf_name`` this rank holds: ``(dim, start, length)``, None for all.

        Always None with one rank. A vocabulary range may run past the tensor's end: the rest is padding.
        """
        return _shard_range(hf_name, self.config, self.shard)

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """Where a Hugging Face tensor goes: ``(parameter name, first row, rows)``, rows None for the whole parameter.

        ``model.layers.3.self_attn.k_proj.weight`` -> ``("layers.3.self_attn.qkv_proj", q_size, kv_size)``. A name
        the model does not know comes back as it is (the caller finds no such parameter). Under tensor parallelism
        the offsets and rows are those of this rank's shard (the tensor cut by :meth:`shard_range`).
        """
        shard, head_dim = self.shard, self.config.head_dim
        q_size, kv_size = shard.num_heads * head_dim, shard.num_kv_heads * head_dim
        intermediate = shard.intermediate_size
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
        prefix, layer_part = _split_layer_name(hf_name)
        if layer_part in fused:
            part, offset, rows = fused[layer_part]
            return prefix + part, offset, rows
        return prefix + renamed.get(layer_part, layer_part), 0, None


class LlamaModel(LlamaForCausalLM):
    """A Llama-family decoder without an LM head, as Hugging Face's ``LlamaModel`` saves it: an embedding model.

    Its checkpoint names lack the ``model.`` prefix (``layers.0.self_attn.q_proj.weight``, ``norm.weight``); both
    spellings load. It serves embedding requests only: the engine core refuses generation on it.
    """

    is_pooling_model = True
    """No LM head, so no logits and no sampling: it serves embedding requests only."""

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        # Tied, the parent creates no lm_head parameter; there is no head at all.
        super().__init__(dataclasses.replace(config, tie_word_embeddings=True), dtype)

    def projections(self) -> dict[str, tuple[nn.Module, str]]:
        """Every projection by name, as :meth:`LlamaForCausalLM.projections`, without the LM head."""
        found = super().projections()
        del found["lm_head"]
        return found

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Refuse: an embedding model has no LM head (the engine core never asks it for logits)."""
        raise RuntimeError("an embedding model (LlamaModel) has no LM head: it computes no logits")

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """As :meth:`LlamaForCausalLM.parameter_slice`, for names with or without the ``model.`` prefix."""
        return super().parameter_slice(hf_name if hf_name.startswith("model.") else "model." + hf_name)

    def shard_range(self, hf_name: str) -> tuple[int, int, int] | None:
        """As :meth:`LlamaForCausalLM.shard_range`, for names with or without the ``model.`` prefix."""
        return super().shard_range(hf_name if hf_name.startswith("model.") else "model." + hf_name)


def _shard_range(hf_name: str, config: CheckpointConfig, shard: Shard) -> tuple[int, int, int] | None:
    """The part of a full checkpoint tensor that ``shard`` holds: ``(dim, start, length)``, None for all of it.

    Column-parallel projections (q/k/v, gate/up, with their biases) and the vocabulary take output rows (dim 0), the
    row-parallel ones (o, down) input columns (dim 1). A vocabulary range may run past the tensor's end (padding).
    """
    if shard.size == 1:
        return None
    head_dim = config.head_dim
    _, part = _split_layer_name(hf_name)
    part = part.removeprefix("model.")
    q_rows = (0, shard.rank * shard.num_heads * head_dim, shard.num_heads * head_dim)
    kv_rows = (0, shard.first_kv_head * head_dim, shard.num_kv_heads * head_dim)
    mlp_rows = (0, shard.rank * shard.intermediate_size, shard.intermediate_size)
    ranges = {
        "self_attn.q_proj": q_rows,
        "self_attn.k_proj": kv_rows,
        "self_attn.v_proj": kv_rows,
        "self_attn.o_proj": (1, *q_rows[1:]),
        "mlp.gate_proj": mlp_rows,
        "mlp.up_proj": mlp_rows,
        "mlp.down_proj": (1, *mlp_rows[1:]),
        "embed_tokens": (0, shard.rank * shard.vocab_size, shard.vocab_size),
        "lm_head": (0, shard.rank * shard.vocab_size, shard.vocab_size),
    }
    return ranges.get(part.rsplit(".", 1)[0])


def _split_layer_name(hf_name: str) -> tuple[str, str]:
    """``model.layers.3.mlp.up_proj.weight`` -> ``("layers.3.", "mlp.up_proj.weight")``; others -> ``("", name)``."""
    if hf_name.startswith("model.layers."):
        index, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        return f"layers.{index}.", rest
    return "", hf_name


def stack_projection(projection: object) -> object | None:
    """``projection`` as the C++ ``DecodeStack`` runs it, the kernel :class:`Projection` runs.

    ``a8_linear``'s parts, ``bf16_linear``'s tiles, or a dense weight (oneDNN's packed copy, or the plain one
    ``F.linear`` takes). None where it runs another kernel (W8A8, the weight-only quantized ones), or is missing or
    not a :class:`Projection` (a test's stand-in runs itself).
    """
    if not isinstance(projection, Projection) or projection.w8a8 is not None:
        return None
    ops = cpu.cpu_ops()
    if projection.a8_parts is not None:
        parts = [(*packed, group_size, outputs) for packed, outputs, group_size in projection.a8_parts]
        return ops.StackProjection.a8(parts, projection.bias)
    if projection.quantized is not None:
        return None
    if projection.tiled is not None:
        return ops.StackProjection.bf16(projection.tiled, projection.out_features, projection.bias)
    weight, onednn = (projection.packed, True) if projection.packed is not None else (projection.dense, False)
    return ops.StackProjection.dense(weight, onednn, projection.out_features, projection.bias)
