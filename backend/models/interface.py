"""The contract of a model class, and importing the class that serves a checkpoint's architecture.

Which class serves which architecture is :class:`~spindle.shared.model_registry.ModelRegistry`'s business (it imports
no torch, so the frontend can record registrations); this module imports the class in the backend and checks it
has what the model runner calls.
"""

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.llama import KVCache
from spindle.kernels import AttentionMetadata
from spindle.kernels.quant import QuantizedWeight
from spindle.shared.model_registry import ModelRegistry

REQUIRED_METHODS = ("forward", "compute_logits", "load_weights", "prepare_weights", "eval")
"""What every model class must have; ``projections`` and ``parameter_slice`` only serve ``--quantization``."""

REQUIRED_FLAGS = ("supports_images", "is_pooling_model", "supports_tensor_parallel")
"""The boolean class attributes that say what a model class serves (:class:`CausalLM`)."""


class CausalLM(Protocol):
    """What the model runner needs of a model class; :class:`~spindle.backend.models.llama.LlamaForCausalLM` is one.

    The loader builds it as ``cls(config, dtype)`` under ``with torch.device(device)``, calls
    :meth:`load_weights`, ``eval()`` and :meth:`prepare_weights`; then every step calls the model (its
    :meth:`forward`) on the flat batch and :meth:`compute_logits` on the rows to sample. On CUDA, decode steps replay
    CUDA graphs of the forward, so it must not synchronize with the host or branch on tensor values. Subclass
    :class:`torch.nn.Module` (``eval()`` and ``__call__`` come from it), or better ``LlamaForCausalLM``, overriding
    what differs.

    A model that takes images (``spindle.backend.models.llava.LlavaForConditionalGeneration``) also sets
    ``supports_images = True`` and has ``image_shape``, ``num_image_tokens``, ``image_token_id``,
    ``embed_images(pixel_values)`` and the keyword arguments ``image_rows`` and ``image_embeds`` of its forward.
    """

    supports_images: bool
    """It takes images (then it has the attributes above)."""
    is_pooling_model: bool
    """It has no LM head: it serves embedding requests only."""
    supports_tensor_parallel: bool
    """It shards itself over tensor-parallel ranks (:meth:`shard_range`)."""

    def __init__(self, config: CheckpointConfig, dtype: torch.dtype) -> None:
        """Create the parameters in ``dtype`` on the current default device; ``config.hf_config`` is the raw config.

        The KV cache the runner allocates is sized from ``config.num_layers``, ``num_kv_heads`` and ``head_dim``.
        """

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        """Run :meth:`forward` (``nn.Module`` provides it)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        """The new tokens ``[T]`` (positions ``[T]``, laid out as ``meta`` says) to hidden states ``[T, hidden]``.

        Writes the tokens' keys and values into ``kv_caches``: one ``(k_cache, v_cache)`` a layer, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``spindle.kernels.attend`` under
        ``spindle.kernels.attention_metadata(meta)`` does it, and attends over the cache.
        """

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Hidden states ``[N, hidden]`` to float32 logits ``[N, vocab_size]``.

        Under tensor parallelism every rank calls it on the same rows, and only rank 0 gets the logits (None
        elsewhere).
        """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from the checkpoint's ``(name, tensor)`` pairs (every safetensors shard)."""

    def prepare_weights(self, quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """Ready the weights for the forward, once, after loading; ``quantized`` is None unless quantizing.

        Its keys are :meth:`projections` names, and ``"embed_tokens"`` (``spindle.backend.models.llama``'s
        ``EMBEDDING_TABLE``) for an untied embedding table kept quantized (a class without one ignores it).
        """

    def eval(self) -> nn.Module:
        """Switch to inference mode and return the model (``nn.Module`` provides it)."""

    def projections(self) -> dict[str, tuple[nn.Module, str]]:
        """With ``--quantization`` only: every matrix to quantize by name, as ``(module, attribute)``."""

    def parameter_slice(self, hf_name: str) -> tuple[str, int, int | None]:
        """With ``--quantization`` only: where a checkpoint tensor goes, ``(projection name, first row, rows)``."""

    def shard_range(self, hf_name: str) -> tuple[int, int, int] | None:
        """With ``tensor_parallel_size > 1`` only: the part ``(dim, start, length)`` of a tensor this rank holds.

        None for the whole tensor. A class that shards itself also sets ``supports_tensor_parallel = True``.
        """


def model_class(architecture: str) -> type[CausalLM]:
    """Import the class registered for ``architecture`` and check it has :data:`REQUIRED_METHODS` and the flags.

    Raises:
        ValueError: for an architecture that nothing serves (the message lists those that are served).
        ImportError: when its ``"module:Class"`` cannot be imported (the message names both).
        TypeError: when it names something other than a class, or a class that lacks a required method or flag.

    """
    model_cls = ModelRegistry.load_model_cls(architecture)
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(model_cls, name, None))]
    missing += [name for name in REQUIRED_FLAGS if not isinstance(getattr(model_cls, name, None), bool)]
    if missing:
        target = ModelRegistry.get_model_cls_target(architecture)
        raise TypeError(
            f"architecture {architecture!r} is served by {target!r}, which lacks {', '.join(missing)}: "
            "subclass spindle.backend.models.llama.LlamaForCausalLM, or see spindle.backend.models.interface.CausalLM"
        )
    return model_cls
