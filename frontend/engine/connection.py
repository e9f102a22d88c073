"""The frontend's link to a backend process: start it (or connect to it), handshake, send, receive, watch it live.

A backend is alive while it answers: it sends a heartbeat every ``HEARTBEAT_INTERVAL`` seconds from its I/O thread,
so silence for ``HEARTBEAT_TIMEOUT`` seconds, or the exit of a backend we started, means it is dead. The heartbeats
also tell how long the backend's step loop has been in its current turn: past the backend's ``step_timeout`` the
loop is stuck (in a collective, or a kernel) though the I/O thread beats, and the backend counts as hung, which is as
dead. From then on every call raises :class:`EngineDeadError` (an asyncio client's
:class:`~spindle.frontend.engine.supervisor.ConnectionSupervisor` then brings a backend back on a new connection).
:func:`ping_backend` asks whether a backend is up without joining it. This module imports no torch.
"""

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from spindle.shared.config import EngineConfig, config_to_json, configured_log_format
from spindle.shared.errors import InvalidRequestError
from spindle.shared.model_registry import ModelRegistry
from spindle.shared.protocol import (
    FRONTEND_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    BackendMessage,
    Call,
    CallReply,
    EngineInfo,
    EngineRequest,
    FinishSequence,
    FrontendHeartbeat,
    Heartbeat,
    Hello,
    Pause,
    Ping,
    Pong,
    Ready,
    Refused,
    RequestError,
    RequestErrorKind,
    hung_reason,
)
from spindle.shared.transport import CurveKeys, load_keys, secure_client

logger = logging.getLogger(__name__)

CALL_TIMEOUT = 60.0
"""Seconds a frontend waits for the answer to a LoRA adapter call: the backend runs it between two steps, after
reading an adapter from disk, so a long prefill step comes first."""


class EngineDeadError(RuntimeError):
    """The backend process exited or stopped answering; requests in flight are lost and new ones fail fast."""


class BackendProcess(subprocess.Popen):
    """A backend child process started by :func:`start_backend`, which cleans up after itself.

    Once it is seen to have exited (:meth:`poll` or :meth:`wait` returns its exit code, whether it stopped or was
    killed), the temporary socket directory made for it is removed. If this process exits first without stopping
    it, an ``atexit`` hook does: SIGTERM, SIGKILL after ``EXIT_TIMEOUT`` seconds, then the directory.

    Attributes:
        socket_dir: the private temporary directory holding its ipc socket, or ``None`` for an address it was given.
        extra_env: the variables :func:`start_backend` set for it beside this process's environment (a backend
            started again in its place gets them too).

    """

    EXIT_TIMEOUT = 5.0

    def __init__(
        self,
        args: list[str],
        socket_dir: str | None = None,
        env: dict[str, str] | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.socket_dir = socket_dir
        self.extra_env = extra_env or {}
        self._exit_hook_registered = False
        super().__init__(args, env=env)
        atexit.register(self._stop_at_exit)
        self._exit_hook_registered = True

    def poll(self) -> int | None:
        """The exit code, or ``None`` while it runs; the first time it is known, the socket directory goes."""
        returncode = super().poll()
        if returncode is not None:
            self._exited()
        return returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit (``subprocess.TimeoutExpired`` after ``timeout``), then remove the socket directory."""
        returncode = super().wait(timeout)
        self._exited()
        return returncode

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (it drains in-flight requests for its grace period), SIGKILL after ``timeout``; the exit code."""
        if self.poll() is None:
            self.terminate()
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("The backend did not stop within %.0f s: killing it", timeout)
                self.kill()
        return self.wait()

    def _stop_at_exit(self) -> None:
        self._exit_hook_registered = False  # atexit is running it: nothing to unregister
        self.stop(self.EXIT_TIMEOUT)

    def _exited(self) -> None:
        if self._exit_hook_registered:
            self._exit_hook_registered = False
            atexit.unregister(self._stop_at_exit)  # also drops atexit's reference to this object
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def start_backend(
    config: EngineConfig, address: str | None = None, grace_period: float = 30.0, env: dict[str, str] | None = None
) -> tuple[BackendProcess, str]:
    """Start ``spindle backend`` as a child that dies with this process; returns it and its address.

    The child gets ``config`` whole, as JSON (:func:`~spindle.shared.config.config_to_json`), not as flags.
    Without an address it listens on an ipc socket in a new private (0700) temporary directory, which goes away
    with the backend (see :class:`BackendProcess`; the backend removes it too if this process is killed).
    ``grace_period`` is how long it lets in-flight requests finish after SIGTERM. It logs in the format this process
    was configured with (:func:`~spindle.shared.config.configure_logging`). The model classes registered in this
    process (:class:`~spindle.shared.model_registry.ModelRegistry`) go along as ``--register-model`` flags, and
    then this process's ``sys.path`` as the child's ``PYTHONPATH``, so that it imports their modules from where this
    process would (a script's folder, say). ``env`` adds variables to the child's environment (e.g. the
    ``CUDA_VISIBLE_DEVICES`` of one data-parallel engine).

    Call it from a thread that lives as long as the backend should (the main thread, or an event loop's): the
    backend's parent-death signal fires when the *thread* that started it ends.

    Raises:
        ValueError: a registered model class is one that another process cannot import
            (:meth:`~spindle.shared.model_registry.ModelRegistry.backend_args`).

    """
    registrations = ModelRegistry.backend_args()  # first: it raises for a class that the child cannot import
    socket_dir = None
    if address is None:
        socket_dir = tempfile.mkdtemp(prefix="spindle-")
        address = f"ipc://{socket_dir}/engine.sock"
    argv = [
        sys.executable,
        # -P: no working directory on sys.path. From a checkout its ``kernels/`` would shadow Hugging Face's
        # ``kernels`` (which transformers imports) in the backend and in every process it spawns.
        "-P",
        "-m",
        "spindle.backend.engine_process",
        "--listen",
        address,
        "--parent-pid",
        str(os.getpid()),
        "--grace-period",
        str(grace_period),
        "--engine-config",
        config_to_json(config),
    ]
    if socket_dir is not None:
        argv.append("--remove-socket-dir")
    log_format = configured_log_format()
    if log_format is not None:  # else the child reads SPINDLE_LOG_FORMAT from the environment it inherits
        argv += ["--log-format", log_format]
    child_env = {**os.environ, **env} if env else None
    if registrations:
        argv += registrations
        path = os.pathsep.join(dict.fromkeys(path for path in sys.path if path))
        child_env = {**(child_env or os.environ), "PYTHONPATH": path}
    try:
        process = BackendProcess(argv, socket_dir, child_env, env)
    except BaseException:
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)
        raise
    return process, address


