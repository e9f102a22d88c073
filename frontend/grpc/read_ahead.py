"""``read_ahead``: a stream's outputs taken from the engine into a bounded buffer, for clients that may stop reading.

gRPC's write of a streamed response waits while the client does not read (HTTP/2 flow control). So a stream's
outputs are read ahead by a task of its own into a buffer of ``size``; while the buffer is full, the engine's
stream fills in turn, and the engine pauses the request in the backend (``stream_buffer_outputs``: no tokens are
computed for it meanwhile). Once the buffer has stayed full for ``timeout`` seconds, the request is aborted in the
engine (its KV cache freed), and the caller hears of it to end the call, whatever write it waits in.
"""

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _End:
    """What the reader puts last: the outputs ended, or ``error`` ended them."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


async def read_ahead(
    outputs: AsyncGenerator[T, None], size: int, timeout: float, request_id: str, stalled: Callable[[], None]
) -> AsyncIterator[T]:
    """Yield ``outputs``, read ahead into a buffer of at most ``size`` by a task of their own.

    When the buffer stays full for ``timeout`` seconds (the caller does not take what it holds), ``outputs`` is
    closed, which aborts its request in the engine, and ``stalled()`` is called: the caller may be stuck in a write
    to a client that never reads, so it has to end the call from there. Closing or cancelling this generator closes
    ``outputs`` too.

    Args:
        outputs: the request's outputs (an engine stream, which aborts its request when closed).
        size: the most outputs held for the caller.
        timeout: seconds the buffer may stay full.
        request_id: the request, for the log line of an abort.
        stalled: called once ``outputs`` is closed for a stall.

    Raises:
        Exception: what ``outputs`` raised, once the outputs before it are taken.

    """
    buffer: asyncio.Queue[T | _End] = asyncio.Queue(size)
    reader = asyncio.get_running_loop().create_task(_read(outputs, buffer, timeout, request_id, stalled))
    try:
        while not isinstance(item := await buffer.get(), _End):
            yield item
        if item.error is not None:
            raise item.error
    finally:
        reader.cancel()
        await asyncio.wait([reader])


async def _read(
    outputs: AsyncGenerator[T, None],
    buffer: asyncio.Queue[T | _End],
    timeout: float,
    request_id: str,
    stalled: Callable[[], None],
) -> None:
    """Move ``outputs`` into ``buffer``; close them and call ``stalled`` once it has been full for ``timeout`` s."""
    stall = False
    try:
        try:
            async for output in outputs:
                await _put(buffer, output, timeout)
            end = _End()
        except _Stalled:
            raise
        except Exception as error:
            end = _End(error)
        await _put(buffer, end, timeout)
    except _Stalled:
        logger.warning(
            "Request aborted: its client left %d outputs unread for %g s (--max-unread-outputs, --unread-timeout)",
            buffer.qsize(),
            timeout,
            extra={"request_id": request_id},
        )
        stall = True
    finally:
        await outputs.aclose()
    if stall:
        stalled()


class _Stalled(Exception):
    """The buffer stayed full for the whole timeout."""


async def _put(buffer: asyncio.Queue[T | _End], item: T | _End, timeout: float) -> None:
    if not buffer.full():  # the common case, without arming a timer for every output (~25 us a token in all)
        buffer.put_nowait(item)
        return
    # Not wait_for: on Python 3.11 it swallows a cancellation that comes as the put succeeds, and the reader would
    # then go on reading (and the request on running) after its stream was closed.
    try:
        async with asyncio.timeout(timeout):
            await buffer.put(item)
    except TimeoutError:
        raise _Stalled from None
