"""``die_with_parent``: a child process (backend, tensor-parallel worker, grammar worker) ends with its parent."""

import ctypes
import os
import sys
import threading
import time

_PARENT_POLL = 0.5  # seconds between checks that the parent still lives, where the kernel does not signal it
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int) -> None:
    """Have ``signum`` sent to this process once the process that started it, ``parent_pid``, is gone.

    On Linux the kernel sends it (the parent-death signal, when the thread that started this process ends); elsewhere
    a daemon thread watches for the parent. A backend takes SIGTERM (it drains), a worker SIGKILL (the one signal a
    stopped worker, or one inside a native call, acts on at once).
    """
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    else:
        watch = threading.Thread(target=_watch_parent, args=(parent_pid, signum), name="spindle-parent", daemon=True)
        watch.start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)


def _watch_parent(parent_pid: int, signum: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL)
    os.kill(os.getpid(), signum)
