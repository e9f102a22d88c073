"""Crash-safe entries of Spindle's disk cache: built aside, committed by one rename, checked before they are trusted.

Two caches use it, both under ``$SPINDLE_CACHE_DIR`` (default ``~/.cache/spindle``), often on a volume that several
machines or containers share: the CPU kernels' compiled library (``spindle.kernels.cpu``) and the checkpoints
converted from GGUF files (``spindle.backend.models.loader``; it lives here because ``kernels`` imports nothing of
Spindle's other packages).

An entry is a directory. :func:`build_entry` holds a lock file beside it (so two processes never build the same entry
at once: the second waits, then finds it built), builds into a scratch directory in the same parent, writes a marker
into it (:data:`MARKER`: the hash of the build's inputs, Spindle's version, each file's size), fsyncs every file and
the directories, and renames it into place: the rename is the commit. :func:`is_complete` trusts an entry only when
its marker matches the inputs and the version and every file has its recorded size, so a builder killed mid-write
(its scratch directory is never read), a power cut before the data reached the disk, an entry left by another
version or a file cut short since, is rebuilt rather than loaded.
"""

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

MARKER = "spindle-cache-entry.json"
"""The file, inside an entry, that says what built it: ``{"inputs": ..., "spindle": ..., "files": {name: size}}``."""


def spindle_version() -> str:
    """The installed ``spindle-serve`` distribution's version (part of every entry's marker)."""
    return importlib.metadata.version("spindle-serve")


def is_complete(entry: Path, inputs: str) -> bool:
    """Whether ``entry`` was committed for ``inputs`` by this version of Spindle, with every file whole."""
    try:
        marker = json.loads((entry / MARKER).read_text())
        if marker["inputs"] != inputs or marker["spindle"] != spindle_version():
            return False
        return all((entry / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError):  # no marker, an unreadable one, a file missing
        return False


def build_entry(entry: Path, inputs: str, build: Callable[[Path], None]) -> None:
    """Make ``entry`` complete for ``inputs``: unless it already is, ``build(scratch)`` and commit the scratch.

    Args:
        entry: the entry's directory.
        inputs: a hash of everything the build depends on (:func:`is_complete` compares it).
        build: writes the entry's files into the directory it is given (a scratch directory, empty).

    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(entry.parent / f".{entry.name}.lock"):
        if is_complete(entry, inputs):
            return  # another process built it while this one waited
        # Holding the lock, no other builder runs: scratch directories left here were those of killed builders.
        for stale in entry.parent.glob(f".{entry.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
        try:
            build(scratch)
            _commit(scratch, entry, inputs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _commit(scratch: Path, entry: Path, inputs: str) -> None:
    """Write the marker, make every byte durable, and rename ``scratch`` to ``entry`` (replacing an incomplete one)."""
    files = {str(path.relative_to(scratch)): path.stat().st_size for path in scratch.rglob("*") if path.is_file()}
    marker = {"inputs": inputs, "spindle": spindle_version(), "files": files}
    (scratch / MARKER).write_text(json.dumps(marker, indent=1))
    for path in sorted(scratch.rglob("*"), key=lambda p: -len(p.parts)):  # files, then the directories holding them
        _fsync(path)
    _fsync(scratch)
    if entry.exists():
        logger.warning("Replacing the incomplete or outdated cache entry %s", entry)
        shutil.rmtree(entry)
    os.rename(scratch, entry)
    _fsync(entry.parent)


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
