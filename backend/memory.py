"""The backend's memory: how much of a shared GPU the KV cache may take, and a host allocator that stays flat.

``gpu_memory_utilization`` is this engine's share of the device. Other processes (a second engine, a training job)
hold memory too, and subtracting everything in use on the device would leave a second engine at 0.3 beside a first
at 0.3 with no cache at all. So the engine counts what it uses itself (:class:`MemoryMeter`), from a
:class:`MemorySnapshot` taken at start-up and one taken after the profile pass: torch's reserved peak (weights and
the largest step's activations), what the device lost outside torch's allocator since start-up (cuBLAS workspaces,
kernels' modules) and the decode CUDA graphs' private memory pool, measured on trial graphs. The cache gets the
share minus that (:func:`kv_cache_budget`), and the engine refuses to start only when the device's free memory
cannot hold it. :class:`KVBudget` keeps the inputs and the result.

On the host, a server sees a new activation shape with nearly every step (batch sizes, chunk lengths), and two caches
of freed or per-shape memory grow with the number of shapes seen (:func:`bound_host_memory`).
"""

import ctypes
import ctypes.util
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 * 2**20
"""Bytes from which glibc's malloc serves a block with its own mapping, returned to the system when freed.

32 MiB, the most glibc allows: a mapped block's pages fault in (and are zeroed) again each time it is taken, and a
step's largest activations are megabytes (SmolLM2 in bf16: the logits of 64 decodes in float32 12.6 MB, the MLP's
gate/up rows of a 2,048-token step 12.6 MB). At 4 MiB the engine took 148k page faults per 2,048-token prompt and
prefilled it at 1,084-1,136 tok/s against 1,217-1,245 with glibc's own settings; 150 s of mixed batches (1-90
prompts of 4-3,000 tokens, 2 Zen 4 cores) took 9.5M faults and generated 32,543 tokens, against 12k faults and
34,814 tokens at 32 MiB (with :data:`TRIM_THRESHOLD`), resident memory flat at 1,837 and 1,860 MiB. (At 128 KiB,
before, the float32 backend took 4.7M faults where the in-process engine took 0.9M, and ran 25% slower.)"""

TRIM_THRESHOLD = 128 * 2**20
"""Free bytes at the top of glibc's heap from which it returns them to the system: above a step's activations, so
that the next step does not fault them in again (glibc's default, once the mmap threshold is set, is 128 KiB)."""

ONEDNN_PRIMITIVE_CACHE_CAPACITY = 256
"""oneDNN's compiled matmuls kept, one per shape (its default, 1,024, held ~135 MiB more over 400 shapes)."""


