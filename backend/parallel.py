"""Tensor parallelism over ``torch.distributed``: each rank's slice of the model, the process group, the collectives.

Megatron-style: every rank holds its :class:`~spindle.backend.models.checkpoint_config.Shard`, its query heads and KV
heads (KV heads replicated when there are fewer than ranks), its share of the MLP's intermediate columns and of the
(padded) vocabulary. The row-parallel projections (o and down) and the vocabulary-parallel embedding end in one
all-reduce each, so every rank holds the whole hidden state between layers; the LM head's vocabulary shards are
gathered on rank 0, the only rank that samples.

Rank 0 runs the engine core and sends each step's :class:`~spindle.backend.scheduler_output.SchedulerOutput` to the
workers, encoded by msgspec (no pickling), as a small int64 header and a byte tensor (:func:`send_step`); each worker
runs the same model runner code on it (:func:`receive_step`), so the ranks keep the same state of each sequence.

Every collective fails after ``collective_timeout`` seconds, so a rank that died or is wedged fails the engine in
bounded time. The header is all-reduced, not broadcast, so that rank 0 waits for every worker to take it: a worker
that stopped is found at the next header even when no other collective follows. An idle engine sends no step, and
its workers would time out waiting for one: rank 0's :class:`KeepAlive` exchanges an empty header with them
whenever none went for a quarter of the timeout.
"""

import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from spindle.backend.scheduler_output import SchedulerOutput
from spindle.shared.config import EngineConfig

_STOP, _STEP, _KEEP_ALIVE = 0, 1, 2  # the header's kind; a step's header also holds its encoded length
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SchedulerOutput)


@dataclass(frozen=True)
class TensorParallel:
    """A process's place among the ranks.

    Attributes:
        rank: its global rank; 0 runs the engine core.
        size: the number of ranks (``tensor_parallel_size``).
        local_rank: its index among the ranks of its node (its CUDA device there).
        local_size: the ranks each node runs.

    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def of(cls, config: EngineConfig, rank: int) -> "TensorParallel":
        """The place of global ``rank`` under ``config``'s ``tensor_parallel_size`` and ``nnodes``."""
        local_size = config.parallel.tensor_parallel_size // config.parallel.nnodes
        return cls(rank, config.parallel.tensor_parallel_size, rank % local_size, local_size)


_current = TensorParallel()


def current() -> TensorParallel:
    """The place of this process, set by :func:`set_current` (rank 0 of 1 unless tensor parallel)."""
    return _current


def set_current(place: TensorParallel) -> None:
    """Record this process's place; the model reads it when it builds its parameters.

    It builds those of its :class:`~spindle.backend.models.checkpoint_config.Shard`.
    """
    global _current
    _current = place


def rendezvous(config: EngineConfig) -> EngineConfig:
    """``config`` with node 0's address and port for the ``torch.distributed`` rendezvous filled in.

    They are ``config``'s own, else ``MASTER_ADDR``/``MASTER_PORT`` from the environment (as ``torchrun`` sets them),
    else 127.0.0.1 and a free port.

    Raises:
        ValueError: on several nodes without a port (``--master-port`` or ``MASTER_PORT``): the nodes must agree.

    """
    addr = config.parallel.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = config.parallel.master_port or os.environ.get("MASTER_PORT")
    if port is None:
        if config.parallel.nnodes > 1:
            raise ValueError(
                f"nnodes={config.parallel.nnodes} needs master_port (or MASTER_PORT): every node must know it"
            )
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    return config.replace(master_addr=addr, master_port=int(port))


def init_group(config: EngineConfig, device: torch.device) -> None:
    """Join the process group of :func:`current`'s ranks at ``config``'s rendezvous: NCCL on CUDA, gloo on the CPU.

    A lost rank fails a gloo collective at once (its connection closes); ``collective_timeout`` bounds the other
    waits (a wedged rank's).
    """
    place = current()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{config.parallel.master_addr}:{config.parallel.master_port}",
        rank=place.rank,
        world_size=place.size,
        timeout=datetime.timedelta(seconds=config.parallel.collective_timeout),
    )


