"""``ConnectionSupervisor``: keeps one backend connection serving, bringing a backend back when it dies."""

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from spindle.frontend.engine.connection import BackendConnection, BackendProcess, EngineDeadError, start_backend
from spindle.shared.config import EngineConfig

logger = logging.getLogger(__name__)

RESTART_BACKOFF_INITIAL = 1.0
"""Seconds before the first attempt to bring a dead backend back (the wait before a restart, or the time a
reconnection attempt waits for an answer)."""

RESTART_BACKOFF_MAX = 30.0
"""The longest wait: each failed attempt doubles the wait, up to this."""

RESTART_BACKOFF_RESET = 60.0
"""Seconds a backend must have served for the wait to start again from ``RESTART_BACKOFF_INITIAL`` when it dies; one
that dies sooner (a crash loop) is brought back after twice the previous wait."""


class ConnectionSupervisor:
    """Owns one connection to a backend: serves it until the backend dies, then brings one back, again and again.

    :meth:`run` hands the connection to its owner's ``receive`` coroutine, which returns only by raising
    :class:`EngineDeadError` once the backend is dead (it exited, or sent nothing for ``HEARTBEAT_TIMEOUT`` seconds,
    or its heartbeats say its step loop has been stuck in one step past its ``step_timeout``: hung). The owner hears
    of the death (``lost``: its requests in flight are gone), and the supervisor brings a backend back: it kills a
    backend it started and starts a new one with the same settings and environment, or reconnects to the backend at
    the address it was given, until one answers. It waits 1 s before the first attempt,
    twice as long after each failure, up to 30 s; the wait starts again from 1 s once a backend has served for 60 s.
    The owner then hears of the new backend (``adopted``: its tokenizer and limits may have changed, and it has
    none of the old one's runtime state), and serving goes on.

    Args:
        connection: the connection to serve first.

    Attributes:
        connection: the connection in use: the latest backend's.
        num_restarts: how many times a new backend took over from a dead one: restarted (a backend this supervisor
            started) or reconnected to (a remote one).

    """

    def __init__(self, connection: BackendConnection) -> None:
        self.connection = connection
        self.num_restarts = 0
        self._closed = False
        # While no backend serves: what calls raise, and the death that started it.
        self._down: EngineDeadError | None = None
        self._down_cause: EngineDeadError | None = None
        self._up_since = time.monotonic()
        self._next_delay = RESTART_BACKOFF_INITIAL
        self._opening: tuple[threading.Event, concurrent.futures.Future[BackendConnection]] | None = None

    @property
    def is_down(self) -> bool:
        """Whether no backend serves now: it died and none is back yet, or the supervisor was closed."""
        return self._closed or self._down is not None or self.connection.dead is not None

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` (saying what is being done about it) unless a backend serves now."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._down is not None:
            raise self._down
        self.connection.check_alive()

    async def run(
        self,
        receive: Callable[[BackendConnection], Awaitable[None]],
        lost: Callable[[EngineDeadError], None],
        adopted: Callable[[], None],
    ) -> None:
        """Serve with ``receive`` until the backend dies, tell ``lost``, bring one back, tell ``adopted``; forever.

        It runs until cancelled; cancelled while a backend is being brought back, the next call picks up from there.
        """
        while True:
            if self._down is None:
                try:
                    await receive(self.connection)
                except EngineDeadError as dead:
                    self._down = self._down_cause = dead
                    lost(dead)
            await self._recover()
            adopted()

    def close(self) -> None:
        """Stop any attempt to bring a backend back, and the backend this supervisor started (if any)."""
        self._closed = True
        self._abandon_opening()
        self.connection.close()

    async def _recover(self) -> None:
        """Replace the dead backend: restart the one this supervisor started, or reconnect to the remote one.

        Attempts go on, with the backoff of ``RESTART_BACKOFF_*``, until one succeeds or the task is cancelled.
        """
        old = self.connection
        old.close()  # SIGKILLs a backend this supervisor started: dead or hung, it has nothing left to finish
        owned = old.process is not None
        cause = self._down_cause
        if time.monotonic() - self._up_since >= RESTART_BACKOFF_RESET:
            self._next_delay = RESTART_BACKOFF_INITIAL
        attempt = 0
        while True:
            attempt += 1
            delay, self._next_delay = self._next_delay, min(2 * self._next_delay, RESTART_BACKOFF_MAX)
            started = time.monotonic()
            try:
                if owned:
                    self._down = EngineDeadError(f"{cause}; a new backend is starting, attempt {attempt}")
                    logger.warning(
                        "The backend is down (%s): starting a new one in %g s (attempt %d)", cause, delay, attempt
                    )
                    await asyncio.sleep(delay)
                    # From this thread: see start_backend. With the variables the old one had (its devices).
                    process, address = start_backend(old.config, env=old.process.extra_env)
                    connection = await self._open(address, old.config, old.startup_timeout, process)
                else:
                    self._down = EngineDeadError(f"{cause}; reconnecting, attempt {attempt}")
                    logger.warning(
                        "The backend is down (%s): reconnecting, waiting up to %g s for an answer (attempt %d)",
                        cause,
                        delay,
                        attempt,
                    )
                    connection = await self._open(old.address, old.config, delay)
            except (EngineDeadError, RuntimeError, OSError) as error:
                logger.warning("Attempt %d to bring the backend back failed: %s", attempt, error)
                # A refusal or a crash can come at once: the next attempt still waits for its turn.
                await asyncio.sleep(max(0.0, started + delay - time.monotonic()))
                continue
            break
        self.connection = connection
        self.num_restarts += 1
        self._up_since = time.monotonic()
        self._down = self._down_cause = None
        how = "restarted" if owned else f"reconnected to {connection.address}"
        logger.info("The backend is back (%s after %d attempt(s); %d since start-up)", how, attempt, self.num_restarts)

    async def _open(
        self, address: str, config: EngineConfig, timeout: float, process: BackendProcess | None = None
    ) -> BackendConnection:
        """A new connection, its blocking handshake run in a thread of its own; given up if this task is cancelled."""
        cancelled = threading.Event()
        future: concurrent.futures.Future[BackendConnection] = concurrent.futures.Future()
        # Running, so that cancelling the awaiting task cannot cancel the future and lose the connection it will hold.
        future.set_running_or_notify_cancel()

        def handshake() -> None:
            try:
                connection = BackendConnection(
                    address, config, True, timeout, process=process, cancelled=cancelled.is_set
                )
            except BaseException as error:
                if process is not None:  # a failed handshake stopped it; anything else may not have
                    process.kill()
                    process.wait()
                future.set_exception(error)
            else:
                future.set_result(connection)

        self._opening = cancelled, future
        # A daemon thread, not the loop's executor: a handshake may take minutes, and must not hold up the exit.
        threading.Thread(target=handshake, name="spindle-reconnect", daemon=True).start()
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._abandon_opening()
            raise
        finally:
            self._opening = None

    def _abandon_opening(self) -> None:
        """Give up the connection being opened, and close it should it open anyway."""
        if self._opening is not None:
            cancelled, future = self._opening
            cancelled.set()
            future.add_done_callback(_close_opened)


def _close_opened(future: concurrent.futures.Future[BackendConnection]) -> None:
    """Close the connection an abandoned attempt opened after all."""
    if future.exception() is None:
        future.result().close()
