"""C++ kernels for the CPU path, built on first use with torch's JIT extension builder and cached across runs.

The build takes about 40 s the first time on a 2-core machine; torch keeps the library under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), keyed by the source and flags, so later starts
load it in milliseconds. It is compiled for the machine it runs on (``-march=native``): that cache is per machine.
"""

import functools
import os
from pathlib import Path
from types import ModuleType

_SOURCES = [Path(__file__).with_name("decode_attention.cpp")]


@functools.cache
def cpu_ops() -> ModuleType:
    """The compiled extension (``decode_attention``), built the first time a process asks for it."""
    import ninja
    from torch.utils.cpp_extension import load

    # torch looks for ninja on PATH; the ninja wheel's binary sits in the venv, which need not be on it.
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return load(
        name="spindle_cpu_ops",
        sources=[str(path) for path in _SOURCES],
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
