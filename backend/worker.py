"""Tensor-parallel workers: the processes of ranks other than 0, which run every step's forward beside rank 0.

Rank 0 (the engine core's process) starts the workers of its node with :class:`Workers`; on another node
``spindle backend --node-rank K`` starts that node's with :func:`serve_node`. A worker loads its shard, says so (or
sends its error) over a pipe, joins the process group, sizes its KV cache with the others and then follows rank 0's
steps (:meth:`~spindle.backend.model_runner.ModelRunner.follow`) until rank 0 stops it. It exits when rank 0 is gone:
a collective fails, or the process that started it has died (the kernel then kills it, even if it is stopped).
"""

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from pathlib import Path

from spindle.backend import parallel
from spindle.backend.model_runner import ModelRunner
from spindle.backend.models.checkpoint_config import CheckpointConfig, Shard
from spindle.backend.models.interface import model_class
from spindle.backend.parent_death import die_with_parent
from spindle.shared.config import EngineConfig, configure_logging, configured_log_format
from spindle.shared.model_registry import ModelRegistry

logger = logging.getLogger(__name__)


class Workers:
    """The worker processes of some ranks of this node, started with the ``spawn`` method.

    They are killed when the thread that starts them ends (Linux's parent-death signal; see
    :func:`~spindle.backend.parent_death.die_with_parent`), so start them from one that lives as long as they should
    (the main thread, as the backend process does).

    Args:
        config: the engine's config, ``master_addr`` and ``master_port`` filled in (every rank must agree on them).
        model_dir: the resolved model directory.
        ranks: the global ranks to start.
        max_model_len: the context length rank 0 serves (the workers profile the same step).

    """

    def __init__(self, config: EngineConfig, model_dir: Path, ranks: Iterable[int], max_model_len: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.pipes: dict[int, Connection] = {}
        self.closing = False
        log_format = configured_log_format()
        # The workers serve the architectures this process serves: registrations do not survive a spawn.
        registrations = ModelRegistry.backend_args()[1::2]
        for rank in ranks:
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_run_worker,
                args=(config, model_dir, rank, max_model_len, os.getpid(), sender, log_format, registrations),
                name=f"spindle-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            sender.close()
            self.processes[rank], self.pipes[rank] = process, receiver

    def wait_loaded(self) -> None:
        """Return once every worker has loaded its shard.

        Raises:
            RuntimeError: a worker failed to load (its error in the message) or died; every worker is stopped.

        """
        for rank, pipe in self.pipes.items():
            process = self.processes[rank]
            wait([pipe, process.sentinel])
            try:
                error = pipe.recv()
            except EOFError:  # it died before it could say why (killed, or it crashed in native code)
                process.join()
                error = f"it exited with code {process.exitcode}"
            if error is not None:
                self.kill()
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {error}")

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death`` (from a daemon thread) with why, once a worker exits unless they are being stopped.

        Only this node's workers are watched: a rank of another node that dies fails the next collective.
        """
        if not self.processes:  # every rank but this one is on other nodes
            return

        def watch() -> None:
            ready = wait([process.sentinel for process in self.processes.values()])
            if not self.closing:
                dead = [rank for rank, process in self.processes.items() if process.sentinel in ready]
                on_death(f"tensor-parallel rank {dead[0]} died (exit code {self.processes[dead[0]].exitcode})")

        threading.Thread(target=watch, name="spindle-tp-watch", daemon=True).start()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for the workers to exit, then kill those still there."""
        self.closing = True
        deadline = None if timeout is None else time.monotonic() + timeout
        for process in self.processes.values():
            process.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every worker still running (a worker holds nothing that needs a graceful end)."""
        self.closing = True
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
                process.join()


def _run_worker(
    config: EngineConfig,
    model_dir: Path,
    rank: int,
    max_model_len: int,
    parent_pid: int,
    loaded: Connection,
    log_format: str | None,
    registrations: list[str],
) -> None:
    """A worker process's body: load the shard, report on ``loaded``, join the group, follow rank 0's steps.

    ``registrations`` are the model architectures registered in the starting process (``ARCH=module:Class``).
    """
    if log_format is not None:
        configure_logging(log_format)
    ModelRegistry.register_models(registrations)
    die_with_parent(parent_pid, signal.SIGKILL)  # the one signal a stopped (wedged) worker acts on
    try:
        runner = ModelRunner(config, CheckpointConfig.from_dir(model_dir), model_dir, rank)
    except Exception as e:
        loaded.send(f"{type(e).__name__}: {e}")
        raise SystemExit(1) from e
    loaded.send(None)
    parallel.init_group(config, runner.device)
    try:
        runner.init_cache(max_model_len)
        runner.follow()
    finally:
        parallel.destroy_group()


def check_tensor_parallel(config: EngineConfig, checkpoint: CheckpointConfig) -> None:
    """Refuse, before any process starts, a ``tensor_parallel_size`` that does not fit the model or its features.

    Raises:
        ValueError: the size does not split the heads or the MLP (:meth:`Shard.of`), the model's class does not
            shard itself, or LoRA adapters are configured (their slots are not sharded).

    """
    size = config.parallel.tensor_parallel_size
    Shard.of(checkpoint, 0, size)
    if not model_class(checkpoint.architecture).supports_tensor_parallel:
        raise ValueError(
            f"tensor_parallel_size={size}: the class serving {checkpoint.architecture} does not shard itself: "
            "serve it with tensor_parallel_size=1 (a registered text model may subclass "
            "spindle.backend.models.llama.LlamaForCausalLM, which does)"
        )
    if config.lora.lora_modules or config.lora.allow_runtime_lora:
        raise ValueError(f"LoRA adapters are not served with tensor_parallel_size={size}: use 1, or no adapters")


def serve_node(config: EngineConfig, model_dir: Path, max_model_len: int) -> int:
    """Run this node's ranks (``node_rank > 0``) until they exit; returns 0 when they all stopped cleanly."""
    check_tensor_parallel(config, CheckpointConfig.from_dir(model_dir))
    config = parallel.rendezvous(config)
    local_size = config.parallel.tensor_parallel_size // config.parallel.nnodes
    first = config.parallel.node_rank * local_size
    workers = Workers(config, model_dir, range(first, first + local_size), max_model_len)
    workers.wait_loaded()
    logger.info(
        "Ranks %d-%d loaded; following node 0 at %s:%d",
        first,
        first + local_size - 1,
        config.parallel.master_addr,
        config.parallel.master_port,
    )
    workers.join()
    codes = [process.exitcode for process in workers.processes.values()]
    return 0 if all(code == 0 for code in codes) else 1
