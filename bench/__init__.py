"""Benchmarks that print ratios against a peer in one run, each run as a module from the repository root
(``python -m bench.<name>``).

``python -m`` puts the working directory first on ``sys.path``, where the repository's ``kernels`` folder would shadow
the ``kernels`` package (Hugging Face's) that transformers imports where that package is installed: the root is taken
off ``sys.path`` as this package is imported. Its modules are then found through the package's own path, and Spindle
(whose top-level folders the root holds) through its installation, as users import it.
"""

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _REPO]