class BackendConnection:
    """One DEALER socket to a backend, after a successful handshake (``info`` describes the engine).

    Args:
        address: the backend's ZeroMQ address; ``None`` starts a backend child process with ``config``.
        config: the engine settings for a backend this connection starts.
        use_asyncio: make :attr:`socket` an asyncio socket (for an ``AsyncBackendClient``).
        startup_timeout: seconds to wait for the handshake (a first start may convert a GGUF file).
        process: a backend child already started (by :func:`start_backend`) at ``address``, which this
            connection then owns as if it had started it.
        cancelled: polled during the handshake (e.g. a ``threading.Event``'s ``is_set``, set from another
            thread): once it returns true, the handshake gives up, and the connection closes itself and raises
            :class:`EngineDeadError`.

    Attributes:
        info: the engine's description from the handshake (model, limits, tokenizer files).
        socket: the DEALER socket (an asyncio socket with ``use_asyncio``).
        sync_socket: a blocking view of the same socket.
        process: the backend child this connection started (stopped, and its socket directory removed, by
            :meth:`close`), else ``None``.
        config: the engine settings a backend started for it had (to start another alike).
        startup_timeout: the handshake's time limit.

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
        *,
        process: BackendProcess | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.startup_timeout = startup_timeout
        self.process = process
        if address is None:
            self.process, address = start_backend(self.config)
        self.address = address
        self._closed = False
        self._cancelled = cancelled or (lambda: False)
        self.keys: CurveKeys | None = load_keys(self.config.backend.zmq_secret_file)
        self.context = zmq.asyncio.Context() if use_asyncio else zmq.Context()
        self.frontend_id = uuid.uuid4().hex.encode()
        self.socket = self.context.socket(zmq.DEALER)
        secure_client(self.socket, self.keys)
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
        self.busy_for = 0.0  # how long the backend's step loop had been in its turn, by its latest heartbeat
        self.dead: EngineDeadError | None = None
        self._stop_heartbeats = threading.Event()
        self._heartbeats = threading.Thread(target=self._send_heartbeats, name="spindle-heartbeat", daemon=True)
        self.info = self._handshake(startup_timeout)
        self._heartbeats.start()

    def _send_heartbeats(self) -> None:
        # A socket of its own, so this thread never shares one with the caller's thread.
        socket = zmq.Context.instance().socket(zmq.DEALER)
        secure_client(socket, self.keys)
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
            if self._cancelled():
                self.close()
                raise EngineDeadError(f"gave up the handshake with the backend at {self.address}")
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
        hint = "" if self.keys is not None else " (one that requires a ZeroMQ secret ignores a frontend without it)"
        raise EngineDeadError(f"no answer from a backend at {self.address} within {timeout:.0f} s{hint}")

    def send(self, message: AddRequest | Abort | FinishSequence | Pause | Call) -> None:
        """Queue a message for the backend (never blocks)."""
        self._send(self.encoder.encode(message))

    def _send(self, data: bytes) -> None:
        self.check_alive()
        # Through the socket itself, not the blocking view: an asyncio socket must see its own sends, or it misses
        # the edge-triggered readiness of the replies.
        self.socket.send(data, zmq.NOBLOCK)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request in the backend.

        Raises:
            InvalidRequestError: the request is larger than the backend takes (``max_message_size``: field
                ``prompt``), which would disconnect this frontend and lose the request.

        """
        data = self.encoder.encode(AddRequest(request))
        limit = self.info.max_message_size
        if limit is not None and len(data) > limit:
            raise InvalidRequestError(
                "prompt",
                f"the request takes {len(data)} bytes, more than the backend's max_message_size of {limit}: "
                "send fewer or smaller images, or a shorter prompt",
            )
        self._send(data)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests in the backend; their blocks are freed there."""
        if request_ids and self.dead is None:
            self.send(Abort(request_ids))

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion in the backend (a stop string matched)."""
        if self.dead is None:
            self.send(FinishSequence(request_id, index))

    def pause_requests(self, request_ids: list[str], resume: bool = False) -> None:
        """Stop scheduling requests in the backend (their blocks stay), or with ``resume`` schedule them again."""
        if request_ids and self.dead is None:
            self.send(Pause(request_ids, resume))

    def decode(self, payload: bytes) -> BackendMessage:
        """Decode one message from the backend; any message proves it alive, a heartbeat says how its step loop is."""
        self.last_heard = time.monotonic()
        message = self.decoder.decode(payload)
        if isinstance(message, Heartbeat):
            self.busy_for = message.busy_for
        error = message.error if isinstance(message, CallReply) else message
        if isinstance(error, RequestError) and error.kind is RequestErrorKind.NO_SESSION and self.dead is None:
            # Its refusals would otherwise keep the connection looking alive while every request fails.
            self.dead = EngineDeadError(
                f"the backend at {self.address} no longer has a session with this frontend (this process was silent "
                f"for more than {FRONTEND_TIMEOUT:g} s, or the backend restarted): its requests there are gone"
            )
        return message

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if the backend exited, has been silent too long, or its step loop is stuck."""
        if self.dead is None:
            if self.process is not None and self.process.poll() is not None:
                self.dead = EngineDeadError(f"the backend process exited with code {self.process.returncode}")
            # Messages still waiting in the socket prove life too: the caller may just not have been reading.
            elif time.monotonic() - self.last_heard > HEARTBEAT_TIMEOUT and not self.sync_socket.poll(0):
                self.dead = EngineDeadError(f"the backend at {self.address} has not answered for {HEARTBEAT_TIMEOUT} s")
            elif (hung := hung_reason(self.busy_for, self.info.step_timeout)) is not None:
                self.dead = EngineDeadError(f"the backend at {self.address} is hung: {hung}")
        if self.dead is not None:
            raise self.dead

    def close(self, timeout: float = 30.0) -> None:
        """Close the socket and stop a backend this connection started; a second call does nothing.

        A live backend gets SIGTERM (it drains), then SIGKILL after ``timeout``; a dead one (``dead`` is set,
        e.g. it stopped answering: hung, or SIGSTOPped) gets SIGKILL at once, as it has nothing left to finish.
        """
        if self._closed:
            return
        self._closed = True
        self._stop_heartbeats.set()
        if self._heartbeats.is_alive():
            self._heartbeats.join()
        self.socket.close(linger=0)
        self.context.term()
        if self.process is not None:
            if self.dead is not None:
                self.process.kill()
                self.process.wait()
            else:
                self.process.stop(timeout)


def ping_backend(address: str, timeout: float = 5.0, secret_file: str | None = None) -> Pong:
    """Ask the backend at ``address`` whether it is up (a :class:`~spindle.shared.protocol.Ping`); its answer.

    The backend's I/O thread answers from outside any frontend session, so probing a backend that serves a frontend
    changes nothing for it; it also answers while a long step runs (the answer says how long its step loop has been
    in that step). ``secret_file`` is the backend's ``zmq_secret_file``, if it has one.

    Raises:
        EngineDeadError: no answer within ``timeout`` seconds.
        zmq.ZMQError: ``address`` is not a ZeroMQ address.

    """
    context = zmq.Context()
    try:
        socket = context.socket(zmq.DEALER)
        secure_client(socket, load_keys(secret_file))
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(BackendMessage)
        socket.send(encoder.encode(Ping()))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if socket.poll(left * 1000):
                try:
                    message = decoder.decode(socket.recv())
                except msgspec.DecodeError:
                    continue  # not a Spindle backend of this version: keep waiting, then report no answer
                if isinstance(message, Pong):
                    return message
        raise EngineDeadError(f"no backend answered at {address} within {timeout:g} s")
    finally:
        context.destroy(linger=0)
