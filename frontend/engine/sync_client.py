"""``SyncBackendClient``: the engine core in a backend process, for ``LLMEngine``'s blocking steps."""

import collections
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spindle.frontend.engine.connection import CALL_TIMEOUT, BackendConnection
from spindle.shared.errors import EngineUnavailableError, RequestRefusedError
from spindle.shared.protocol import (
    Call,
    CallReply,
    Command,
    EngineInfo,
    EngineRequest,
    RequestError,
    SequenceDelta,
    StepOutputs,
    decode_result,
)

if TYPE_CHECKING:
    from spindle.backend.engine_core import EngineCore


class SyncBackendClient:
    """The engine core in a backend process, from a blocking caller: :meth:`step` waits for the backend's next step.

    ``LLMEngine(..., multiprocess=True)`` (or with a ``backend_address``) uses it. A request the backend refuses is
    kept for :meth:`pop_refused`, as an in-process core keeps the requests it drops.

    Args:
        connection: the connection to the backend, after its handshake.

    """

    def __init__(self, connection: BackendConnection) -> None:
        self.connection = connection
        self.refused: list[tuple[str, RequestRefusedError]] = []
        # Steps that came while waiting for the answer to an adapter call, for the next step() calls.
        self.pending_steps: collections.deque[list[SequenceDelta]] = collections.deque()

    @property
    def info(self) -> EngineInfo:
        """The engine's description, from the handshake."""
        return self.connection.info

    @property
    def engine_core(self) -> "EngineCore":
        """Never here: the engine core runs in the backend process (:class:`RuntimeError`)."""
        raise RuntimeError("the engine core runs in a backend process, not in this one")

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request in the backend."""
        self.connection.add_request(request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests in the backend."""
        self.connection.abort_requests(list(request_ids))

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion in the backend."""
        self.connection.finish_sequence(request_id, index)

    def call(self, command: Command) -> Any:
        """Run a control-plane command in the backend and wait for its result, keeping the steps that come first."""
        call = Call(uuid.uuid4().hex, command)
        self.connection.send(call)
        deadline = time.monotonic() + CALL_TIMEOUT
        while time.monotonic() < deadline:
            reply = self._receive()
            if isinstance(reply, CallReply) and reply.call_id == call.call_id:
                return decode_result(command, reply)
            if isinstance(reply, list) and reply:  # a late reply to a call that timed out is dropped
                self.pending_steps.append(reply)
        raise EngineUnavailableError(f"the backend did not answer a {type(command).__name__} within {CALL_TIMEOUT:g} s")

    def step(self) -> list[SequenceDelta]:
        """Wait for the backend's next step and return its deltas ([] after a heartbeat or a refusal).

        A request the backend refused (invalid, or it is shutting down) is kept for :meth:`pop_refused`.

        Raises:
            EngineDeadError: the backend died.

        """
        if self.pending_steps:
            return self.pending_steps.popleft()
        while True:
            received = self._receive()
            if received is not None:
                return [] if isinstance(received, CallReply) else received

    def _receive(self) -> list[SequenceDelta] | CallReply | None:
        """The next message from the backend, within 0.1 s (else ``None``): a step's deltas, or an adapter call's reply.

        A heartbeat or a refusal gives ``[]``; the refusal is kept for :meth:`pop_refused`.
        """
        self.connection.check_alive()
        if not self.connection.sync_socket.poll(100):
            return None
        message = self.connection.decode(self.connection.sync_socket.recv())
        if isinstance(message, StepOutputs):
            return message.deltas
        if isinstance(message, CallReply):
            return message
        if isinstance(message, RequestError):
            self.refused.append((message.request_id, message.to_exception()))
        return []

    def pop_refused(self) -> list[tuple[str, RequestRefusedError]]:
        """The requests the backend refused since the last call (as an in-process core reports those it drops)."""
        refused, self.refused = self.refused, []
        return refused

    def close(self) -> None:
        """Stop the backend (if this process started it)."""
        self.connection.close()
