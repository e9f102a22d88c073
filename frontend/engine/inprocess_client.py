"""``InProcessClient``: the engine core in this process, behind the engine client methods."""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spindle.shared.errors import RequestRefusedError
from spindle.shared.protocol import Command, EngineInfo, EngineRequest, SequenceDelta

if TYPE_CHECKING:
    from spindle.backend.engine_core import EngineCore


class InProcessClient:
    """An :class:`~spindle.backend.engine_core.EngineCore` that runs in this process (``LLMEngine``'s default).

    Each :meth:`step` runs one step of the core, here; a request the core refuses raises from :meth:`add_request`.

    Args:
        core: the engine core.

    """

    def __init__(self, core: "EngineCore") -> None:
        self.core = core

    @property
    def info(self) -> EngineInfo:
        """The engine's description."""
        return self.core.info

    @property
    def engine_core(self) -> "EngineCore":
        """The engine core."""
        return self.core

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request in the core (:class:`~spindle.shared.errors.InvalidRequestError` if it refuses it)."""
        self.core.add_request(request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests; their blocks are freed at once."""
        self.core.abort_requests(list(request_ids))

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion (a stop string matched)."""
        self.core.finish_sequence(request_id, index)

    def step(self) -> list[SequenceDelta]:
        """Run one step of the core; its deltas."""
        return self.core.step()

    def pop_refused(self) -> list[tuple[str, RequestRefusedError]]:
        """The requests the core dropped since the last call (their structured-output spec did not compile)."""
        return self.core.pop_refused()

    def call(self, command: Command) -> Any:
        """Run a control-plane command in the core."""
        return self.core.call(command)

    def close(self) -> None:
        """Stop the core's tensor-parallel workers, if it has any."""
        self.core.close()
