"""Waiting, in tests, for what another thread or process does, on a shared machine that may be slow.

A test never sleeps a fixed time and then asserts: it waits until the condition holds (:func:`wait_until`), with a
deadline generous enough for a loaded 2-core machine, since the deadline costs nothing when the condition comes
sooner, and it fails naming what it waited for. A bound on how soon something happens is the delay the code under
test is designed to wait out (a timeout) plus :data:`SLACK`, never a time measured on an idle machine.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE = 60.0
"""Seconds a wait gives its condition unless told otherwise: it runs out only when the test fails anyway."""

SLACK = 10.0
"""Seconds a busy shared machine may add to a reaction that takes milliseconds on an idle one."""

POLL = 0.05
"""Seconds between two looks at a condition."""


def wait_until(condition: Callable[[], T], what: str, timeout: float = DEADLINE, interval: float = POLL) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns a true value, and return that value.

    ``what`` says what is awaited (``"the backend is draining"``); the test fails with it, and the condition's last
    value, after ``timeout`` seconds. ``interval=0`` suits a condition that blocks or does work itself (a step).
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        _check_deadline(deadline, timeout, what, value)
        time.sleep(interval)
    return value


async def wait_until_async(
    condition: Callable[[], Awaitable[T]], what: str, timeout: float = DEADLINE, interval: float = POLL
) -> T:
    """:func:`wait_until` for a condition to await, on the running event loop."""
    deadline = time.monotonic() + timeout
    while not (value := await condition()):
        _check_deadline(deadline, timeout, what, value)
        await asyncio.sleep(interval)
    return value


def _check_deadline(deadline: float, timeout: float, what: str, value: object) -> None:
    assert time.monotonic() < deadline, f"waited {timeout:g} s in vain until {what} (last: {value!r})"