def bound_host_memory() -> None:
    """Keep the backend's resident memory from growing with the number of distinct step shapes it has run.

    oneDNN keeps a compiled matmul per shape: its cache is held to :data:`ONEDNN_PRIMITIVE_CACHE_CAPACITY`. glibc's
    malloc starts by mapping every block from 128 KiB, and raises that threshold (up to 32 MiB) each time a larger
    mapped block is freed, so a server's first steps of each new size fault their activations in afresh, and its
    heap's top is returned to the system and faulted in again from step to step. Both thresholds are fixed here
    instead (:data:`MMAP_THRESHOLD`, :data:`TRIM_THRESHOLD`), above a step's activations, so that those are reused
    from the heap; blocks larger still are mapped, and returned when freed. (Over 400 token counts of SmolLM2's
    float32 projections through oneDNN the resident memory had reached 1.37 GiB, still rising, with oneDNN's default
    cache of 1,024 primitives; ``bench/soak.py`` measures the whole server.) An in-process engine (``LLM``) needs it as
    much: with glibc's own thresholds a Mixtral batch (``bench.moe``) took 19-27k page faults per ``generate`` in some
    processes, 0 in others, and ran 10-15% slower in the former. Call this first thing in the process that runs the
    engine core, before oneDNN reads its environment. Other C libraries are left alone.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
    mallopt = getattr(_libc(), "mallopt", None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    if mallopt is None or not (mallopt(m_mmap_threshold, MMAP_THRESHOLD) and mallopt(m_trim_threshold, TRIM_THRESHOLD)):
        logger.info("Not glibc's malloc: leaving the host allocator's settings alone")


def release_freed_heap() -> None:
    """Return the heap pages that loading and the profiled step freed to the system (glibc's ``malloc_trim``).

    Loading builds each projection's dense weight, then its quantized or laid-out form, and frees what the form
    replaces. Blocks under :data:`MMAP_THRESHOLD` come from the heap, and freed ones amid it stay resident: a Q4_K_M
    file of a 0.5B model (``bench.kquant_vs_llamacpp``) held 190 MiB more after ``LLM()`` than after this call. Does
    nothing where the C library has no ``malloc_trim``.
    """
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on, None where ctypes cannot find it."""
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


class CudaMemoryApi(Protocol):
    """The part of ``torch.cuda``'s memory API the budget reads: ``torch.cuda`` itself, or a fake in the tests."""

    def empty_cache(self) -> None:
        """Return the allocator's cached free blocks to the device."""

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start the peak statistics afresh, from what is held now."""

    def max_memory_reserved(self, device: torch.device) -> int:
        """The most bytes the allocator has reserved since the peak statistics were reset."""

    def memory_reserved(self, device: torch.device) -> int:
        """Bytes the allocator holds from the device, allocated or cached."""

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """The device's free and total bytes (``cudaMemGetInfo``, all processes counted)."""


@dataclass(frozen=True)
class MemorySnapshot:
    """What the device and torch's allocator report at one moment, in bytes.

    Attributes:
        free: free memory on the device (all processes counted).
        total: the device's memory.
        reserved: what this process's torch allocator holds.

    """

    free: int
    total: int
    reserved: int

    @classmethod
    def take(cls, device: torch.device, api: CudaMemoryApi = torch.cuda) -> "MemorySnapshot":
        """The device's report now (``cudaMemGetInfo``) and torch's reserved bytes."""
        free, total = api.mem_get_info(device)
        return cls(free=free, total=total, reserved=api.memory_reserved(device))


class Measured(NamedTuple):
    """What :func:`kv_cache_budget` takes, as :meth:`MemoryMeter.after_profile` measured it (bytes)."""

    start: MemorySnapshot  # taken before the weights were loaded
    now: MemorySnapshot  # after the profile pass, its blocks returned to the device
    peak_reserved: int  # torch's reserved peak over the weights and the profile pass
    graph_pool: int = 0  # the decode CUDA graphs' private pool, 0 without graphs


def _torch_peak(start: MemorySnapshot, peak_reserved: int) -> int:
    return peak_reserved - start.reserved


def _outside_torch(start: MemorySnapshot, now: MemorySnapshot) -> int:
    # What the device lost since start-up that torch's allocator does not hold: workspaces, modules, streams.
    return max(0, (start.free - now.free) - (now.reserved - start.reserved))


class MemoryMeter:
    """Measures one engine's own use of the device, from before its weights are loaded to the KV cache's sizing.

    Created before the weights: it first returns torch's cached free blocks to the device (an earlier engine's in
    this process, freed but cached), so that this engine's weights and activations are taken from the device and
    raise the reserved peak; served from the cache, they would not, and the cache would be over-committed by them.
    Then it resets the peak statistics and takes the start snapshot.

    Args:
        device: the CUDA device.
        api: ``torch.cuda``'s memory API (a fake in the tests).

    """

    def __init__(self, device: torch.device, api: CudaMemoryApi = torch.cuda) -> None:
        self.device = device
        self.api = api
        gc.collect()  # an earlier engine's tensors held only by reference cycles
        api.empty_cache()
        api.reset_peak_memory_stats(device)
        self.start = MemorySnapshot.take(device, api)

    def after_profile(self, trial_graphs: Callable[[], object] | None = None) -> Measured:
        """The budget's inputs, once the profile pass has run.

        Args:
            trial_graphs: captures the decode CUDA graphs over a scratch cache and returns them (None without
                graphs). The graphs' private pool is outside the profiled peak, and the real ones are captured after
                the KV cache is allocated: so trial ones are captured now, the memory they hold measured, and
                released. Their eager warm-up runs are not counted (their blocks return to the device), and the peak
                is read before them.

        """
        api, device = self.api, self.device
        peak = api.max_memory_reserved(device)
        graph_pool = 0
        if trial_graphs is not None:
            api.empty_cache()
            before = api.memory_reserved(device)
            graphs = trial_graphs()
            api.empty_cache()
            graph_pool = api.memory_reserved(device) - before
            del graphs
        api.empty_cache()
        return Measured(self.start, MemorySnapshot.take(device, api), peak, graph_pool)


def kv_cache_budget(
    utilization: float, start: MemorySnapshot, now: MemorySnapshot, peak_reserved: int, graph_pool: int = 0
) -> int:
    """Bytes the KV cache may take, after the profile pass released its activations.

    Args:
        utilization: this engine's share of the device (``gpu_memory_utilization``).
        start: the snapshot taken before the weights were loaded, with torch's cache emptied (:class:`MemoryMeter`).
        now: the snapshot after the profile pass, its blocks returned to the device (``torch.cuda.empty_cache``).
        peak_reserved: torch's reserved peak since ``start`` (``torch.cuda.max_memory_reserved``): the weights plus
            the largest step's activations, which the steps will take again.
        graph_pool: the decode CUDA graphs' private pool, captured after the cache is allocated.

    Returns:
        The share minus this process's own use, ``utilization x total - (torch's peak + memory the device lost
        outside torch since start + the graphs' pool)``, which may be zero or negative (the caller refuses to start
        then).

    Raises:
        ValueError: when the share's cache would not fit in the memory the device has free now, beside the
            activations the steps will take back and the graphs: other processes hold too much of it.

    """
    own = _torch_peak(start, peak_reserved) + _outside_torch(start, now) + graph_pool
    budget = int(utilization * now.total) - own
    # The activations are released now and will be taken again by the steps, the graphs' pool after the cache: the
    # cache must leave them room.
    available = now.free - (peak_reserved - now.reserved) - graph_pool
    if budget > available:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {utilization * now.total / gib:.2f} GiB of the "
            f"device's {now.total / gib:.2f} GiB: {budget / gib:.2f} GiB for the KV cache after its weights, "
            f"activations and CUDA graphs ({own / gib:.2f} GiB), but only {max(available, 0) / gib:.2f} GiB "
            "is free beside them (other processes hold the rest): lower gpu_memory_utilization or free the device"
        )
    return budget


