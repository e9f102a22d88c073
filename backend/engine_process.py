"""The backend process: the engine core in a busy loop, with socket I/O and (de)serialization in their own thread.

One ROUTER socket serves every frontend (a DEALER each). The I/O thread owns it: it decodes incoming messages into
a queue, answers handshakes and probes' pings, sends the heartbeats, and encodes and sends the step outputs the loop
hands it. A frontend may come back at any time with a new handshake (after it lost this backend, or this backend
restarted): each handshake starts a session of its own. The
loop never touches the socket, so it never waits on a slow frontend: it drains the queue, runs ``step()`` and
passes one :class:`~spindle.shared.protocol.StepOutputs` per frontend to the I/O thread, and after each turn it
publishes the engine's :class:`~spindle.shared.protocol.EngineStats`. Besides those, the I/O thread reads only when
the loop's current turn began (``busy_since``), so that its heartbeats and pongs tell how long the loop has been in
one turn: a loop stuck in a step (a collective that never completes, a kernel that never returns) shows there while
the I/O thread still beats, and the frontends declare the backend hung after ``step_timeout`` seconds.
Control-plane calls (:class:`~spindle.shared.protocol.Call`: loading LoRA adapters and the like) come through the
same queue and run between two steps, so nothing changes under a running batch; their replies go to the
frontend that asked. A frontend that subscribes to the prefix cache's events
(:class:`~spindle.shared.protocol.SubscribeKvEvents`) gets each turn's events with its step outputs, in a
:class:`~spindle.shared.protocol.StepOutputs` of its own when none of its requests ran; while no frontend subscribes,
the block manager builds none.
"""

import argparse
import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import msgspec
import zmq

from spindle.backend.engine_core import EngineCore, context_length
from spindle.backend.memory import bound_host_memory
from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.loader import resolve_model
from spindle.backend.parent_death import die_with_parent
from spindle.backend.worker import serve_node
from spindle.shared.config import (
    EngineConfig,
    add_backend_args,
    config_from_args,
    config_from_json,
    configure_logging,
)
from spindle.shared.errors import EngineUnavailableError, RequestRefusedError
from spindle.shared.gc_heap import freeze_startup_heap
from spindle.shared.model_registry import ModelRegistry, add_register_model_args
from spindle.shared.protocol import (
    FRONTEND_TIMEOUT,
    HEARTBEAT_INTERVAL,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    Call,
    CallReply,
    Command,
    EngineStats,
    FinishSequence,
    FrontendHeartbeat,
    FrontendMessage,
    Heartbeat,
    Hello,
    KvEvent,
    LoadLora,
    Pause,
    Ping,
    Pong,
    Ready,
    Refused,
    RequestError,
    RequestErrorKind,
    SequenceDelta,
    StepOutputs,
    SubscribeKvEvents,
)
from spindle.shared.transport import CurveKeys, authenticate, is_loopback, load_keys, secure_server

# Named, not __name__: run as `python -m`, this module is __main__, and its log lines would say so.
logger = logging.getLogger("spindle.backend.engine_process")

_WAKE_ADDRESS = "inproc://spindle-outputs"


class _FrontendGone(msgspec.Struct):
    """Internal: a frontend has been silent for ``FRONTEND_TIMEOUT`` seconds."""


def prepare_address(address: str, secured: bool = False) -> str:
    """Check a ZeroMQ address, creating an ipc socket's directory with mode 0700.

    Only ``ipc://`` and ``tcp://`` are accepted; ``tcp://0.0.0.0`` and ``tcp://*`` expose the engine to the network,
    so they must be asked for by name with ``SPINDLE_ALLOW_PUBLIC_BIND=1``. A TCP address beyond loopback is
    refused unless the socket is ``secured`` (``zmq_secret_file``): anyone who reaches it could submit and abort
    requests.
    """
    if address.startswith("ipc://"):
        directory = Path(address.removeprefix("ipc://")).parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if directory.stat().st_mode & 0o077:
            if directory.stat().st_uid != os.getuid():
                raise PermissionError(f"{directory} is open to other users and not ours to close: use a private dir")
            directory.chmod(0o700)
        return address
    if address.startswith("tcp://"):
        host = address.removeprefix("tcp://").rsplit(":", 1)[0]
        if host in ("0.0.0.0", "*", "[::]") and os.environ.get("SPINDLE_ALLOW_PUBLIC_BIND") != "1":
            raise ValueError(f"{address} listens on every interface; set SPINDLE_ALLOW_PUBLIC_BIND=1 if you mean it")
        if not secured and not is_loopback(address):
            raise ValueError(
                f"{address} can be reached from other machines: set zmq_secret_file (--zmq-secret-file) so that "
                "only the frontends that hold the secret may talk to this backend"
            )
        return address
    raise ValueError(f"{address!r} is not a ZeroMQ address: use ipc:///path/engine.sock or tcp://127.0.0.1:PORT")


