"""Whether a call releases the GIL: another Python thread runs in the middle of it."""

import threading
import time
from collections.abc import Callable


def lets_other_threads_run(call: Callable[[], object]) -> bool:
    """Run ``call()`` beside a thread that ticks each millisecond; whether it ticked in the middle half of the call.

    A call that holds the GIL throughout (a long C function that does not release it) gives the ticker no tick away
    from the moments it takes and gives back the GIL. The call should last a good fraction of a second.
    """
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.001):  # each tick needs the GIL back
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        start = time.monotonic()
        call()
        end = time.monotonic()
    finally:
        stop.set()
        ticker.join()
    quarter = (end - start) / 4
    return any(start + quarter < t < end - quarter for t in ticks)
