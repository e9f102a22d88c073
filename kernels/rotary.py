"""Rotary position embedding in the neox (rotate-half) layout, with linear and Llama 3 frequency scaling."""

import math
from typing import Any

import torch

from spindle.kernels.attention import reshape_and_cache

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def build_cos_sin_cache(
    head_size: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Precompute the cosines and sines of every position, on the current default device.

    The angles are computed in float32, as the Hugging Face reference does, then cast to ``dtype``.

    Args:
        head_size: the rotated dimension (the whole head).
        max_position: positions ``0 .. max_position - 1`` are covered.
        base: RoPE theta.
        rope_scaling: None, or a dict with ``rope_type`` (or the older ``type``) ``"default"``, ``"linear"``
            (needs ``factor``) or ``"llama3"`` (needs ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
            ``original_max_position_embeddings``).
        dtype: dtype of the returned cache.

    Returns:
        ``[max_position, head_size]``: the cosines in the first half of each row, the sines in the second.

    Raises:
        ValueError: for any other ``rope_type``.

    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    inv_freq = _scale_inv_freq(inv_freq, rope_scaling or {})
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        old_context_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_context_len / high_freq_factor) & (wavelen <= old_context_len / low_freq_factor)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the query and key heads by their tokens' positions (neox layout: the halves of a head pair up).

    Args:
        positions: ``[num_tokens]`` int64, the absolute position of each token.
        query: ``[num_tokens, num_heads, head_size]``.
        key: ``[num_tokens, num_kv_heads, head_size]``.
        cos_sin_cache: from :func:`build_cos_sin_cache`, in the query's dtype.

    Returns:
        The rotated ``(query, key)``, new tensors of the same shapes.

    """
    cos, sin = cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate the query and key heads, then write the rotated keys and the values into their cache slots.

    :func:`rotary_embedding` followed by :func:`~spindle.kernels.attention.reshape_and_cache`, which the Triton
    path fuses into one launch.

    Args:
        positions: ``[num_tokens]`` int64, the absolute position of each token.
        query: ``[num_tokens, num_heads, head_size]``.
        key: ``[num_tokens, num_kv_heads, head_size]``.
        value: same shape as ``key``.
        cos_sin_cache: from :func:`build_cos_sin_cache`, in the query's dtype.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place.
        v_cache: same shape as ``k_cache``, written in place.
        slot_mapping: ``[num_tokens]`` int64, the slot of each token; every slot must be valid.

    Returns:
        The rotated query, a new tensor of its shape.

    """
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    return query


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
