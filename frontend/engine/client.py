"""The engine clients: how an engine reaches its engine core, in this process or in backend processes.

Every client offers :class:`EngineClient`'s methods. ``LLMEngine`` drives a :class:`SyncEngineClient` one step at a
time:

* :class:`~spindle.frontend.engine.inprocess_client.InProcessClient`: an engine core in this process (imports torch);
* :class:`~spindle.frontend.engine.sync_client.SyncBackendClient`: a backend process, whose next step it waits for.

``AsyncLLMEngine`` streams from an :class:`AsyncEngineClient`, which hands what its backends send to an
:class:`OutputHandler` (the engine) from a task of its own:

* :class:`~spindle.frontend.engine.async_client.AsyncBackendClient`: a backend process, brought back when it dies;
* :class:`~spindle.frontend.engine.data_parallel.DataParallelClient`: several, each request routed to one of them.

:func:`make_sync_client` and :func:`make_async_client` pick one.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spindle.frontend.engine.async_client import AsyncBackendClient, KvListener, RankStats
from spindle.frontend.engine.connection import BackendConnection, EngineDeadError
from spindle.frontend.engine.data_parallel import DataParallelClient, connect_backends
from spindle.frontend.engine.inprocess_client import InProcessClient
from spindle.frontend.engine.sync_client import SyncBackendClient
from spindle.shared.config import EngineConfig
from spindle.shared.errors import RequestRefusedError
from spindle.shared.protocol import Command, EngineInfo, EngineRequest, EngineStats, SequenceDelta

if TYPE_CHECKING:
    from spindle.backend.engine_core import EngineCore


class EngineClient(Protocol):
    """What every engine client does: describe the engine, end requests and completions, and close."""

    @property
    def info(self) -> EngineInfo:
        """The engine's description: model, limits, tokenizer files."""

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests wherever they run, freeing their KV blocks; unknown or ended ids are ignored."""

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion of a request (the frontend matched a stop string) and free its blocks."""

    def close(self) -> None:
        """Stop what the client started: its backend processes, or an in-process core's tensor-parallel workers."""


