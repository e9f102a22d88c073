"""Attention and hot ops: a CPU path, a Triton kernel for CUDA, and torch references that the tests hold both to.

Every public function here dispatches on its first tensor argument: CUDA tensors go to :mod:`spindle.kernels.triton`,
CPU tensors to the C++ ops of ``spindle.kernels.cpu`` (attention and the cache write, norms, rotary, SwiGLU, LoRA,
argmax), compiled for the machine when the backend starts. The torch versions of all of them (and of the quantized
projection) stay as references, and all three paths share their signatures (on the CPU, projections run through
:class:`~spindle.kernels.linear.Projection`). Within :func:`eager` CPU tensors go to the torch references instead:
``--enforce-eager`` runs the engine so, with no C++ of ours (nothing to compile: a machine without a compiler can
serve, slower). :func:`force_triton` sends CPU tensors to Triton too, which runs
them under its interpreter when ``TRITON_INTERPRET=1`` was set before Triton was first imported: that is how the
tests prove the kernels without a GPU. Triton is imported on first use only, so the
CPU path neither needs it installed nor pays for importing it.
"""

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import ParamSpec, TypeVar

import torch

from spindle.kernels import activation, attention, cpu, lora, norm, quant, rotary
from spindle.kernels.attention import AttentionMetadata
from spindle.kernels.rotary import build_cos_sin_cache

__all__ = [
    "AttentionMetadata",
    "add_lora",
    "argmax",
    "attend",
    "attention_metadata",
    "build_cos_sin_cache",
    "eager",
    "force_triton",
    "gelu_tanh_and_mul",
    "is_eager",
    "is_forced_triton",
    "paged_attention",
    "quantized_linear",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
]

P = ParamSpec("P")
R = TypeVar("R")

_force_triton = False
_eager = False


@contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, send CPU tensors to the Triton kernels as well (for tests under ``TRITON_INTERPRET=1``)."""
    global _force_triton
    previous, _force_triton = _force_triton, enabled
    try:
        yield
    finally:
        _force_triton = previous


@contextmanager
def eager(enabled: bool = True) -> Iterator[None]:
    """Within the block, send CPU tensors to the torch references rather than the C++ ops (``--enforce-eager``).

    CUDA tensors still go to Triton. A projection chooses its path when it is built: one built within the block
    (:class:`~spindle.kernels.linear.Projection`) runs torch's ops at every call.
    """
    global _eager
    previous, _eager = _eager, enabled
    try:
        yield
    finally:
        _eager = previous


def is_eager() -> bool:
    """Whether the code runs within :func:`eager`."""
    return _eager


def is_forced_triton() -> bool:
    """Whether the code runs within :func:`force_triton`."""
    return _force_triton


@functools.cache
def _triton_kernels() -> ModuleType:
    import spindle.kernels.triton

    return spindle.kernels.triton


def _dispatch(reference: Callable[P, R], cpu: Callable[P, R] | None = None) -> Callable[P, R]:
    """Route a call to Triton, the CPU op, or the torch reference.

    CUDA tensors (or all of them, under :func:`force_triton`) go to Triton; CPU tensors go to ``cpu`` (a C++ op of
    ``spindle.kernels.cpu``) when there is one, outside :func:`eager`, else to the reference.
    """
    name = reference.__name__
    on_cpu = cpu or reference

    @functools.wraps(reference)
    def kernel(*args: P.args, **kwargs: P.kwargs) -> R:
        if _force_triton or args[0].is_cuda:
            return getattr(_triton_kernels(), name)(*args, **kwargs)
        return reference(*args, **kwargs) if _eager else on_cpu(*args, **kwargs)

    return kernel


# The norms, rotary and SwiGLU run as single-pass C++ ops on the CPU, in place of ~60 small torch ops per layer.
# Measured on a decode forward of SmolLM2 bf16 on 2 cores, eager torch against them: batch 1 27.1 vs 22.1 ms, batch 8
# 28.5 vs 26.3, batch 64 91.7 vs 91.4, batch 256 398 vs 388: the win is the per-op overhead of small batches.
paged_attention = _dispatch(attention.paged_attention, attention.paged_attention_cpu)
# The cache write too: torch's index_copy_ took 2.5 ms of a batch-64 decode step (see kernels/cpu/cache.cpp).
reshape_and_cache = _dispatch(attention.reshape_and_cache, cpu.reshape_and_cache)
rms_norm = _dispatch(norm.rms_norm, cpu.rms_norm)
rotary_embedding = _dispatch(rotary.rotary_embedding, cpu.rotary_embedding)
silu_and_mul = _dispatch(activation.silu_and_mul, cpu.silu_and_mul)
gelu_tanh_and_mul = _dispatch(activation.gelu_tanh_and_mul, cpu.gelu_tanh_and_mul)


# One launch (Triton) or one C++ call (CPU) rotates and writes the cache: on the CPU a call's argument conversions cost
# about as much as the work of a decode step's token (bench/results/decode_attention.md).
rotary_embedding_and_cache = _dispatch(rotary.rotary_embedding_and_cache, cpu.rotary_embedding_and_cache)
# On the CPU, spindle.kernels.linear.Projection runs the int8/int4 kernels (ours, torch's); this CPU fallback is the
# torch reference.
quantized_linear = _dispatch(quant.quantized_linear)
# Batched LoRA (spindle.kernels.lora): on the CPU one C++ call per projection, as torch's small matmuls cost more in
# overhead than the LoRA deltas themselves (measured in kernels/cpu/lora.cpp).
add_lora = _dispatch(lora.add_lora, lora.add_lora_cpu)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, as ``logits.argmax(-1)`` (the first of equal maxima, or the first NaN).

    Float32 CPU rows go to a C++ op of ours (``kernels/cpu/argmax.cpp``): torch's CPU argmax compares one value at a
    time, 3.6 ms over a batch-64 step's ``[64, 49152]`` logits on 2 AVX2 cores against 0.2 ms for ours.
    Everything else (CUDA, other dtypes or shapes, and calls within :func:`eager`) runs torch's.

    Args:
        logits: ``[rows, width]``, ``width > 0``.

    Returns:
        ``[rows]`` int64, on the logits' device.

    """
    if _eager or logits.is_cuda or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
        return logits.argmax(-1)
    return cpu.argmax(logits)


