"""LLaVA (transformers' ``LlavaForConditionalGeneration``): CLIP vision tower, projector, Llama-family decoder.

An image becomes ``num_image_tokens`` embeddings (:meth:`LlavaForConditionalGeneration.embed_images`); the prompt
holds as many placeholder tokens (``image_token_id``) where the image goes, and the step that computes those
placeholders passes their rows of the flat batch and the embeddings to :meth:`LlavaForConditionalGeneration.forward`,
which puts them in place of the placeholders' token embeddings. Everything after that is the plain decoder
(:class:`~spindle.backend.models.llama.LlamaForCausalLM`) over the paged KV cache, with its quantization, packing
and CUDA graphs; the vision tower and the projector run unquantized in the model dtype.
"""

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from spindle.backend.models.checkpoint_config import TEXT_ARCHITECTURES, CheckpointConfig
from spindle.backend.models.clip import ClipVisionTower, Linear, activation
from spindle.backend.models.llama import KVCache, LlamaForCausalLM
from spindle.kernels import AttentionMetadata
from spindle.kernels.quant import QuantizedWeight

SELECT_STRATEGIES = ("default", "full")
"""``vision_feature_select_strategy`` values: ``default`` drops the class token's row, ``full`` keeps it."""

_PARTS = ("vision_tower", "multi_modal_projector", "language_model")

_LLAVA_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
"""transformers' ``LlavaConfig`` vision tower when a config has no ``vision_config``: CLIP ViT-L/14-336."""

_PROJECTOR_PARAMETERS = ("linear_1.weight", "linear_1.bias", "linear_2.weight", "linear_2.bias")


