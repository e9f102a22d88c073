"""The engine clients: how an engine reaches its engine core, in this process or in backend processes.

Every client offers :class:`EngineClient`'s methods; ``LLMEngine`` drives a :class:`SyncEngineClient` one step at a
time:

* :class:`~spindle.frontend.inprocess_client.InProcessClient`: an engine core in this process (imports torch);
* :class:`~spindle.frontend.sync_client.SyncBackendClient`: a backend process, whose next step it waits for.

:func:`make_sync_client` picks one.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from spindle.frontend.core_client import BackendConnection
from spindle.frontend.inprocess_client import InProcessClient
from spindle.frontend.sync_client import SyncBackendClient
from spindle.shared.config import EngineConfig
from spindle.shared.errors import RequestRefusedError
from spindle.shared.protocol import Command, EngineInfo, EngineRequest, SequenceDelta

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


def make_sync_client(
    config: EngineConfig, multiprocess: bool = False, backend_address: str | None = None
) -> SyncEngineClient:
    """The client an ``LLMEngine`` drives, built from ``config``.

    The backend at ``backend_address``, or a backend child process (``multiprocess``), or else an engine core in
    this process.
    """
    if multiprocess or backend_address is not None:
        return SyncBackendClient(BackendConnection(backend_address, config))
    from spindle.backend.engine_core import EngineCore  # only the in-process engine needs torch

    return InProcessClient(EngineCore(config))
