"""Attention and hot ops; the torch versions here are the reference and the CPU serving path."""

from kernels.activation import silu_and_mul
from kernels.attention import AttentionMetadata, paged_attention, reshape_and_cache
from kernels.norm import rms_norm
from kernels.rotary import build_cos_sin_cache, rotary_embedding

__all__ = [
    "AttentionMetadata",
    "build_cos_sin_cache",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
