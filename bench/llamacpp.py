"""llama.cpp's native tools, built once for this CPU from the ``bench`` extra's pinned ``llama-cpp-python`` sdist.

The sdist carries llama.cpp (``vendor/llama.cpp``): its ``convert_hf_to_gguf.py`` and the sources of
``llama-quantize``, ``llama-bench``, ``llama-batched-bench``, ``llama-server`` and ``llama-lookup`` (prompt-lookup
decoding), which this module builds (Release,
``-DGGML_NATIVE=ON``: the instructions of the CPU it runs on) into ``~/.cache/spindle-bench/llama.cpp-<version>``,
outside the repository. The convert script's one import that Spindle's environment lacks, ``sentencepiece``, is
installed beside the build (``python/``, on the script's ``PYTHONPATH``). A build takes ~5-10 minutes on two cores;
later calls find it done::

    .venv/bin/python -m bench.llamacpp            # build (once) and print the tools' paths
    .venv/bin/python -m bench.llamacpp --tools-dir /path/to/llama.cpp-0.3.36  # check a build made elsewhere
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
CACHE = Path(os.environ.get("SPINDLE_BENCH_CACHE", Path.home() / ".cache" / "spindle-bench"))
"""Where the bench's builds and models are kept (``$SPINDLE_BENCH_CACHE``, default ``~/.cache/spindle-bench``)."""

TARGETS = ("llama-quantize", "llama-bench", "llama-batched-bench", "llama-server", "llama-lookup")
CONVERT_REQUIREMENTS = ("sentencepiece>=0.1.98,<0.3.0",)
"""What ``convert_hf_to_gguf.py`` imports beyond Spindle's own dependencies (torch, transformers, numpy)."""


def pinned_version() -> str:
    """The ``llama-cpp-python`` version that ``pyproject.toml``'s ``bench`` extra pins."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for requirement in extras["bench"]:
        if match := re.fullmatch(r"llama-cpp-python==([\w.]+)", requirement):
            return match[1]
    raise ValueError(f"{PYPROJECT}'s bench extra pins no llama-cpp-python==<version>")


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: the tools' directory (``build/bin``), the source tree and the convert script's imports."""

    root: Path

    @property
    def source(self) -> Path:
        """The llama.cpp source tree (the sdist's ``vendor/llama.cpp``)."""
        return next(
            self.root.glob("llama_cpp_python-*/vendor/llama.cpp"), self.root / "llama_cpp_python-*/vendor/llama.cpp"
        )

    @property
    def bin(self) -> Path:
        """Where the built tools are."""
        return self.root / "build" / "bin"

    def tool(self, name: str) -> Path:
        """The path of the built tool ``name`` (one of :data:`TARGETS`)."""
        return self.bin / name

    def missing(self) -> list[str]:
        """What this build lacks: tools, the convert script or its imports (empty when it is complete)."""
        paths = [self.tool(name) for name in TARGETS] + [self.source / "convert_hf_to_gguf.py"]
        lacking = [str(path) for path in paths if not path.is_file()]
        if not (self.root / "python" / "sentencepiece").is_dir():
            lacking.append(f"{self.root / 'python'} (sentencepiece)")
        return lacking

    def check(self) -> "LlamaCpp":
        """Raise a :class:`FileNotFoundError` naming what is missing unless the build is complete; returns itself."""
        if lacking := self.missing():
            raise FileNotFoundError(
                f"llama.cpp in {self.root} is incomplete, missing {', '.join(lacking)}: build it with "
                "`.venv/bin/python -m bench.llamacpp` (or pass the --tools-dir of a complete build)"
            )
        return self

    def convert(self, hf_dir: Path, out_file: Path, outtype: str = "f16") -> None:
        """Convert the Hugging Face checkpoint ``hf_dir`` into the GGUF ``out_file`` (``outtype``: f16, bf16, ...)."""
        env = os.environ | {"PYTHONPATH": str(self.root / "python")}
        script = self.source / "convert_hf_to_gguf.py"
        command = [sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(out_file)]
        # Not from the repository root: there its `kernels` folder would shadow the `kernels` package transformers
        # imports.
        subprocess.run(command, check=True, env=env, cwd=self.root)

    def batched_bench_command(
        self, gguf: Path, batch: int, prompt_tokens: int, new_tokens: int, threads: int
    ) -> list[str]:
        """``llama-batched-bench`` on ``batch`` sequences of ``prompt_tokens`` + ``new_tokens`` each, one JSON line out
        (read it with :func:`decode_rate`)."""
        context = batch * (prompt_tokens + new_tokens)
        command = [str(self.tool("llama-batched-bench")), "-m", str(gguf), "-c", str(context)]
        command += ["-b", "2048", "-ub", "512", "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", str(batch)]
        return command + ["-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]

    def quantize(self, in_file: Path, out_file: Path, kind: str = "Q4_K_M") -> None:
        """Quantize the GGUF ``in_file`` into ``out_file`` as ``kind`` with ``llama-quantize``."""
        subprocess.run([str(self.tool("llama-quantize")), str(in_file), str(out_file), kind], check=True)


def decode_rate(stdout: str, batch: int) -> float:
    """The decode tokens per second (``speed_tg``) of a :meth:`LlamaCpp.batched_bench_command` run's output."""
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if len(rows) != 1 or rows[0].get("pl") != batch:
        raise RuntimeError(f"unexpected llama-batched-bench output:\n{stdout}")
    return rows[0]["speed_tg"]


def build(root: Path | None = None, version: str | None = None, jobs: int | None = None) -> LlamaCpp:
    """Build llama.cpp ``version`` (default: the pinned one) into ``root`` once; returns the complete build.

    Each step is skipped when its output is there: the sdist's download and extraction, the CMake build (whose own
    checks make a rebuild of a complete tree quick), the convert script's imports.
    """
    version = version or pinned_version()
    llama = LlamaCpp(root or CACHE / f"llama.cpp-{version}")
    llama.root.mkdir(parents=True, exist_ok=True)
    if not (llama.source / "CMakeLists.txt").is_file():
        sdist = llama.root / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
                + [f"llama-cpp-python=={version}", "-d", str(llama.root)],
                check=True,
            )
        with tarfile.open(sdist) as archive:
            archive.extractall(llama.root, filter="data")
    if any(not llama.tool(name).is_file() for name in TARGETS):
        build_dir = llama.root / "build"
        configure = ["cmake", "-S", str(llama.source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release"]
        configure += ["-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
        configure += ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
        subprocess.run(configure, check=True)
        jobs = jobs or os.cpu_count() or 1
        subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], check=True)
    if not (llama.root / "python" / "sentencepiece").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--target", str(llama.root / "python"), *CONVERT_REQUIREMENTS],
            check=True,
        )
    return llama.check()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools-dir", type=Path, help="check this build instead of building into the cache")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: all cores)")
    args = parser.parse_args()
    llama = LlamaCpp(args.tools_dir).check() if args.tools_dir else build(jobs=args.jobs)
    for name in TARGETS:
        print(f"{name}: {llama.tool(name)}")
    print(f"convert_hf_to_gguf.py: {llama.source / 'convert_hf_to_gguf.py'}")


if __name__ == "__main__":
    main()