def destroy_group() -> None:
    """Leave the process group, if joined, and be a single rank again.

    Another engine of this process, or a model loaded outside one, then starts afresh.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    set_current(TensorParallel())


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; ``x`` itself with one rank."""
    if current().size > 1:
        dist.all_reduce(x)
    return x


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (each rank's KV cache budget: the cache must fit on all)."""
    if current().size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_columns(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's ``x [N, cols]`` along the columns, on rank 0 (``[N, size * cols]``); None elsewhere."""
    place = current()
    if place.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(place.size)] if place.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return None if parts is None else torch.cat(parts, dim=1)


def _exchange_header(kind: int, length: int, device: torch.device) -> tuple[int, int]:
    """Rank 0's header, on every rank: rank 0 gives it, the workers zeros, and the all-reduce sums them."""
    header = torch.tensor([kind, length] if current().rank == 0 else [0, 0], dtype=torch.int64, device=device)
    dist.all_reduce(header)
    kind, length = header.tolist()
    return kind, length


def send_step(scheduled: SchedulerOutput, device: torch.device) -> None:
    """Rank 0: send a step's scheduler output, its length (in the header) then its msgpack bytes."""
    data = _encoder.encode(scheduled)
    _exchange_header(_STEP, len(data), device)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=0)


def send_stop(device: torch.device) -> None:
    """Rank 0: tell the workers that the engine is closing."""
    _exchange_header(_STOP, 0, device)


def receive_step(device: torch.device) -> SchedulerOutput | None:
    """A worker: the next step's scheduler output, as rank 0 sent it; None when rank 0 stops.

    Rank 0's keep-alives, which come while the engine is idle, are taken on the way.
    """
    kind, length = _exchange_header(0, 0, device)
    while kind == _KEEP_ALIVE:
        kind, length = _exchange_header(0, 0, device)
    if kind == _STOP:
        return None
    data = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return _decoder.decode(data.cpu().numpy().tobytes())


class KeepAlive:
    """Rank 0: exchanges an empty header with the workers whenever no step went to them for a while.

    A worker waits for each step in a collective that fails after ``timeout`` seconds (``collective_timeout``); an
    idle engine sends no step, so a daemon thread sends a keep-alive once a quarter of the timeout passed without
    one. Rank 0 runs each step's collectives inside :meth:`exclusive`, so the two never interleave. As the header is
    all-reduced, a keep-alive also finds a worker that died or stopped while the engine was idle: the exchange fails
    (after ``timeout`` at most), and :meth:`fail` tells ``on_failure`` why.

    Args:
        device: the device of rank 0's collectives.
        timeout: the process group's collective timeout, in seconds.
        on_failure: called with why the collectives with the workers failed (by a keep-alive, or a step).

    Attributes:
        failed: whether they did: the workers are then out of step with rank 0, and cannot be stopped in order.

    """

    def __init__(self, device: torch.device, timeout: float, on_failure: Callable[[str], None]) -> None:
        self.device = device
        self.interval = timeout / 4
        self.on_failure = on_failure
        self.failed = False
        self._lock = threading.Lock()
        self._last_exchange = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="spindle-tp-keep-alive", daemon=True).start()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the keep-alives off while the caller runs collectives with the workers (a step, the stop)."""
        with self._lock:
            yield
            self._last_exchange = time.monotonic()

    def stop(self) -> None:
        """Send no more keep-alives (rank 0 is about to stop the workers)."""
        self._stop.set()

    def fail(self, reason: str) -> None:
        """Record that the collectives with the workers failed, stop the keep-alives, and tell ``on_failure``."""
        self.failed = True
        self._stop.set()
        self.on_failure(reason)

    def _run(self) -> None:
        while not self._stop.wait(self.interval / 2):
            with self._lock:
                if self._stop.is_set() or time.monotonic() - self._last_exchange < self.interval:
                    continue
                try:
                    _exchange_header(_KEEP_ALIVE, 0, self.device)
                except RuntimeError as error:  # a worker died, or did not answer within the timeout
                    self.fail(f"the tensor-parallel workers did not take a keep-alive: {error}")
                    return
                self._last_exchange = time.monotonic()