def remove_socket_dir(address: str) -> None:
    """Remove an ipc socket's directory if it is empty (``--remove-socket-dir``: the frontend made it for us).

    A directory that still holds anything, such as another backend's socket, is left alone.
    """
    if address.startswith("ipc://"):
        with contextlib.suppress(OSError):  # not empty, or already gone
            Path(address.removeprefix("ipc://")).parent.rmdir()


class EngineProcess:
    """Runs :class:`EngineCore` for the frontends connected to ``address`` until SIGTERM or SIGINT.

    On SIGTERM it stops accepting requests, lets the in-flight ones finish for up to ``grace_period`` seconds (paused
    ones too: it resumes them, and pauses none while it drains), aborts what is left (the frontends see
    ``FinishReason.ABORT``) and returns.

    The socket takes messages of up to ``max_message_size`` bytes (a peer that sends more is disconnected) and, with
    a ``zmq_secret_file``, only from peers that hold the secret (:mod:`spindle.shared.transport`). A frontend aborts,
    finishes and pauses only its own requests. The LoRA adapters a frontend loads come from ``lora_dir``
    (:class:`~spindle.shared.protocol.LoadLora` ``confined``), whatever the frontend asks, unless
    ``trust_frontends``: a backend that a frontend started as its child, on a private ipc socket, serves that
    frontend's user, who may load any path.
    """

    def __init__(
        self, config: EngineConfig, address: str, grace_period: float = 30.0, trust_frontends: bool = False
    ) -> None:
        self.keys: CurveKeys | None = load_keys(config.backend.zmq_secret_file)
        self.address = prepare_address(address, secured=self.keys is not None)
        self.max_message_size = config.backend.max_message_size
        self.trust_frontends = trust_frontends
        self.core = EngineCore(config, on_worker_death=_die)
        self.info = self.core.info
        self.grace_period = grace_period
        self.inputs: queue.Queue[tuple[bytes, object]] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, StepOutputs | RequestError | CallReply]] = queue.Queue()
        self.wake: zmq.Socket | None = None  # the busy loop's end of the wake-up pipe, once it runs
        self.owners: dict[str, bytes] = {}  # request id -> frontend identity
        self.kv_subscribers: set[bytes] = set()  # the frontends that get the prefix cache's events
        # The engine's state as of the last step, published by the busy loop: the I/O thread reads only this and
        # busy_since.
        self.stats: EngineStats = self.core.stats()
        # When the busy loop's current turn began (monotonic), or None while it waits for work.
        self.busy_since: float | None = None
        self.draining_since: float | None = None
        self.context = zmq.Context()
        self.stop_io = False
        self.io_ready = threading.Event()
        self.io_thread = threading.Thread(target=self._io_loop, name="spindle-io", daemon=True)
        self.socket_file: tuple[Path, tuple[int, int]] | None = None  # an ipc socket we bound, (device, inode)

    def run(self) -> None:
        """The busy loop: drain inputs, step, hand outputs to the I/O thread; returns once drained after SIGTERM."""
        self.io_thread.start()
        self.io_ready.wait()
        if not self.io_thread.is_alive():
            raise RuntimeError(f"the I/O thread could not start on {self.address} (see the error above)")
        wake = self.wake = self.context.socket(zmq.PUSH)
        wake.connect(_WAKE_ADDRESS)
        logger.info("Engine ready on %s", self.address)
        try:
            while True:
                if not self.io_thread.is_alive():
                    raise RuntimeError("the I/O thread died (see the error above)")
                idle = not self.core.has_unfinished_requests()
                if self.draining_since is not None and (
                    idle or time.monotonic() - self.draining_since > self.grace_period
                ):
                    break
                if self.draining_since is not None:
                    # The grace period is all a request has left to finish in: a paused one must run too.
                    self.core.pause_requests(list(self.owners), resume=True)
                # Paused requests alone give a step nothing to do: wait for messages as when idle.
                waiting = not self.core.has_unpaused_requests()
                self.busy_since = None if waiting else time.monotonic()
                self._drain_inputs(block=waiting)
                deltas = self.core.step() if self.core.has_unfinished_requests() else []
                self.stats = self.core.stats()
                self._send_by_owner(deltas, wake, self.core.pop_kv_events())
                self._send_refusals(wake)
            self._abort_all(wake)
        finally:
            self.core.close()
            wake.close(linger=0)
            self.stop_io = True
            self.io_thread.join(timeout=2)
            self.context.term()
            self._unlink_socket_file()

    def _unlink_socket_file(self) -> None:
        """Remove the ipc socket file this process bound (ZeroMQ leaves it), unless another bind replaced it since."""
        if self.socket_file is not None:
            path, identity = self.socket_file
            with contextlib.suppress(FileNotFoundError):
                status = path.stat()
                if (status.st_dev, status.st_ino) == identity:
                    path.unlink()

    def drain(self, *_: object) -> None:
        """Start the graceful shutdown (the SIGTERM handler)."""
        if self.draining_since is None:
            logger.info("Draining: finishing in-flight requests for up to %.2f s", self.grace_period)
            self.draining_since = time.monotonic()

    def _drain_inputs(self, block: bool) -> None:
        try:
            identity, message = self.inputs.get(timeout=HEARTBEAT_INTERVAL) if block else self.inputs.get_nowait()
        except queue.Empty:
            return
        if block:  # work came: the turn begins
            self.busy_since = time.monotonic()
        while True:
            self._handle(identity, message)
            try:
                identity, message = self.inputs.get_nowait()
            except queue.Empty:
                return

    def _handle(self, identity: bytes, message: object) -> None:
        match message:
            case AddRequest(request=request):
                try:
                    if self.draining_since is not None:
                        raise EngineUnavailableError("the engine is shutting down: retry on another replica")
                    self.core.add_request(request)
                except RequestRefusedError as error:
                    logger.info("Refused request: %s", error, extra={"request_id": request.request_id})
                    self.outputs.put((identity, RequestError.from_exception(request.request_id, error)))
                    return
                self.owners[request.request_id] = identity
            case Abort(request_ids=request_ids):
                owned = [request_id for request_id in request_ids if self.owners.get(request_id) == identity]
                self.core.abort_requests(owned)
                for request_id in owned:
                    del self.owners[request_id]
            case FinishSequence(request_id=request_id, index=index) if self.owners.get(request_id) == identity:
                self.core.finish_sequence(request_id, index)
                if not self.core.has_request(request_id):
                    self.owners.pop(request_id, None)
            case Pause(request_ids=request_ids, resume=resume) if self.draining_since is None:
                owned = [request_id for request_id in request_ids if self.owners.get(request_id) == identity]
                self.core.pause_requests(owned, resume)
            case Call(call_id=call_id, command=command):
                self._answer(identity, call_id, command)
            case SubscribeKvEvents(subscribe=subscribe):
                # Each new subscriber gets the cache's snapshot; those subscribed already see it as a resync.
                if subscribe:
                    self.kv_subscribers.add(identity)
                else:
                    self.kv_subscribers.discard(identity)
                self.core.record_kv_events(bool(self.kv_subscribers))
            case _FrontendGone():
                if identity in self.kv_subscribers:
                    self.kv_subscribers.discard(identity)
                    self.core.record_kv_events(bool(self.kv_subscribers))
                lost = [request_id for request_id, owner in self.owners.items() if owner == identity]
                if lost:
                    logger.warning("A frontend disconnected: aborting its %d request(s)", len(lost))
                for request_id in lost:
                    logger.info("Aborted request: its frontend disconnected", extra={"request_id": request_id})
                self.core.abort_requests(lost)
                for request_id in lost:
                    del self.owners[request_id]

    def _answer(self, identity: bytes, call_id: str, command: Command) -> None:
        """Run one control-plane command and send its :class:`CallReply` (the result, or why it was refused) at once."""
        if isinstance(command, LoadLora) and not self.trust_frontends:
            command = msgspec.structs.replace(command, confined=True)  # this backend's policy, not the peer's word
        try:
            reply = CallReply(call_id, msgspec.msgpack.encode(self.core.call(command)))
        except RequestRefusedError as error:
            logger.info("Refused a %s call: %s", type(command).__name__, error)
            reply = CallReply(call_id, error=RequestError.from_exception(call_id, error))
        self.outputs.put((identity, reply))
        if self.wake is not None:  # else the I/O thread finds it within half a heartbeat interval
            self.wake.send(b"", zmq.NOBLOCK)

    def _send_by_owner(
        self, deltas: list[SequenceDelta], wake: zmq.Socket, kv_events: list[KvEvent] | None = None
    ) -> None:
        by_owner: dict[bytes, list[SequenceDelta]] = {}
        if kv_events:
            by_owner = {subscriber: [] for subscriber in self.kv_subscribers}
        for delta in deltas:
            owner = self.owners.get(delta.request_id)
            if owner is not None:
                by_owner.setdefault(owner, []).append(delta)
        # Only now: the n completions of a request may all finish in this one step.
        for delta in deltas:
            if not self.core.has_request(delta.request_id):
                self.owners.pop(delta.request_id, None)
        if by_owner:
            stats = self.stats
            for owner, owner_deltas in by_owner.items():
                events = kv_events if kv_events and owner in self.kv_subscribers else []
                self.outputs.put((owner, StepOutputs(owner_deltas, stats, events)))
            wake.send(b"", zmq.NOBLOCK)

    def _send_refusals(self, wake: zmq.Socket) -> None:
        """Tell the owners of the requests the core dropped (their grammar did not compile) why."""
        refused = self.core.pop_refused()
        for request_id, error in refused:
            owner = self.owners.pop(request_id, None)
            if owner is not None:
                self.outputs.put((owner, RequestError.from_exception(request_id, error)))
        if refused:
            wake.send(b"", zmq.NOBLOCK)

    def _abort_all(self, wake: zmq.Socket) -> None:
        """Abort what is still in flight, telling each owner, before the process exits."""
        for request_id in list(self.owners):
            logger.info("Aborted request: unfinished at the end of the grace period", extra={"request_id": request_id})
        self._send_by_owner(self.core.abort_all(), wake)
        self.outputs.join()  # the I/O thread has sent everything before the socket closes

    def _io_loop(self) -> None:
        try:
            self._serve_socket()
        finally:
            self.io_ready.set()  # never leave run() waiting on a thread that failed to start

    def _serve_socket(self) -> None:
        authenticator = None if self.keys is None else authenticate(self.context, self.keys)
        try:
            self._serve_router()
        finally:
            if authenticator is not None:
                authenticator.stop()

    def _serve_router(self) -> None:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, 0)  # never drop outputs for a slow frontend: zmq buffers them
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.MAXMSGSIZE, self.max_message_size)
        if self.keys is not None:
            secure_server(router, self.keys)
        router.bind(self.address)
        path = Path(self.address.removeprefix("ipc://"))
        if self.address.startswith("ipc://") and path.is_socket():  # not an abstract (ipc://@name) socket
            status = path.stat()
            self.socket_file = path, (status.st_dev, status.st_ino)
        wake = self.context.socket(zmq.PULL)
        wake.bind(_WAKE_ADDRESS)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        encoder = msgspec.msgpack.Encoder()
        decoder = msgspec.msgpack.Decoder(FrontendMessage)
        frontends: dict[bytes, float] = {}  # identity -> when last heard
        ready = encoder.encode(Ready(PROTOCOL_VERSION, self.info))
        # A request from a frontend without a session here (this backend restarted, or forgot it after its silence)
        # would be lost: refuse it, so that the frontend hears of it at once instead of waiting for its timeout.
        no_session = "this backend has no session with this frontend: it must handshake again"
        self.io_ready.set()
        next_heartbeat = time.monotonic()
        while not self.stop_io:
            events = dict(poller.poll(timeout=HEARTBEAT_INTERVAL * 1000 / 2))
            if router in events:
                while True:
                    try:
                        identity, payload = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        message = decoder.decode(payload)
                    except msgspec.DecodeError as e:
                        logger.warning("Dropped a malformed message: %s", e)
                        continue
                    if isinstance(message, FrontendHeartbeat):
                        if message.frontend_id in frontends:
                            frontends[message.frontend_id] = time.monotonic()
                    elif isinstance(message, Ping):  # a probe: answered, and nothing else
                        draining, busy_for = self.draining_since is not None, self._busy_for()
                        pong = Pong(PROTOCOL_VERSION, self.info.model_name, draining, busy_for, self.info.step_timeout)
                        router.send_multipart([identity, encoder.encode(pong)])
                    elif isinstance(message, Hello):
                        if message.protocol_version != PROTOCOL_VERSION:
                            reason = (
                                f"protocol version mismatch: the frontend speaks {message.protocol_version}, "
                                f"this backend speaks {PROTOCOL_VERSION}; run the same Spindle version on both"
                            )
                            router.send_multipart([identity, encoder.encode(Refused(reason))])
                            continue
                        if identity not in frontends:
                            logger.info("A frontend connected (%d connected)", len(frontends) + 1)
                        frontends[identity] = time.monotonic()
                        router.send_multipart([identity, ready])
                    elif identity in frontends:
                        frontends[identity] = time.monotonic()
                        self.inputs.put((identity, message))
                    elif isinstance(message, AddRequest):
                        refusal = RequestError(message.request.request_id, RequestErrorKind.NO_SESSION, no_session)
                        router.send_multipart([identity, encoder.encode(refusal)])
                    elif isinstance(message, Call):
                        refusal = RequestError(message.call_id, RequestErrorKind.NO_SESSION, no_session)
                        router.send_multipart([identity, encoder.encode(CallReply(message.call_id, error=refusal))])
            if wake in events:
                while True:
                    try:
                        wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while True:
                try:
                    identity, output = self.outputs.get_nowait()
                except queue.Empty:
                    break
                if identity in frontends:
                    router.send_multipart([identity, encoder.encode(output)])
                self.outputs.task_done()
            now = time.monotonic()
            for identity in [i for i, heard in frontends.items() if now - heard > FRONTEND_TIMEOUT]:
                del frontends[identity]
                self.inputs.put((identity, _FrontendGone()))
            if now >= next_heartbeat:
                heartbeat = encoder.encode(Heartbeat(self.stats, self._busy_for()))
                for identity in frontends:
                    router.send_multipart([identity, heartbeat])
                next_heartbeat = time.monotonic() + HEARTBEAT_INTERVAL
        router.close(linger=1000)
        wake.close(linger=0)

    def _busy_for(self) -> float:
        """Seconds the busy loop has been in its current turn; 0 while it waits for work."""
        since = self.busy_since  # once: the busy loop may reset it meanwhile
        return 0.0 if since is None else time.monotonic() - since