_metadata: AttentionMetadata | None = None


@contextmanager
def attention_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """Within the block, :func:`attend` reads the step's batch layout from ``meta``.

    The layout reaches the attention this way, not as an argument of every layer, so that a compiled layer sees
    tensors only: host lists and step-dependent ints among its inputs would make ``torch.compile`` guard on them
    and recompile for every new batch.
    """
    global _metadata
    previous, _metadata = _metadata, meta
    try:
        yield
    finally:
        _metadata = previous


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    if _metadata is None:
        raise RuntimeError("attend() runs inside `with attention_metadata(meta):` only")
    if positions is None or cos_sin_cache is None:
        reshape_and_cache(key, value, k_cache, v_cache, _metadata.slot_mapping)
    else:
        query = rotary_embedding_and_cache(
            positions, query, key, value, cos_sin_cache, k_cache, v_cache, _metadata.slot_mapping
        )
    return paged_attention(query, k_cache, v_cache, _metadata, scale, sliding_window, softcap)


_attend_op = torch.library.custom_op("spindle::attend", _attend, mutates_args=("k_cache", "v_cache"))
# What the compiler needs to know of the op's output: the query's shape and dtype.
_attend_op.register_fake(lambda query, *_, **__: torch.empty_like(query))


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write the new tokens' K/V into the cache, then attend every query over its context (the step's whole attention).

    With ``positions`` and ``cos_sin_cache`` the query and key heads are first rotated
    (:func:`rotary_embedding_and_cache`: on Triton the rotation and the cache write are one launch). The batch
    layout is the one set by :func:`attention_metadata`. Under ``torch.compile`` this is one opaque custom op
    (``spindle::attend``), which the compiler neither traces nor specialises; run eagerly it is a plain call, since
    a custom op's dispatch costs tens of microseconds per layer.

    Args:
        query: ``[num_tokens, num_heads, head_size]``.
        key: ``[num_tokens, num_kv_heads, head_size]``, written to the cache.
        value: same shape as ``key``, written to the cache.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place.
        v_cache: same shape as ``k_cache``.
        scale: the softmax scale.
        positions: ``[num_tokens]`` int64, each token's absolute position, to rotate the query and key heads by; or
            None when they are rotated already.
        cos_sin_cache: from :func:`build_cos_sin_cache`, with ``positions``.
        sliding_window: the layer's window (a token attends to that many positions, its own included); None for
            the whole context.
        softcap: the attention logits' soft-cap (``softcap * tanh(s / softcap)`` of each scaled score), or None.

    Returns:
        ``[num_tokens, num_heads, head_size]``.

    """
    if torch.compiler.is_compiling():
        return _attend_op(query, key, value, k_cache, v_cache, scale, positions, cos_sin_cache, sliding_window, softcap)
    return _attend(query, key, value, k_cache, v_cache, scale, positions, cos_sin_cache, sliding_window, softcap)
