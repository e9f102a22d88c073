"""A server process's start-up heap set out of the garbage collector's walks, later garbage still collected."""

import subprocess
import sys

FREEZE_THEN_COLLECT = """
import gc, weakref
from spindle.shared.gc_heap import freeze_startup_heap

class Node:
    pass

startup = [Node() for _ in range(10_000)]
freeze_startup_heap()
assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
assert len(gc.get_objects()) < 1_000  # a full collection walks only what came after
cycle = Node()
cycle.self = cycle  # garbage only a collection finds
ref = weakref.ref(cycle)
del cycle
gc.collect()
assert ref() is None
"""


def test_the_frozen_start_up_heap_is_not_walked_and_later_cycles_are_still_collected() -> None:
    # In a child: freezing this process would keep every test's objects from being collected.
    subprocess.run([sys.executable, "-c", FREEZE_THEN_COLLECT], check=True, timeout=120)
