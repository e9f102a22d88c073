"""The frontend's link to a backend process: start it (or connect to it), handshake, send, receive, watch it live.

A backend is alive while it answers: it sends a heartbeat every ``HEARTBEAT_INTERVAL`` seconds from its I/O thread,
so silence for ``HEARTBEAT_TIMEOUT`` seconds, or the exit of a backend we started, means it is dead, and every
call raises :class:`EngineDeadError` from then on. This module imports no torch.
"""

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from spindle.shared.config import EngineConfig, config_to_argv
from spindle.shared.protocol import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    BackendMessage,
    EngineInfo,
    EngineRequest,
    FinishSequence,
    FrontendHeartbeat,
    Hello,
    Ready,
    Refused,
    RequestError,
    SequenceDelta,
    StepOutputs,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The backend process exited or stopped answering; requests in flight are lost and new ones fail fast."""


def start_backend(
    config: EngineConfig, address: str | None = None, grace_period: float = 30.0
) -> tuple[subprocess.Popen, str]:
    """Start ``spindle backend`` as a child that dies with this process; returns it and its address.

    Without an address it listens on an ipc socket in a new private (0700) temporary directory. ``grace_period``
    is how long it lets in-flight requests finish after SIGTERM.
    """
    if address is None:
        address = f"ipc://{tempfile.mkdtemp(prefix='spindle-')}/engine.sock"
    argv = [
        sys.executable,
        "-m",
        "spindle.backend.engine_process",
        "--listen",
        address,
        "--parent-pid",
        str(os.getpid()),
    ]
    argv += ["--grace-period", str(grace_period)]
    process = subprocess.Popen([*argv, *config_to_argv(config)])
    return process, address


class BackendConnection:
    """One DEALER socket to a backend, after a successful handshake (``info`` describes the engine).

    Args:
        address: the backend's ZeroMQ address; ``None`` starts a backend child process with ``config``.
        config: the engine settings for a backend this connection starts.
        use_asyncio: make :attr:`socket` an asyncio socket (for ``AsyncLLMEngine``).
        startup_timeout: seconds to wait for the handshake (a first start may convert a GGUF file).

    Attributes:
        info: the engine's description from the handshake (model, limits, tokenizer files).
        socket: the DEALER socket (an asyncio socket with ``use_asyncio``).
        sync_socket: a blocking view of the same socket.
        process: the backend child this connection started, else ``None``.

    Raises:
        EngineDeadError: the backend exited or did not answer in time.
        RuntimeError: the backend refused the handshake (e.g. another protocol version).

    """

    def __init__(
        self,
        address: str | None,
        config: EngineConfig | None = None,
        use_asyncio: bool = False,
        startup_timeout: float = 600.0,
    ) -> None:
        self.process: subprocess.Popen | None = None
        if address is None:
            self.process, address = start_backend(config or EngineConfig())
        self.address = address
        self.context = zmq.asyncio.Context() if use_asyncio else zmq.Context()
        self.frontend_id = uuid.uuid4().hex.encode()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, self.frontend_id)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        # A blocking view of the same socket, for the handshake (and every receive of a synchronous client).
        self.sync_socket = zmq.Socket.shadow(self.socket.underlying) if use_asyncio else self.socket
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(BackendMessage)
        self.last_heard = time.monotonic()
        self.dead: EngineDeadError | None = None
        self._stop_heartbeats = threading.Event()
        self._heartbeats = threading.Thread(target=self._send_heartbeats, name="spindle-heartbeat", daemon=True)
        self.info = self._handshake(startup_timeout)
        self._heartbeats.start()

    def _send_heartbeats(self) -> None:
        # A socket of its own, so this thread never shares one with the caller's thread.
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        heartbeat = self.encoder.encode(FrontendHeartbeat(self.frontend_id))
        while not self._stop_heartbeats.wait(HEARTBEAT_INTERVAL):
            socket.send(heartbeat, zmq.NOBLOCK)
        socket.close()

    def _handshake(self, timeout: float) -> EngineInfo:
        self.sync_socket.send(self.encoder.encode(Hello(PROTOCOL_VERSION)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sync_socket.poll(100):
                message = self.decode(self.sync_socket.recv())
                if isinstance(message, Ready):
                    return message.info
                if isinstance(message, Refused):
                    self.close()
                    raise RuntimeError(f"the backend at {self.address} refused this frontend: {message.reason}")
            elif self.process is not None and self.process.poll() is not None:
                self.close()
                raise EngineDeadError(f"the backend process exited with code {self.process.returncode} while starting")
        self.close()
        raise EngineDeadError(f"no answer from a backend at {self.address} within {timeout:.0f} s")

    def send(self, message: AddRequest | Abort | FinishSequence) -> None:
        """Queue a message for the backend (never blocks)."""
        self.check_alive()
        # Through the socket itself, not the blocking view: an asyncio socket must see its own sends, or it misses
        # the edge-triggered readiness of the replies.
        self.socket.send(self.encoder.encode(message), zmq.NOBLOCK)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request in the backend."""
        self.send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the backend; their blocks are freed there."""
        if request_ids and self.dead is None:
            self.send(Abort(request_ids))

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion in the backend (a stop string matched)."""
        if self.dead is None:
            self.send(FinishSequence(request_id, index))

    def decode(self, payload: bytes) -> BackendMessage:
        """Decode one message from the backend; any message proves it alive."""
        self.last_heard = time.monotonic()
        return self.decoder.decode(payload)

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if the backend exited or has been silent too long."""
        if self.dead is None:
            if self.process is not None and self.process.poll() is not None:
                self.dead = EngineDeadError(f"the backend process exited with code {self.process.returncode}")
            # Messages still waiting in the socket prove life too: the caller may just not have been reading.
            elif time.monotonic() - self.last_heard > HEARTBEAT_TIMEOUT and not self.sync_socket.poll(0):
                self.dead = EngineDeadError(f"the backend at {self.address} has not answered for {HEARTBEAT_TIMEOUT} s")
        if self.dead is not None:
            raise self.dead

    def close(self, timeout: float = 30.0) -> None:
        """Close the socket and stop a backend this connection started (SIGTERM, then SIGKILL after ``timeout``)."""
        self._stop_heartbeats.set()
        if self._heartbeats.is_alive():
            self._heartbeats.join()
        self.socket.close(linger=0)
        self.context.term()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("The backend did not stop within %.0f s: killing it", timeout)
                self.process.kill()
                self.process.wait()


class SyncCoreClient:
    """The engine core in a backend process, behind the same methods as an in-process ``EngineCore``.

    ``LLMEngine(..., multiprocess=True)`` uses it: :meth:`step` returns the deltas of the backend's next step.
    """

    def __init__(self, connection: BackendConnection) -> None:
        self.connection = connection
        self.info = connection.info

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request in the backend."""
        self.connection.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the backend."""
        self.connection.abort_requests(request_ids)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion in the backend."""
        self.connection.finish_sequence(request_id, index)

    def step(self) -> list[SequenceDelta]:
        """Wait for the backend's next step and return its deltas ([] after a heartbeat with nothing new).

        Raises:
            ValueError: the backend refused a request.
            EngineDeadError: the backend died.

        """
        while True:
            self.connection.check_alive()
            if not self.connection.sync_socket.poll(100):
                continue
            message = self.connection.decode(self.connection.sync_socket.recv())
            if isinstance(message, StepOutputs):
                return message.deltas
            if isinstance(message, RequestError):
                raise ValueError(f"request {message.request_id!r}: {message.message}")
            return []

    def close(self) -> None:
        """Stop the backend (if this process started it)."""
        self.connection.close()
