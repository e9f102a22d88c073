"""Shows that every test in tests/gpu fails when what it checks is broken, on the CPU stand-in for the device.

Each test runs once as it is (it must pass), then once per mutation of :data:`MUTATIONS` that :data:`PLAN` gives it,
in a subprocess of its own with ``SPINDLE_TEST_DEVICE=cpu`` (the device side on CPU tensors through Triton's
interpreter); the mutation is monkeypatched into that subprocess before pytest starts, and breaks the device side
only (the Triton kernels' entry points, the decode graphs' replay), never the CPU reference. A mutation the test
survives is a test to strengthen. Tests that only CUDA can run are listed as such. Prints a Markdown table::

    .venv/bin/python -m bench.mutation_run            # ~20 minutes on 2 busy cores
    .venv/bin/python -m bench.mutation_run -k quant   # the plan's entries whose test id contains "quant"

Results are recorded in bench/results/mutation_run.md.
"""

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TESTS = "tests/gpu/test_gpu_engine.py"


def _wrap_triton(name: str, change: Callable[..., tuple]) -> None:
    """Replace the Triton entry point ``name`` by one that calls it on ``change(*args)``."""
    import spindle.kernels.triton as triton_kernels

    original = getattr(triton_kernels, name)
    setattr(triton_kernels, name, lambda *args: original(*change(*args)))


def attention_scale_off() -> None:
    """The attention kernels' softmax scale 2% too large."""
    _wrap_triton("paged_attention", lambda q, k, v, meta, scale, *options: (q, k, v, meta, scale * 1.02, *options))


def block_tables_shifted() -> None:
    """Attention reads each sequence's blocks one table column off (the last block first)."""
    shift = lambda meta: dataclasses.replace(meta, block_tables=meta.block_tables.roll(1, dims=1))  # noqa: E731
    _wrap_triton("paged_attention", lambda q, k, v, meta, scale, *options: (q, k, v, shift(meta), scale, *options))


def keys_past_160_ignored() -> None:
    """Attention stops at 160 keys (the CPU run's long prefix): longer contexts lose their tail."""
    cut = lambda meta: dataclasses.replace(meta, seq_lens=meta.seq_lens.clamp(max=160))  # noqa: E731
    _wrap_triton("paged_attention", lambda q, k, v, meta, scale, *options: (q, k, v, cut(meta), scale, *options))


def cache_write_drops_last_token() -> None:
    """The cache write skips each step's last new token."""

    def change(
        key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ):
        slots = slots.clone()
        slots[-1:] = -1
        return key, value, k_cache, v_cache, slots

    _wrap_triton("reshape_and_cache", change)


def quant_scales_off() -> None:
    """The quantized GEMM's scales 1% too large."""
    _wrap_triton("quantized_linear", lambda x, w, bias=None: (x, dataclasses.replace(w, scales=w.scales * 1.01), bias))


def quant_zeros_ignored() -> None:
    """The quantized GEMM ignores int4 zero points (takes them as 0)."""

    def change(x: torch.Tensor, weight, bias=None):  # noqa: ANN001, ANN202
        if weight.zeros is not None:
            weight = dataclasses.replace(weight, zeros=torch.zeros_like(weight.zeros))
        return x, weight, bias

    _wrap_triton("quantized_linear", change)


def stale_replay() -> None:
    """A decode-graph replay returns the rows of the step before (the graph run before the inputs are copied)."""
    from spindle.backend.model_runner import DecodeGraphs

    original = DecodeGraphs.replay

    def replay(self: DecodeGraphs, step) -> torch.Tensor:  # noqa: ANN001
        num = step.input_ids.shape[0]
        stale = self._steps[next(s for s in self.sizes if s >= num)]()[:num].clone()
        original(self, step)
        return stale

    DecodeGraphs.replay = replay


