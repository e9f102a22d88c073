"""Scaling overheads: tensor parallel 2 against 1 (offline ``LLM.generate``) and data parallel 2 against 1 (gRPC).

- **Tensor parallel**: the same prompts for every size (each run its own), greedy, every one generating
  ``--max-tokens`` tokens (eos ignored), through ``LLM(tensor_parallel_size=N)`` for each ``N`` of ``--tp``; output
  tokens per second, median of ``--repeats``.
- **Data parallel**: ``spindle serve --data-parallel-size N`` for each ``N`` of ``--dp``, driven through gRPC by
  ``--concurrency`` clients (``bench.serving``'s load generator); output tokens per second and p50/p99 latencies.

The model is a random-weight Llama whose heads divide 2 and 4 (``bench.random_llama``'s ``small`` shapes, ~125M
parameters: the embedded SmolLM2's 9 heads admit tensor parallel 3 only), unless ``--model`` names one. On a machine
whose cores one engine already keeps busy (a small CPU) neither can gain: the ratios are then the overhead of the
extra processes and, for tensor parallel, of two all-reduces per layer. On a machine with several GPUs they are the
speed-up::

    python -m bench.scale --tp 1 2 --dp 1 2
"""

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.random_llama import write
from bench.serving import grpc_run, report
from spindle import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def prompts_for(num: int, first: int = 0) -> list[str]:
    """``num`` different prompts of 10-30 words, numbered from ``first``.

    Every run gets prompts of its own numbers: run again, the same prompts would find their first blocks in the
    prefix cache of the engine that served them before (with data parallel engines, only of that one).
    """
    return [
        f"Request {first + i}: " + "tell me about the number seven and its friends. " * (1 + i % 3) for i in range(num)
    ]


def tensor_parallel_rate(model: str, size: int, runs: list[list[str]], args: argparse.Namespace) -> float:
    """Median output tokens per second of ``LLM.generate`` over ``runs`` with ``tensor_parallel_size=size``."""
    llm = LLM(model, tensor_parallel_size=size, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts_for(2), params, use_tqdm=False)  # warm-up, on prompts no run has
        rates = []
        for prompts in runs:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
        return statistics.median(rates)
    finally:
        llm.shutdown()


@contextlib.contextmanager
def served(model: str, size: int, args: argparse.Namespace) -> Iterator[str]:
    """``spindle serve --data-parallel-size size`` on a free port; yields its address, stops it on exit."""
    command = [sys.executable, "-m", "spindle.cli", "serve", "--model", model, "--port", "0"]
    command += ["--data-parallel-size", str(size), "--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO, env=os.environ)
    try:
        banner = server.stdout.readline()  # "spindle: serving MODEL on HOST:PORT" once it listens
        if not banner:
            raise SystemExit(f"spindle serve exited with code {server.wait()} before it listened")
        yield f"127.0.0.1:{banner.rsplit(':', 1)[1].strip()}"
    finally:
        server.terminate()
        server.wait(120)


def data_parallel_rate(model: str, size: int, runs: list[list[str]], args: argparse.Namespace) -> float:
    """Output tokens per second of the gRPC load against ``--data-parallel-size size`` (best of ``runs``)."""
    with served(model, size, args) as address:
        asyncio.run(grpc_run(address, prompts_for(4), args))  # warm-up
        results = [asyncio.run(grpc_run(address, prompts, args)) for prompts in runs]
    elapsed, ttfts, itls, tokens = min(results, key=lambda result: result[0])
    report(f"DP={size}", elapsed, ttfts, itls, tokens, len(runs[0]))
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: a random 'small' Llama)")
    parser.add_argument("--tp", type=int, nargs="*", default=[1, 2], help="tensor parallel sizes to run")
    parser.add_argument("--dp", type=int, nargs="*", default=[1, 2], help="data parallel sizes to run")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    args.rate = 0.0  # bench.serving's load generator: every client sends at once
    # Numbered past the warm-ups' four prompts, and past each other.
    runs = [prompts_for(args.num_prompts, first=4 + r * args.num_prompts) for r in range(args.repeats)]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            model = str(Path(scratch) / "small")
            write(Path(model), "small")
        print(f"model={model} prompts={args.num_prompts} max_tokens={args.max_tokens} cores={os.cpu_count()}")
        tp = {size: tensor_parallel_rate(model, size, runs, args) for size in args.tp}
        for size, rate in tp.items():
            print(f"TP={size}: {rate:8.1f} tok/s  ratio to TP={args.tp[0]}: {rate / tp[args.tp[0]]:5.2f}x")
        dp = {size: data_parallel_rate(model, size, runs, args) for size in args.dp}
        for size, rate in dp.items():
            print(f"DP={size}: {rate:8.1f} tok/s  ratio to DP={args.dp[0]}: {rate / dp[args.dp[0]]:5.2f}x")


if __name__ == "__main__":
    main()
