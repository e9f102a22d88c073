"""Rotary position embedding in the neox (rotate-half) layout, with the scalings of transformers' rope types."""

import math
from typing import Any

import torch

from spindle.kernels.attention import reshape_and_cache

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def build_cos_sin_cache(
    head_size: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Precompute the cosines and sines of every position, on the current default device.

    The angles are computed in float32, as transformers computes them (``ROPE_INIT_FUNCTIONS``), then scaled by the
    rope type's attention factor (yarn, longrope) and cast to ``dtype``. The two types whose frequencies depend on
    the sequence's length get, at each position, those transformers uses when that position is the last of the
    sequence, as when it decodes token by token: longrope's short factors below ``original_max_position_embeddings``
    and its long ones from there on; dynamic NTK's unscaled frequencies throughout, since they only change past
    ``max_position`` (the model's context, which no served sequence exceeds).

    Args:
        head_size: the rotated dimension (the whole head, or its rotated part under a partial rotary factor).
        max_position: the model's ``max_position_embeddings``: positions ``0 .. max_position - 1`` are covered.
        base: RoPE theta.
        rope_scaling: None, or a dict with ``rope_type`` (or the older ``type``) and that type's parameters as
            transformers names them: ``"linear"`` and ``"dynamic"`` need ``factor``; ``"llama3"`` ``factor``,
            ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``; ``"yarn"``
            ``original_max_position_embeddings`` (and optionally ``factor``, ``attention_factor``, ``beta_fast``,
            ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate``); ``"longrope"`` ``short_factor``,
            ``long_factor`` and ``original_max_position_embeddings`` (optionally ``factor``, ``attention_factor``).
        dtype: dtype of the returned cache.

    Returns:
        ``[max_position, head_size]``: the cosines in the first half of each row, the sines in the second.

    Raises:
        ValueError: for any other ``rope_type``.

    """
    rope_scaling = rope_scaling or {}
    positions = torch.arange(max_position, dtype=torch.float32)
    inv_freq, attention_factor = _inv_freq(head_size, base, rope_scaling, max_position, long=False)
    freqs = torch.outer(positions, inv_freq)
    if _rope_type(rope_scaling) == "longrope":
        long_from = rope_scaling["original_max_position_embeddings"]
        long_inv_freq, _ = _inv_freq(head_size, base, rope_scaling, max_position, long=True)
        freqs[long_from:] = torch.outer(positions[long_from:], long_inv_freq)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor).to(dtype)


def _rope_type(rope_scaling: dict[str, Any]) -> str:
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def _inv_freq(
    dim: int, base: float, rope_scaling: dict[str, Any], max_position: int, long: bool
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[dim // 2]`` and the attention factor of a rope type, as transformers computes them.

    ``long`` picks longrope's long factors (transformers' ``seq_len > original_max_position_embeddings``).
    """
    # Each formula divides where transformers' does, so that the angles round as theirs do.
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    rope_type = _rope_type(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope_scaling), 1.0
    original = rope_scaling["original_max_position_embeddings"]
    # Phi-3 leaves `factor` out: the context's growth over the pretraining length stands for it.
    factor = rope_scaling.get("factor") or max_position / original
    attention_factor = rope_scaling.get("attention_factor")
    if rope_type == "yarn":
        if attention_factor is None:
            mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        return _yarn(pos_freqs, dim, base, factor, original, rope_scaling), float(attention_factor)
    # What is left is longrope.
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(rope_scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext_factors * pos_freqs), float(attention_factor)


def _llama3(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed down by ``factor``, short ones kept, the band between interpolated."""
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


def _yarn(
    pos_freqs: torch.Tensor, dim: int, base: float, factor: float, original: int, rope_scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN's inverse frequencies, from ``base ** (2i / dim)``.

    Dimensions that turn many times over the pretraining length keep their frequency, those that turn less than
    once are interpolated by ``factor``, with a linear ramp between.
    """
    beta_fast = rope_scaling.get("beta_fast") or 32
    beta_slow = rope_scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


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