def _padded_replay(pad_slot: int, last_rows: bool) -> None:
    """DecodeGraphs.replay as it is, but with ``pad_slot`` for the padding rows' cache slot (-1 skips the write) and,
    with ``last_rows``, the last rows of the graph's output returned (padding included) instead of the first."""
    from spindle.backend.model_runner import DecodeGraphs

    def replay(self: DecodeGraphs, step) -> torch.Tensor:  # noqa: ANN001
        meta, num = step.meta, step.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num)
        self.input_ids[:num].copy_(step.input_ids)
        self.positions[:num].copy_(step.positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.slot_mapping[num:size].fill_(pad_slot)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.seq_lens[num:size].fill_(1)
        self.block_tables[:num, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        out = self._steps[size]()
        return out[size - num :] if last_rows else out[:num]

    DecodeGraphs.replay = replay


def padding_writes_the_cache() -> None:
    """A padded decode-graph replay gives its padding rows cache slot 0 instead of -1: they overwrite a real token."""
    _padded_replay(0, last_rows=False)


def padding_rows_returned() -> None:
    """A padded decode-graph replay returns the last rows of the graph's output, padding included, not the first."""
    _padded_replay(-1, last_rows=True)


MUTATIONS: dict[str, Callable[[], None]] = {
    f.__name__: f
    for f in (
        attention_scale_off,
        block_tables_shifted,
        keys_past_160_ignored,
        cache_write_drops_last_token,
        quant_scales_off,
        quant_zeros_ignored,
        stale_replay,
        padding_writes_the_cache,
        padding_rows_returned,
    )
}

PLAN: dict[str, list[str]] = {
    "test_tiny_llama_device_matches_cpu[decode_graphs]": [
        "attention_scale_off",
        "stale_replay",
        "padding_writes_the_cache",
        "padding_rows_returned",
    ],
    "test_tiny_llama_device_matches_cpu[eager]": ["attention_scale_off", "block_tables_shifted"],
    "test_tiny_llama_quantized_and_speculating_device_matches_cpu[int8]": ["quant_scales_off"],
    "test_tiny_llama_quantized_and_speculating_device_matches_cpu[int4]": ["quant_zeros_ignored"],
    "test_prefix_hits_and_preemption_match_cpu": ["block_tables_shifted", "cache_write_drops_last_token"],
    "test_big_heads_long_contexts_high_blocks_and_sampling_match_cpu[llama_h128_g4]": ["keys_past_160_ignored"],
    "test_big_heads_long_contexts_high_blocks_and_sampling_match_cpu[llama_h128_g8]": ["keys_past_160_ignored"],
    "test_bf16_decode_graphs_match_eager_step_by_step": ["stale_replay", "padding_writes_the_cache"],
}
"""Each test run on the CPU stand-in, and the mutations it must fail under."""

CUDA_ONLY: dict[str, str] = {
    "test_no_triton_compile_after_start_up[plain|int8|lora]": "compiles after start-up (the interpreter compiles none)",
    "test_smollm2_device_matches_cpu": "SmolLM2's 30 layers, too slow for the interpreter",
    "test_smollm2_bf16_device_prompt_logprobs_near_fp32_cpu": "same",
    "test_two_engines_share_one_device": "the CUDA memory budget of two engines",
    "test_kv_cache_and_graphs_stay_within_gpu_memory_utilization": "gpu_memory_utilization",
}
"""Tests that skip on the CPU, with what they check; their mutations (a budget ignoring the utilization, a variant
left uncompiled) need the device."""


def run_test(test: str, mutation: str | None) -> tuple[bool, float, str]:
    """Run one test in a subprocess, mutated or not: (passed, seconds, the first line of its failure)."""
    env = os.environ | {"SPINDLE_TEST_DEVICE": "cpu", "TRITON_INTERPRET": "1"}
    pytest_args = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-x", f"{TESTS}::{test}"]
    command = [sys.executable, "-m", "bench.mutation_run", "--apply", mutation or "", "--", *pytest_args]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    errors = [line for line in result.stdout.splitlines() if line.startswith("E ")]
    if result.returncode not in (0, 1):
        errors = [f"exit {result.returncode}: {(result.stdout + result.stderr).strip().splitlines()[-1:]}"]
    return result.returncode == 0, seconds, (errors[0][1:].strip() if errors else "")


def apply_and_test(mutation: str, pytest_args: list[str]) -> int:
    """In the subprocess: apply ``mutation`` (none when empty), then run pytest."""
    if mutation:
        MUTATIONS[mutation]()
    import pytest

    return pytest.main(pytest_args)


def main() -> None:
    """Run the plan and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", default="", help="run the plan's entries whose test id contains this")
    parser.add_argument("--jobs", type=int, default=2, help="tests run side by side")
    parser.add_argument("--apply", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.apply is not None:
        sys.exit(apply_and_test(args.apply, rest[1:] if rest[:1] == ["--"] else rest))

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    print(f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {cpu}, {os.cpu_count()} cores, torch {torch.__version__}\n")
    print("| test | mutation | failed as expected? | seconds | how it failed |")
    print("| --- | --- | --- | --- | --- |")
    runs = [(test, mutation) for test, mutations in PLAN.items() if args.k in test for mutation in [None, *mutations]]
    survivors = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for (test, mutation), (passed, seconds, why) in zip(
            runs, pool.map(lambda run: run_test(*run), runs), strict=True
        ):
            expected = passed if mutation is None else not passed
            survivors += not expected
            verdict = ("yes" if expected else "**NO**") if mutation else ("passes unmutated" if passed else "**FAILS**")
            print(f"| `{test}` | {mutation or '(none)'} | {verdict} | {seconds:.0f} | {why[:120]} |", flush=True)
    for test, why in CUDA_ONLY.items():
        if args.k in test:
            print(f"| `{test}` | CUDA only: {why} | - | - | skipped on cpu |")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
