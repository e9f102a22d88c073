"""The garbage collector in a long-running server process: the objects of its start-up set out of its reach."""

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Collect once, then move every object left to the collector's permanent generation (``gc.freeze``).

    A server's start-up leaves ~180,000 tracked objects (torch, the model's modules, the tokenizer) that never become
    garbage, and each full collection walks them all: ~87 ms in a backend of the embedded model on a Zen 3 core, a
    pause of every stream whenever the requests' survivors trigger one. Frozen, a full collection walks only what the
    requests made. For processes that serve until they exit, as vLLM's engine core and API server do; never for an
    engine in a user's process, whose objects it would keep from ever being collected.
    """
    gc.collect()
    gc.freeze()
    logger.debug("Froze %d start-up objects out of the garbage collector's walks", gc.get_freeze_count())
