"""Which calls the gRPC server takes in, within its limits.

``AdmissionControl`` keeps the queue and the count of calls in flight that a drain awaits; ``CallLimit`` the most
calls of one kind at once, per caller or in all.
"""

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator

from spindle.shared.errors import EngineUnavailableError


class OverLimitError(Exception):
    """A call would go over one of the server's limits (``RESOURCE_EXHAUSTED``): retry later, with backoff."""


class QueueFullError(OverLimitError):
    """The server already holds ``max_queued_requests`` requests that wait for the backend: retry with backoff."""


class Admitted:
    """One call the server took in, and how many of its requests still wait for the backend.

    Attributes:
        waiting: its requests counted as waiting (until :meth:`started`, or until the call ends).

    """

    def __init__(self, control: "AdmissionControl", waiting: int) -> None:
        self.control = control
        self.waiting = waiting

    def started(self) -> None:
        """Its requests are under way (the first output came): they no longer count as waiting."""
        self.control.num_queued -= self.waiting
        self.waiting = 0


class AdmissionControl:
    """Takes in the server's calls that queue requests: none once the server drains, none while too many wait.

    Every ``Generate``, ``Chat`` and ``Embed`` call goes through :meth:`admit`: a stream's request counts as waiting
    until its first output, an ``Embed`` call's requests (one per input) until the call ends (an embedding ends with
    its prefill), and each call counts as one in flight until it ends, which is what a drain waits for.

    Args:
        max_queued_requests: the most requests that may wait for the backend; one more is refused with
            ``RESOURCE_EXHAUSTED``.

    Attributes:
        draining: set when the server drains: every new call is refused with ``UNAVAILABLE``.
        num_queued: the requests taken in that wait for the backend.
        num_streams: the calls in flight.
        streams_done: set while no call is in flight.

    """

    def __init__(self, max_queued_requests: int) -> None:
        self.max_queued_requests = max_queued_requests
        self.draining = False
        self.num_queued = 0
        self.num_streams = 0
        self.streams_done = asyncio.Event()
        self.streams_done.set()

    @contextlib.contextmanager
    def admit(self, num_requests: int = 1) -> Iterator[Admitted]:
        """Take in a call of ``num_requests`` requests for as long as the ``with`` block runs.

        Raises:
            EngineUnavailableError: the server drains.
            QueueFullError: ``num_requests`` more would make more than ``max_queued_requests`` wait.

        """
        if self.draining:
            raise EngineUnavailableError("the server is shutting down: retry elsewhere")
        if self.num_queued + num_requests > self.max_queued_requests:
            raise QueueFullError(
                f"{self.num_queued} requests are already waiting, and {num_requests} more would go over the limit "
                f"(the limit is {self.max_queued_requests}): retry later with backoff"
            )
        admitted = Admitted(self, num_requests)
        self.num_queued += num_requests
        self.num_streams += 1
        self.streams_done.clear()
        try:
            yield admitted
        finally:
            admitted.started()  # whatever still counts as waiting
            self.num_streams -= 1
            if not self.num_streams:
                self.streams_done.set()


class CallLimit:
    """The most calls of one kind that may run at once for each caller (or, under one key, in all).

    Args:
        limit: the most calls at once under one key; one more is refused with :class:`OverLimitError`.
        what: what the calls are, for the refusal's message (``"streams on this connection"``).

    Attributes:
        counts: the calls running under each key that has any.

    """

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.counts: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, key: str = "") -> Iterator[None]:
        """Count one call under ``key`` for as long as the ``with`` block runs.

        Raises:
            OverLimitError: ``limit`` calls run under ``key`` already.

        """
        if self.counts[key] >= self.limit:
            raise OverLimitError(f"{self.counts[key]} {self.what} are open already (the limit is {self.limit})")
        self.counts[key] += 1
        try:
            yield
        finally:
            self.counts[key] -= 1
            if not self.counts[key]:
                del self.counts[key]
