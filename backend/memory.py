"""How much of a shared GPU the KV cache may take: this process's own use, not the device's.

``gpu_memory_utilization`` is this engine's share of the device. Other processes (a second engine, a training job)
hold memory too, and subtracting everything in use on the device would leave a second engine at 0.3 beside a first
at 0.3 with no cache at all. So the engine counts what it uses itself, from a :class:`MemorySnapshot` taken at
start-up and one taken after the profile pass: torch's reserved peak (weights and the largest step's activations)
and what the device lost outside torch's allocator since start-up (cuBLAS workspaces, kernels' modules). The cache
gets the share minus that, and the engine refuses to start only when the device's free memory cannot hold it.
"""

from dataclasses import dataclass

import torch


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
    def take(cls, device: torch.device) -> "MemorySnapshot":
        """The device's report now (``cudaMemGetInfo``) and torch's reserved bytes."""
        free, total = torch.cuda.mem_get_info(device)
        return cls(free=free, total=total, reserved=torch.cuda.memory_reserved(device))


def kv_cache_budget(utilization: float, start: MemorySnapshot, now: MemorySnapshot, peak_reserved: int) -> int:
    """Bytes the KV cache may take, after the profile pass released its activations.

    Args:
        utilization: this engine's share of the device (``gpu_memory_utilization``).
        start: the snapshot taken before the weights were loaded.
        now: the snapshot after the profile pass, its blocks returned to the device (``torch.cuda.empty_cache``).
        peak_reserved: torch's reserved peak since ``start`` (``torch.cuda.max_memory_reserved``): the weights plus
            the largest step's activations, which the steps will take again.

    Returns:
        The share minus this process's own use, ``utilization x total - (torch's peak + memory the device lost
        outside torch since start)``, which may be zero or negative (the caller refuses to start then).

    Raises:
        ValueError: when the share's cache would not fit in the memory the device has free now, beside the
            activations the steps will take back: other processes hold too much of it.

    """
    torch_peak = peak_reserved - start.reserved
    # What the device lost since start-up that torch's allocator does not hold: workspaces, modules, streams.
    outside_torch = max(0, (start.free - now.free) - (now.reserved - start.reserved))
    budget = int(utilization * now.total) - torch_peak - outside_torch
    # The activations are released now and will be taken again by the steps: the cache must leave them room.
    available = now.free - (peak_reserved - now.reserved)
    if budget > available:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {utilization * now.total / gib:.2f} GiB of the "
            f"device's {now.total / gib:.2f} GiB: {budget / gib:.2f} GiB for the KV cache after its weights and "
            f"activations ({(torch_peak + outside_torch) / gib:.2f} GiB), but only {max(available, 0) / gib:.2f} GiB "
            "is free beside them (other processes hold the rest): lower gpu_memory_utilization or free the device"
        )
    return budget
