"""Build the docs the way CI does: in a virtual environment that holds only ``docs/requirements.txt``.

``python3 docs/build_docs.py [OUTDIR]`` creates (once) ``docs/_build/venv`` from the requirements plus the two
distributions of this repository installed editable without their dependencies (so autodoc imports ``spindle.*`` as
users do, without torch), then runs the ``html`` and ``doctest`` builders with ``-W --keep-going`` on a fresh
environment, so no warning can hide in an incremental build. The venv is rebuilt whenever the requirements or the
packaging change (their hash is stamped inside it). It needs only a Python >= 3.11 and, for the ``step()`` diagram,
Graphviz's ``dot`` on the ``PATH``.
"""

import hashlib
import shutil
import subprocess
import sys
import venv
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
REQUIREMENTS = DOCS / "requirements.txt"
PACKAGING = (REQUIREMENTS, REPO / "client" / "pyproject.toml", REPO / "pyproject.toml")
VENV = DOCS / "_build" / "venv"


def docs_python() -> Path:
    """The docs venv's interpreter, creating or refreshing the venv when the requirements changed."""
    python = VENV / "bin" / "python"
    stamp = VENV / "requirements.sha256"
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in PACKAGING)).hexdigest()
    if not python.exists() or not stamp.exists() or stamp.read_text() != digest:
        shutil.rmtree(VENV, ignore_errors=True)
        venv.create(VENV, with_pip=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile"]
        subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True)
        # spindle-client first: spindle-serve requires it, and must not look for it on the index.
        for project in (REPO / "client", REPO):
            subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(project)], check=True)
        stamp.write_text(digest)
    return python


def build(outdir: Path, builders: tuple[str, ...] = ("html", "doctest")) -> None:
    """Run each builder into ``outdir/<builder>`` with warnings as errors; raise if any fails."""
    if shutil.which("dot") is None:
        raise RuntimeError("Graphviz's `dot` is needed for the step() diagram: apt-get install graphviz")
    python = docs_python()
    doctrees = outdir / "doctrees"
    for index, builder in enumerate(builders):
        # The first builder reads every source afresh (-E); the next ones reuse its doctrees.
        fresh = ["-E"] if index == 0 else []
        command = [str(python), "-m", "sphinx", "-W", "--keep-going", "-q", *fresh, "-b", builder, "-d", str(doctrees)]
        subprocess.run([*command, str(DOCS), str(outdir / builder)], check=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else DOCS / "_build")
