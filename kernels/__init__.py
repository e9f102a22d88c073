"""Attention and hot ops, each with a torch reference (the CPU serving path) and a Triton kernel (the CUDA path).

Every public function here dispatches on its first tensor argument: CUDA tensors go to :mod:`spindle.kernels.triton`,
CPU tensors to the torch references, whose signatures the Triton versions share. :func:`force_triton` sends CPU
tensors to Triton too, which runs them under its interpreter when ``TRITON_INTERPRET=1`` was set before Triton was
first imported: that is how the tests prove the kernels without a GPU. Triton is imported on first use only, so the
CPU path neither needs it installed nor pays for importing it.
"""

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import ParamSpec, TypeVar

from spindle.kernels import activation, attention, norm, rotary
from spindle.kernels.attention import AttentionMetadata
from spindle.kernels.rotary import build_cos_sin_cache

__all__ = [
    "AttentionMetadata",
    "build_cos_sin_cache",
    "force_triton",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]

P = ParamSpec("P")
R = TypeVar("R")

_force_triton = False


@contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, send CPU tensors to the Triton kernels as well (for tests under ``TRITON_INTERPRET=1``)."""
    global _force_triton
    previous, _force_triton = _force_triton, enabled
    try:
        yield
    finally:
        _force_triton = previous


@functools.cache
def _triton_kernels() -> ModuleType:
    import spindle.kernels.triton

    return spindle.kernels.triton


def _dispatch(reference: Callable[P, R]) -> Callable[P, R]:
    """Wrap a torch reference so that CUDA tensors (or all of them, under :func:`force_triton`) go to Triton."""
    name = reference.__name__

    @functools.wraps(reference)
    def kernel(*args: P.args, **kwargs: P.kwargs) -> R:
        if _force_triton or args[0].is_cuda:
            return getattr(_triton_kernels(), name)(*args, **kwargs)
        return reference(*args, **kwargs)

    return kernel


paged_attention = _dispatch(attention.paged_attention)
reshape_and_cache = _dispatch(attention.reshape_and_cache)
rms_norm = _dispatch(norm.rms_norm)
rotary_embedding = _dispatch(rotary.rotary_embedding)
silu_and_mul = _dispatch(activation.silu_and_mul)
