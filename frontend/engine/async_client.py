"""``AsyncBackendClient``: one backend process from asyncio, the receiving half of ``AsyncLLMEngine``."""

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from spindle.frontend.engine.connection import CALL_TIMEOUT, BackendConnection, EngineDeadError
from spindle.frontend.engine.supervisor import ConnectionSupervisor
from spindle.shared.errors import EngineUnavailableError
from spindle.shared.protocol import (
    Call,
    CallReply,
    Command,
    EngineInfo,
    EngineRequest,
    EngineStats,
    Heartbeat,
    KvCacheCleared,
    KvEvent,
    RequestError,
    SequenceDelta,
    StepOutputs,
    SubscribeKvEvents,
    decode_result,
)

KvListener = Callable[[int, list[KvEvent]], None]
"""Takes a backend's KV events: its data-parallel rank, and one step's events."""

if TYPE_CHECKING:
    from spindle.frontend.engine.client import OutputHandler


@dataclasses.dataclass(frozen=True)
class RankStats:
    """What one backend engine reports, as its client last heard it (for the load figures and the metrics).

    Attributes:
        stats: its latest stats, from its latest step or heartbeat (``None`` before the first).
        num_restarts: how many times a new backend took over from a dead one in its place; the counts in ``stats``
            start again from zero with each.
        serving: whether a backend serves in its place now.
        boot_id: the start of the backend that serves there now (or last did), from its handshake.

    """

    stats: EngineStats | None
    num_restarts: int
    serving: bool
    boot_id: str = ""


