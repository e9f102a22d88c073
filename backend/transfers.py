"""Host-device copies of a step's small tensors that do not stall the device's queue.

On CUDA, ``torch.tensor(values, device="cuda")`` copies from pageable memory and ``.tolist()`` of a device tensor
reads it back: each one waits for every kernel queued before it, so a step that did a dozen of them would leave the
GPU idle between its parts while Python catches up. Here host-to-device copies go from pinned memory with
``non_blocking`` (they queue behind the kernels like one), and a step's device-to-host reads are one batch of copies
with one wait (:func:`fetch`). On the CPU both are plain tensors, with nothing to copy.
"""

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


def to_device(values: np.ndarray | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device``, copied without waiting for the device.

    On CUDA the host copy comes from torch's pinned-memory cache, which keeps it until the copy is done.

    Args:
        values: numbers, or an array of them.
        dtype: ``torch.int32``, ``torch.int64`` or ``torch.float32``.
        device: where the tensor goes.

    """
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=_NUMPY_DTYPES[dtype]))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def fetch(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The values of ``tensors`` on the host, with one wait for the device for all of them.

    This is the one place a step waits for the device: the runner calls it once, on everything the step returns.
    """
    if not tensors or tensors[0].device.type == "cpu":
        return [tensor.numpy() for tensor in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [tensor.numpy() for tensor in host]