@dataclass(frozen=True)
class KVBudget:
    """How the KV cache of a CUDA engine was sized: the budget's inputs and its result, in bytes (the device report).

    Attributes:
        total: the device's memory.
        utilization: this engine's share of it (``gpu_memory_utilization``).
        start_free: the device's free memory before the weights were loaded (other processes' use is the rest).
        start_reserved: what torch held then (another engine's of this process), its cache emptied.
        torch_peak: torch's reserved peak since then: the weights and the largest step's activations.
        outside_torch: what the device lost outside torch's allocator since then (workspaces, modules).
        graph_pool: the decode CUDA graphs' private pool (0 without graphs).
        budget_bytes: the share minus the three above (:func:`kv_cache_budget`).
        block_bytes: one KV block over all layers.
        blocks: the blocks allocated (under tensor parallelism, the fewest any rank could hold).

    """

    total: int
    utilization: float
    start_free: int
    start_reserved: int
    torch_peak: int
    outside_torch: int
    graph_pool: int
    budget_bytes: int
    block_bytes: int
    blocks: int

    @classmethod
    def of(cls, utilization: float, measured: Measured, budget_bytes: int, block_bytes: int, blocks: int) -> "KVBudget":
        """The record of a budget computed from ``measured``."""
        start, now, peak_reserved, graph_pool = measured
        return cls(
            total=now.total,
            utilization=utilization,
            start_free=start.free,
            start_reserved=start.reserved,
            torch_peak=_torch_peak(start, peak_reserved),
            outside_torch=_outside_torch(start, now),
            graph_pool=graph_pool,
            budget_bytes=budget_bytes,
            block_bytes=block_bytes,
            blocks=blocks,
        )