class AsyncBackendClient:
    """One backend process, sent requests and calls from asyncio and received from in a task of its own.

    The task (one per event loop: a task of an earlier ``asyncio.run()`` is done and cannot be awaited there) receives
    every message from the backend: step deltas and refusals go to the
    :class:`~spindle.frontend.engine.client.OutputHandler`, call replies to their callers, stats to :meth:`get_stats`.
    The client keeps the requests it sent that are still running, completion by completion, so that when the backend
    dies it tells the handler exactly which requests were lost. Its
    :class:`~spindle.frontend.engine.supervisor.ConnectionSupervisor` then brings a backend back, and the handler hears
    of it; until then every call raises :class:`~spindle.frontend.engine.connection.EngineDeadError`, saying what is
    being done about it.

    Args:
        connection: the connection to the backend, after its handshake (an asyncio one).

    Attributes:
        supervisor: keeps the connection serving.
        stats: the backend's latest stats, from its latest step or heartbeat (``None`` before the first).
        requests: the requests in flight here: request id -> its completions still running.

    """

    def __init__(self, connection: BackendConnection) -> None:
        self.supervisor = ConnectionSupervisor(connection)
        self.stats: EngineStats | None = None
        self.requests: dict[str, set[int]] = {}
        self._handler: OutputHandler | None = None
        self._task: asyncio.Task | None = None
        self._stats_updated: asyncio.Event | None = None
        self._calls: dict[str, asyncio.Future[CallReply]] = {}  # control-plane calls awaiting the backend's reply
        self._kv_listener: KvListener | None = None

    @property
    def connection(self) -> BackendConnection:
        """The connection to the backend that serves now (the latest one, while none does)."""
        return self.supervisor.connection

    @property
    def info(self) -> EngineInfo:
        """The backend's description, from its handshake."""
        return self.connection.info

    @property
    def is_dead(self) -> bool:
        """Whether no backend serves now."""
        return self.supervisor.is_down

    @property
    def num_restarts(self) -> int:
        """How many times a new backend took over from a dead one."""
        return self.supervisor.num_restarts

    def attach(self, handler: "OutputHandler") -> None:
        """Hand what the backend sends from now on to ``handler``."""
        self._handler = handler

    def load(self) -> int:
        """Requests in flight here, plus those waiting in the backend's queue (counted again: they wait)."""
        return len(self.requests) + (self.stats.num_waiting if self.stats is not None else 0)

    async def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Queue requests in the backend (:class:`EngineDeadError` while it is down)."""
        self._receive_on_this_loop()
        self.supervisor.check_alive()
        for request in requests:
            self.connection.add_request(request)
            self.requests[request.request_id] = set(request.indices)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests in the backend; their blocks are freed there. A dead backend has none left to abort."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)
        with contextlib.suppress(EngineDeadError):
            self.connection.abort_requests(list(request_ids))

    def pause_requests(self, request_ids: Sequence[str], resume: bool = False) -> None:
        """Stop scheduling requests in the backend, or with ``resume`` schedule them again; a dead one runs none."""
        with contextlib.suppress(EngineDeadError):
            self.connection.pause_requests(list(request_ids), resume)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion in the backend (a stop string matched)."""
        self._finished(request_id, index)
        self.connection.finish_sequence(request_id, index)

    async def call(self, command: Command) -> Any:
        """Run a control-plane command in the backend and await its result (the receiving task routes the reply).

        Raises:
            RequestRefusedError: the backend refused the command.
            EngineDeadError: the backend is down, or died before it answered.
            EngineUnavailableError: no answer within ``CALL_TIMEOUT`` seconds.

        """
        self._receive_on_this_loop()
        self.supervisor.check_alive()
        call = Call(uuid.uuid4().hex, command)
        reply: asyncio.Future[CallReply] = asyncio.get_running_loop().create_future()
        self._calls[call.call_id] = reply
        try:
            self.connection.send(call)
            async with asyncio.timeout(CALL_TIMEOUT):
                answer = await reply
        except TimeoutError:
            raise EngineUnavailableError(
                f"the backend did not answer a {type(command).__name__} within {CALL_TIMEOUT:g} s: it may still carry "
                "it out, check before retrying"
            ) from None
        finally:
            del self._calls[call.call_id]
        return decode_result(command, answer)

    async def get_stats(self) -> EngineStats:
        """The backend's stats as of its next heartbeat or step (at most 0.25 s away).

        Raises:
            EngineDeadError: the backend is down, or died meanwhile.

        """
        self._receive_on_this_loop()
        self.supervisor.check_alive()
        self._stats_updated.clear()
        await self._stats_updated.wait()
        self.supervisor.check_alive()
        return self.stats

    def rank_stats(self) -> list[RankStats]:
        """The figures of the one backend, as a list of one (as a data-parallel client lists them)."""
        return [RankStats(self.stats, self.num_restarts, not self.is_dead, self.info.boot_id)]

    def subscribe_kv_events(self, listener: KvListener | None) -> None:
        """Hand the backend's KV events to ``listener`` (rank 0), or with ``None`` stop the backend sending them.

        A new backend in this one's place is subscribed again (its events start with a clear); the death of this
        one is told as a :class:`~spindle.shared.protocol.KvCacheCleared` at once.
        """
        self._kv_listener = listener
        with contextlib.suppress(EngineDeadError):  # a backend that is down gets it once it is back
            self.connection.send(SubscribeKvEvents(listener is not None))

    def close(self) -> None:
        """Stop receiving, stop any attempt to bring a backend back, and stop the backend started for this client."""
        if self._task is not None:
            self._task.cancel()
        self.supervisor.close()

    def _receive_on_this_loop(self) -> None:
        """Start the receiving task on the running event loop, unless it runs there already.

        It is started even while the backend is down: it is what brings one back.
        """
        task = self._task
        if task is None or task.done() or task.get_loop() is not asyncio.get_running_loop():
            self._stats_updated = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self.supervisor.run(self._receive, self._lost, self._adopted)
            )

    async def _receive(self, connection: BackendConnection) -> None:
        """Hand every message from the backend on, until it dies (:class:`EngineDeadError`)."""
        while True:
            # Drain what is there before awaiting readiness: ZeroMQ signals readiness on edges only.
            try:
                payload = connection.sync_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                await connection.socket.poll(50)
                connection.check_alive()
                continue
            message = connection.decode(payload)
            if isinstance(message, StepOutputs | Heartbeat):
                self.stats = message.stats
                self._stats_updated.set()
            if isinstance(message, StepOutputs):
                if message.deltas:
                    self._handler.on_step(message.deltas)
                    self._note_finished(message.deltas)
                if message.kv_events and self._kv_listener is not None:
                    self._kv_listener(0, message.kv_events)
            elif isinstance(message, RequestError) and connection.dead is None:
                self.requests.pop(message.request_id, None)
                self._handler.on_refused(message.request_id, message.to_exception())
            # (One refused for want of a session killed the connection: it is lost, and resumed, with the others.)
            elif isinstance(message, CallReply):
                reply = self._calls.get(message.call_id)
                if reply is not None and not reply.done():  # else its caller gave up waiting
                    reply.set_result(message)
            connection.check_alive()

    def _note_finished(self, deltas: list[SequenceDelta]) -> None:
        for delta in deltas:
            if delta.finish_reason is not None:
                self._finished(delta.request_id, delta.index)

    def _finished(self, request_id: str, index: int) -> None:
        """One completion of a request ended; the request, once all have."""
        running = self.requests.get(request_id)
        if running is not None:
            running.discard(index)
            if not running:
                del self.requests[request_id]

    def _lost(self, dead: EngineDeadError) -> None:
        """The backend died: its requests and the calls awaiting it fail with ``dead``."""
        lost, self.requests = list(self.requests), {}
        self._stats_updated.set()  # get_stats() callers see the error
        for reply in self._calls.values():
            if not reply.done():
                reply.set_exception(dead)
        if self._kv_listener is not None:
            self._kv_listener(0, [KvCacheCleared()])
        self._handler.on_lost(lost, dead)

    def _adopted(self) -> None:
        self.stats = None  # the old backend's: the new one's come with its first heartbeat
        if self._kv_listener is not None:
            self.connection.send(SubscribeKvEvents())
        self._handler.on_adopted()