class LlavaMultiModalProjector(nn.Module):
    """The two-layer MLP from the vision features to the decoder's embedding space: linear, activation, linear.

    Args:
        in_features: the vision hidden size times the number of feature layers (their states are concatenated).
        hidden_size: the decoder's hidden size.
        act: transformers' name of the activation (``projector_hidden_act``).
        bias: whether the linear layers have biases (``multimodal_projector_bias``).
        dtype: the parameters' dtype.

    """

    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, hidden_size, dtype, bias)
        self.act = activation(act)
        self.linear_2 = Linear(hidden_size, hidden_size, dtype, bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Vision features ``[..., in_features]`` to decoder embeddings ``[..., hidden_size]``."""
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(nn.Module):
    """A LLaVA model: :class:`~spindle.backend.models.clip.ClipVisionTower`, projector, Llama-family decoder.

    Built as every model class is (``cls(config, dtype)`` under ``with torch.device(...)``, then
    :meth:`load_weights`, ``eval()``, :meth:`prepare_weights`). ``config`` holds the decoder's fields (read from the
    checkpoint's ``text_config``, ``CheckpointConfig.from_dict``); the vision fields are read from
    ``config.hf_config``. The decoder is ``language_model``, a
    :class:`~spindle.backend.models.llama.LlamaForCausalLM`: :meth:`projections`, :meth:`prepare_weights` and
    :meth:`compute_logits` are its, so ``--quantization`` and the packed CPU projections apply to it alone.

    Attributes:
        supports_images: the model takes images (:meth:`embed_images`).
        image_shape: ``(channels, image_size, image_size)``, the pixel values :meth:`embed_images` takes per image.
        num_image_tokens: embeddings per image: one per patch, plus the class token's under the ``full`` strategy;
            a prompt holds this many ``image_token_id`` placeholders per image.
        image_token_id: the placeholder token (``image_token_index`` of the config).

    Raises:
        ValueError: for a decoder other than Llama, Mistral or Qwen2, a vision tower other than CLIP's, an unknown
            ``vision_feature_select_strategy`` or activation, or a feature layer outside the vision tower.

    """

    supports_images = True
    is_pooling_model = False
    supports_tensor_parallel = False
    """The vision tower and the projector are not sharded, so neither is the model."""

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hf = config.hf_config
        text_type = hf.get("text_config", {}).get("model_type", "llama")
        if text_type not in TEXT_ARCHITECTURES:
            raise ValueError(
                f"this LLaVA's decoder is a {text_type!r} model; Spindle's LLaVA runs {', '.join(TEXT_ARCHITECTURES)}"
            )
        self.config = config
        self.dtype = dtype
        self.strategy: str = hf.get("vision_feature_select_strategy", "default")
        if self.strategy not in SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not one of {SELECT_STRATEGIES}")
        layer = hf.get("vision_feature_layer", -2)
        # An int selects one hidden state; a list concatenates several along the features, as transformers does.
        self.concatenates = isinstance(layer, list)
        layers = layer if self.concatenates else [layer]
        # LLaVA's default vision config (CLIP ViT-L/14 at 336 pixels) when the checkpoint has none, as transformers.
        vision_config = hf.get("vision_config") or _LLAVA_VISION_DEFAULTS
        vision_type = vision_config.get("model_type", "clip_vision_model")
        if vision_type != "clip_vision_model":  # SigLIP and others lay out their embeddings differently
            raise ValueError(f"this LLaVA's vision tower is a {vision_type!r} model; Spindle's LLaVA runs CLIP's")
        self.vision_tower = ClipVisionTower(vision_config, layers, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            self.vision_tower.config["hidden_size"] * len(layers),
            config.hidden_size,
            hf.get("projector_hidden_act", "gelu"),
            hf.get("multimodal_projector_bias", True),
            dtype,
        )
        self.language_model = LlamaForCausalLM(config, dtype)
        tower = self.vision_tower
        self.image_shape: tuple[int, int, int] = (tower.num_channels, tower.image_size, tower.image_size)
        self.num_image_tokens: int = tower.num_patches + (self.strategy == "full")
        self.image_token_id: int = hf.get("image_token_index", hf.get("image_token_id", 32000))

    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images to the embeddings that replace their placeholders: what transformers' ``get_image_features`` gives.

        Args:
            pixel_values: ``[N, C, H, W]`` as the image processor makes them (any float dtype; cast to the model's),
                ``(C, H, W)`` being :attr:`image_shape`.

        Returns:
            ``[N, num_image_tokens, hidden_size]`` in the model dtype, on the model's device.

        Raises:
            ValueError: when the images are not of :attr:`image_shape`.

        """
        pixel_values = pixel_values.to(device=self.vision_tower.class_embedding.device, dtype=self.dtype)
        states = self.vision_tower(pixel_values)
        if self.strategy == "default":
            states = [state[:, 1:] for state in states]
        features = torch.cat(states, dim=-1) if self.concatenates else states[0]
        return self.multi_modal_projector(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        image_rows: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's forward, with the token embeddings at ``image_rows`` replaced by ``image_embeds``.

        Args:
            input_ids: ``[T]`` int64, the new tokens of every sequence, laid out as ``meta`` says; image
                placeholders are ``image_token_id``.
            positions: ``[T]`` int64, the absolute position of each token in its sequence.
            meta: the batch layout and cache slots.
            kv_caches: one ``(k_cache, v_cache)`` per decoder layer.
            image_rows: ``[R]`` int64, the rows of this step's placeholders, or None when it has none.
            image_embeds: ``[R, hidden_size]``, the rows of :meth:`embed_images`' output that go there (a chunk that
                ends inside an image takes the rows of its part of it).

        Returns:
            The final-norm hidden states ``[T, hidden_size]``; pass the rows to sample to :meth:`compute_logits`.

        """
        return self.language_model(
            input_ids, positions, meta, kv_caches, image_rows=image_rows, image_embeds=image_embeds
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The decoder's ``LlamaForCausalLM.compute_logits``."""
        return self.language_model.compute_logits(hidden)

    def projections(self) -> dict[str, tuple[nn.Module, str]]:
        """The decoder's projections (``layers.3.self_attn.qkv_proj``, ``lm_head``), which ``--quantization`` takes."""
        return self.language_model.projections()

    def prepare_weights(self, quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Prepare the decoder's projections (``LlamaForCausalLM.prepare_weights``); the vision side stays plain.

        Args:
            quantized: weight-only quantized forms by :meth:`projections` name, or None.

        """
        self.language_model.prepare_weights(quantized)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from the checkpoint's ``(name, tensor)`` pairs.

        The names may be spelt as transformers 5 saves them (``vision_tower.encoder.layers.0...``,
        ``language_model.model.layers.0...``, ``language_model.lm_head.weight``), as llava-hf checkpoints do
        (``vision_tower.vision_model.encoder...``), or as transformers names them in memory
        (``model.vision_tower...``, ``model.language_model.layers...``, ``model.multi_modal_projector...``,
        ``lm_head.weight``). Tensors of the vision layers never run (:class:`ClipVisionTower`) are skipped.

        Raises:
            ValueError: on a name the model does not know, a tensor of the wrong shape, or when a parameter is left
                unloaded.

        """
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}

        def decoder_weights() -> Iterator[tuple[str, torch.Tensor]]:
            # One pass over the checkpoint: the decoder's tensors stream on to its own loader, the rest load here.
            for hf_name, tensor in weights:
                part, name = _split_name(hf_name)
                if part == "language_model":
                    yield name, tensor
                    continue
                target = self._vision_slice(part, name)
                if target is None:
                    continue
                param_name, offset, rows = target
                end = None if rows is None else offset + rows
                param = params.get(param_name)  # None for a bias the config says the projector lacks
                if param is None or param.data[offset:end].shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {hf_name} {tuple(tensor.shape)} does not fit this model")
                param.data[offset:end].copy_(tensor)
                loaded[param_name] = loaded.get(param_name, 0) + tensor.shape[0]

        self.language_model.load_weights(decoder_weights())
        missing = [
            name
            for name, param in params.items()
            if not name.startswith("language_model.") and loaded.get(name, 0) != param.shape[0]
        ]
        if missing:
            raise ValueError(f"the checkpoint left these parameters unloaded (or part loaded): {missing}")

    def _vision_slice(self, part: str | None, name: str) -> tuple[str, int, int | None] | None:
        """Our parameter, first row and rows for a vision tower or projector tensor; None to skip it.

        Raises:
            ValueError: for a name that is neither the decoder's, the vision tower's nor the projector's.

        """
        if part == "vision_tower":
            target = self.vision_tower.checkpoint_slice(name)
            return None if target is None else (f"vision_tower.{target[0]}", *target[1:])
        if part == "multi_modal_projector" and name in _PROJECTOR_PARAMETERS:
            return f"multi_modal_projector.{name}", 0, None
        raise ValueError(f"checkpoint tensor {name} is no part of a LLaVA model")

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """Where a checkpoint tensor goes: ``(name, first row, rows)``, as ``LlamaForCausalLM.parameter_slice``.

        A decoder tensor (any spelling of :meth:`load_weights`) maps to the decoder's projection or parameter name
        (``language_model.model.layers.0.self_attn.k_proj.weight`` -> ``("layers.0.self_attn.qkv_proj", q_size,
        kv_size)``), so quantized stored weights and LoRA adapters find the decoder's projections; a vision tensor
        maps to our parameter under ``vision_tower.`` / ``multi_modal_projector.``.
        """
        part, name = _split_name(hf_name)
        if part == "language_model":
            return self.language_model.parameter_slice(name)
        try:
            return self._vision_slice(part, name) or (hf_name, 0, None)
        except ValueError:
            return hf_name, 0, None  # unknown: as the decoder's, the name comes back as it is

    def shard_range(self, hf_name: str) -> tuple[int, int, int] | None:
        """The decoder's ``LlamaForCausalLM.shard_range`` for its tensors, None (all) for the vision side.

        Only called under tensor parallelism, which this class refuses (``supports_tensor_parallel = False``).
        """
        part, name = _split_name(hf_name)
        return self.language_model.shard_range(name) if part == "language_model" else None


def _split_name(hf_name: str) -> tuple[str | None, str]:
    """A checkpoint name to ``(part, name within it)``; the decoder's names become its Hugging Face Llama names.

    ``language_model.model.layers.0.mlp.up_proj.weight`` and ``model.language_model.layers.0.mlp.up_proj.weight``
    -> ``("language_model", "model.layers.0.mlp.up_proj.weight")``; ``language_model.lm_head.weight`` and
    ``lm_head.weight`` -> ``("language_model", "lm_head.weight")``; ``vision_tower.vision_model.pre_layrnorm.bias``
    and ``model.vision_tower.pre_layrnorm.bias`` -> ``("vision_tower", "pre_layrnorm.bias")``;
    ``multi_modal_projector.linear_1.weight`` -> ``("multi_modal_projector", "linear_1.weight")``. Anything else
    -> ``(None, hf_name)``.
    """
    if hf_name == "lm_head.weight":
        return "language_model", hf_name
    name = hf_name
    if name.startswith("model.") and name.split(".", 2)[1] in _PARTS:
        name = name.removeprefix("model.")
    part, _, rest = name.partition(".")
    if part == "language_model":
        # Saved by transformers 4 or 5, the decoder is a LlamaForCausalLM (model.*, lm_head); in memory, a LlamaModel.
        return part, rest if rest.startswith("model.") or rest == "lm_head.weight" else "model." + rest
    if part == "vision_tower":
        return part, rest.removeprefix("vision_model.")
    if part == "multi_modal_projector":
        return part, rest
    return None, hf_name


__all__ = ["SELECT_STRATEGIES", "LlavaForConditionalGeneration", "LlavaMultiModalProjector"]
