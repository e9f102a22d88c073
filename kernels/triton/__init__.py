"""Triton kernels with the same signatures as the torch references in :mod:`kernels`.

:mod:`kernels` sends CUDA tensors here. Under ``TRITON_INTERPRET=1`` (set before the first ``import triton``) the
same kernels run on CPU tensors, which is how the test suite proves them without a GPU.
"""

from spindle.kernels.triton.activation import gelu_tanh_and_mul, silu_and_mul
from spindle.kernels.triton.cache import reshape_and_cache
from spindle.kernels.triton.decode_attention import decode_attention
from spindle.kernels.triton.lora import add_lora
from spindle.kernels.triton.norm import rms_norm
from spindle.kernels.triton.paged_attention import paged_attention
from spindle.kernels.triton.prefill_attention import prefill_attention
from spindle.kernels.triton.quant_linear import quantized_linear
from spindle.kernels.triton.rotary import rotary_embedding, rotary_embedding_and_cache

__all__ = [
    "add_lora",
    "decode_attention",
    "gelu_tanh_and_mul",
    "paged_attention",
    "prefill_attention",
    "quantized_linear",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
]