def _die(reason: str) -> None:
    """End this process at once, as a crash would: a tensor-parallel worker died or stopped answering.

    The engine cannot step. The frontends then see a dead backend (its socket and heartbeats gone), and one that owns
    it restarts it; its workers die with it (even stopped ones: see
    :func:`~spindle.backend.parent_death.die_with_parent`).
    """
    logger.critical("Engine dead: %s", reason)
    os._exit(1)


def run_backend(args: argparse.Namespace) -> int:
    """Run the backend process until SIGTERM (graceful) or SIGINT; returns the exit code."""
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid, signal.SIGTERM)
    ModelRegistry.register_models(args.register_model)
    bound_host_memory()
    # A frontend that started this process passes its EngineConfig whole; run by hand, the flags give it.
    config = config_from_json(args.engine_config) if args.engine_config else config_from_args(args)
    if config.parallel.node_rank > 0:
        # Another node's ranks of a tensor-parallel engine: workers only; node 0 serves the frontends.
        model_dir = resolve_model(config.model.model)
        return serve_node(config, model_dir, context_length(config, CheckpointConfig.from_dir(model_dir)))
    try:
        # A backend a frontend started (start_backend) on a private ipc socket serves that frontend's user alone.
        trusted = args.parent_pid is not None and args.listen.startswith("ipc://")
        process = EngineProcess(config, args.listen, args.grace_period, trust_frontends=trusted)
        signal.signal(signal.SIGTERM, process.drain)
        signal.signal(signal.SIGINT, process.drain)
        freeze_startup_heap()
        process.run()
    finally:
        if args.remove_socket_dir:
            remove_socket_dir(args.listen)
    logger.info("Engine stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m spindle.backend.engine_process``: the same as ``spindle backend``."""
    parser = argparse.ArgumentParser(prog="spindle backend", description="Run the Spindle engine core process")
    add_backend_args(parser)
    add_register_model_args(parser)
    args = parser.parse_args(argv)
    configure_logging(args.log_format)
    return run_backend(args)


if __name__ == "__main__":
    sys.exit(main())