class SyncEngineClient(EngineClient, Protocol):
    """An engine client that returns each step's deltas when asked: what ``LLMEngine`` drives."""

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request in the engine core.

        Raises:
            InvalidRequestError: an in-process core refused it (a backend process refuses it in a later step).

        """

    def step(self) -> list[SequenceDelta]:
        """The deltas of the engine core's next step (``[]`` when a backend process sent something else).

        Raises:
            EngineDeadError: the backend process died.

        """

    def pop_refused(self) -> list[tuple[str, RequestRefusedError]]:
        """The requests the engine core dropped since the last call, and why."""

    def call(self, command: Command) -> Any:
        """Run a control-plane command in the engine core; its result (the command's ``Result`` type).

        Raises:
            RequestRefusedError: the engine refused the command (an unknown adapter, a name taken, ...).

        """

    @property
    def engine_core(self) -> "EngineCore":
        """The engine core itself, when it runs in this process (tests and benchmarks look inside it).

        Raises:
            RuntimeError: it runs in a backend process.

        """


class OutputHandler(Protocol):
    """What an :class:`AsyncEngineClient` hands its backends' messages to, from its receiving task."""

    def on_step(self, deltas: list[SequenceDelta]) -> None:
        """A backend ran a step: these are its deltas."""

    def on_refused(self, request_id: str, error: RequestRefusedError) -> None:
        """A backend refused a request, or dropped it (its structured-output spec did not compile)."""

    def on_lost(self, request_ids: list[str], error: EngineDeadError) -> None:
        """A backend died with these requests in flight: they are gone."""

    def on_adopted(self) -> None:
        """A new backend took over from a dead one: the client's ``info`` may have changed."""


class AsyncEngineClient(EngineClient, Protocol):
    """An engine client that ``AsyncLLMEngine`` streams from: its backends' messages go to an :class:`OutputHandler`."""

    @property
    def is_dead(self) -> bool:
        """Whether no backend serves now (one is being brought back, or the client was closed)."""

    @property
    def num_restarts(self) -> int:
        """How many times a new backend took over from a dead one (over all backends)."""

    def attach(self, handler: OutputHandler) -> None:
        """Hand what the backends send from now on to ``handler``."""

    async def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests, all in one backend (several: an embedding batch).

        Raises:
            EngineDeadError: no backend serves (one is being brought back).

        """

    def pause_requests(self, request_ids: Sequence[str], resume: bool = False) -> None:
        """Schedule no tokens for requests until resumed, their blocks kept (``resume``: schedule them again).

        Unknown or ended ids are ignored, and so is a backend that is down (it holds no request).
        """

    async def call(self, command: Command) -> Any:
        """Run a control-plane command in the backends; its result (the command's ``Result`` type).

        Raises:
            RequestRefusedError: a backend refused the command.
            EngineDeadError: no backend serves, or one died before it answered.
            EngineUnavailableError: a backend did not answer within ``CALL_TIMEOUT`` seconds.

        """

    async def get_stats(self) -> EngineStats:
        """The backends' stats, added up, as of each one's next heartbeat or step.

        Raises:
            EngineDeadError: no backend serves.

        """

    def rank_stats(self) -> list[RankStats]:
        """Each backend's latest figures, one entry per backend."""

    def subscribe_kv_events(self, listener: KvListener | None) -> None:
        """Hand the backends' KV events to ``listener`` with each one's rank (``None``: the backends stop them)."""


def make_sync_client(
    config: EngineConfig, multiprocess: bool = False, backend_address: str | None = None
) -> SyncEngineClient:
    """The client an ``LLMEngine`` drives, built from ``config``.

    The backend at ``backend_address``, or a backend child process (``multiprocess``), or else an engine core in
    this process, whose host allocator it then sets as a backend process' (``bound_host_memory``).
    """
    if multiprocess or backend_address is not None:
        return SyncBackendClient(BackendConnection(backend_address, config))
    from spindle.backend.engine_core import EngineCore  # only the in-process engine needs torch
    from spindle.backend.memory import bound_host_memory

    bound_host_memory()
    return InProcessClient(EngineCore(config))


def make_async_client(
    config: EngineConfig,
    backend_address: str | None = None,
    data_parallel_size: int = 1,
    startup_timeout: float = 600.0,
) -> AsyncEngineClient:
    """The client an ``AsyncLLMEngine`` streams from: one backend, or several behind a data-parallel router.

    Args:
        config: the engine settings of the backends this starts.
        backend_address: the backend to connect to instead of starting one; a comma-separated list for one backend
            engine each, routed between.
        data_parallel_size: how many backends to start (each with its own KV cache); with addresses, 1 or their
            number.
        startup_timeout: seconds to wait for each backend's handshake (a first start may convert a GGUF file).

    Raises:
        ValueError: a size below 1, or other than 1 or the number of addresses.
        EngineDeadError: a backend exited or did not answer in time.
        RuntimeError: a backend refused the handshake (e.g. another protocol version).

    """
    addresses = [address.strip() for address in (backend_address or "").split(",") if address.strip()]
    if data_parallel_size < 1 or addresses and data_parallel_size not in (1, len(addresses)):
        raise ValueError(
            f"data_parallel_size={data_parallel_size} with {len(addresses)} backend addresses: give a size of at "
            "least 1, or one address per engine (the size then follows from them)"
        )
    size = len(addresses) or data_parallel_size
    if size == 1:
        address = addresses[0] if addresses else None
        return AsyncBackendClient(BackendConnection(address, config, use_asyncio=True, startup_timeout=startup_timeout))
    connections = connect_backends(config, size, addresses, startup_timeout)
    return DataParallelClient([AsyncBackendClient(connection) for connection in connections])
