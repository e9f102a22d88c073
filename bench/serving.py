"""Serving benchmark: the same load through gRPC (``spindle serve``) and straight through ``AsyncLLMEngine``.

One backend process serves both frontends in turn. Load is Poisson arrivals (``--rate`` requests/s) or a fixed
number of concurrent clients (``--concurrency``). Each of ``--rounds`` rounds runs the requests through the engine
path, through gRPC, and through ``LLM.generate`` in this process (the offline rate), one after the other, each on
prompts of its own so that no run finds another's in the prefix cache. Prints each round's rates, then each path's
median output rate, p50/p99 time to first token and inter-token latency over all rounds, and the median over rounds
of its rate as a fraction of the offline one: on a shared machine a single pair of runs differs by 10-20% either way.
With ``--concurrency`` below ``--num-requests``, the offline engine holds as many requests at a time
(``max_num_seqs``): the same request stream, batched as the clients' concurrency allows, so that the fractions measure
what serving costs and not a batch larger than the clients allow. The summary
also gives each streamed path's CPU time per generated token in this process (the load generator, and on the engine
path the in-process frontend), in ``spindle serve`` and in the backend (Linux's ``/proc``): on a machine whose cores
the backend's threads fill, what the frontend and the client spend is taken from the model's steps.

With ``--http``, each round also runs the requests through the same ``spindle serve``'s OpenAI-compatible API
(``--http-port``), as OpenAI text completions streamed over SSE (``openai_run``, which takes any OpenAI base URL).
With ``--gateway``, each round also runs the requests through the SMG gateway (``smg launch``, the PyPI ``smg``) in
front of the same ``spindle serve``, the same way. The summary gives each path's rate and median TTFT, ITL and
request latency as fractions of the engine path's.

    python -m bench.serving --num-requests 128 --concurrency 64
    python -m bench.serving --http --gateway --num-requests 16 --concurrency 8 --max-tokens 32
"""

import argparse
import asyncio
import collections
import contextlib
import itertools
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai

from spindle import LLM, SamplingParams
from spindle.client import sampling_params
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import start_backend
from spindle.shared.config import EngineConfig
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    """A running backend and ``spindle serve`` in front of it (``http_url``: its OpenAI base URL, when served)."""

    port: int
    http_url: str | None
    backend_address: str
    backend: subprocess.Popen
    frontend: subprocess.Popen


@contextlib.contextmanager
def spindle_server(config: EngineConfig, port: int = 0, http: bool = False) -> Iterator[Server]:
    """Start a backend for ``config`` and ``spindle serve`` on ``port`` (0: a free one), with its OpenAI API on a
    free port if ``http``; stop both on exit."""
    backend, address = start_backend(config)
    env = {**os.environ, "SPINDLE_PORT": str(port), "SPINDLE_BACKEND_ADDRESS": address}
    if http:
        env["SPINDLE_HTTP_PORT"] = "0"
    frontend = subprocess.Popen(
        [sys.executable, "-m", "spindle.cli", "serve"], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        banner = frontend.stdout.readline()  # "spindle: serving MODEL on HOST:PORT" once it listens
        if not banner:
            raise SystemExit(f"spindle serve exited with code {frontend.wait()} before it listened")
        # "spindle: OpenAI-compatible API on http://HOST:PORT/v1" follows when it serves one.
        http_url = frontend.stdout.readline().rsplit(" ", 1)[1].strip() if http else None
        yield Server(int(banner.rsplit(":", 1)[1]), http_url, address, backend, frontend)
    finally:
        for process in (frontend, backend):
            process.terminate()
            process.wait(60)


@contextlib.contextmanager
def smg_gateway(worker_port: int) -> Iterator[str]:
    """Start ``smg launch`` in front of the ``spindle serve`` on ``worker_port``; yields its OpenAI base URL once it
    lists the worker's model. Its ports are free ones (the Prometheus default, 29000, may be taken)."""
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    command = [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1", "--port", str(ports[0])]
    command += ["--prometheus-port", str(ports[1]), "--log-level", "warn"]
    # Its banner goes to stdout; warnings and errors to stderr.
    gateway = subprocess.Popen(
        [*command, "--worker-urls", f"grpc://127.0.0.1:{worker_port}"], stdout=subprocess.DEVNULL
    )
    base_url = f"http://127.0.0.1:{ports[0]}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    try:
        deadline = time.monotonic() + 120
        while not models(client):
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("smg did not list the worker's model within 120 s")
            time.sleep(0.2)
        yield base_url
    finally:
        gateway.terminate()
        gateway.wait(60)


def models(client: openai.OpenAI) -> list[str]:
    """The model ids an OpenAI server lists; none while it does not answer."""
    try:
        return [model.id for model in client.models.list().data]
    except openai.OpenAIError:
        return []


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds that process ``pid`` has run so far, all its threads (Linux's ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 on, past the name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def drive(one_request, prompts: list[str], args) -> tuple[float, list[float], list[float], list[float], int]:
    """Run every prompt through ``one_request(prompt) -> (arrival times, tokens)``, the times those of the streamed
    messages (each carries one token on the engine and gRPC paths, one or more over SSE).

    Returns the elapsed time, the times to first token, the inter-message latencies, the request latencies and the
    tokens generated.
    """
    ttfts, itls, totals, tokens = [], [], [], 0
    semaphore = asyncio.Semaphore(args.concurrency or len(prompts))
    rng = random.Random(0)

    async def run(prompt: str, delay: float) -> None:
        nonlocal tokens
        await asyncio.sleep(delay)
        async with semaphore:
            start = time.perf_counter()
            times, count = await one_request(prompt)
        ttfts.append(times[0] - start)
        itls.extend(b - a for a, b in zip(times, times[1:], strict=False))
        totals.append(times[-1] - start)
        tokens += count

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(args.rate) if args.rate else 0.0
    begin = time.perf_counter()
    await asyncio.gather(*(run(p, d) for p, d in zip(prompts, delays, strict=True)))
    return time.perf_counter() - begin, ttfts, itls, totals, tokens


def latencies(ttfts: list[float], itls: list[float]) -> str:
    """p50 and p99 of the times to first token and of the inter-token latencies, in ms."""
    ttft = f"TTFT p50 {percentile(ttfts, 0.5) * 1e3:7.1f} ms p99 {percentile(ttfts, 0.99) * 1e3:7.1f} ms"
    return f"{ttft} | ITL p50 {percentile(itls, 0.5) * 1e3:6.2f} ms p99 {percentile(itls, 0.99) * 1e3:6.2f} ms"


def report(name: str, elapsed: float, ttfts: list[float], itls: list[float], tokens: int, n: int) -> float:
    """Print one path's throughput and latencies; returns its output tokens per second."""
    print(f"{name:>7}: {n / elapsed:6.2f} req/s {tokens / elapsed:8.1f} tok/s | {latencies(ttfts, itls)}")
    return tokens / elapsed


def offline_rate(llm: LLM, prompts: list[str], max_tokens: int) -> float:
    """Output tokens per second of the requests through ``LLM.generate``, in this process."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


async def grpc_stream(stub: spindle_pb2_grpc.SpindleServiceStub, prompt: str, params) -> tuple[list[float], int]:
    """One greedy ``Generate`` stream of ``prompt``: the arrival time of each token streamed, and their count."""
    times = []
    request = spindle_pb2.GenerateRequest(prompt=spindle_pb2.Prompt(text=prompt), sampling_params=params)
    async for response in stub.Generate(request):
        now = time.perf_counter()
        times += [now] * sum(len(c.token_ids) for c in response.choices)
    return times, len(times)


async def completion_stream(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[list[float], int]:
    """One streamed greedy OpenAI text completion (eos ignored): the arrival time of each SSE chunk with text, and
    the completion tokens of the usage the stream ends with (0 without one)."""
    times, tokens = [], 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return times, tokens


async def grpc_run(address: str, prompts: list[str], args):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spindle_pb2_grpc.SpindleServiceStub(channel)
        params = sampling_params(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        return await drive(lambda prompt: grpc_stream(stub, prompt, params), prompts, args)


async def openai_run(base_url: str, prompts: list[str], args):
    """The requests as streamed OpenAI text completions to ``base_url`` (a gateway's, or any OpenAI server's).

    Each SSE chunk's arrival is one time; the token count comes from the usage the stream ends with.
    """
    async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600) as client:
        [model] = (await client.models.list()).data
        return await drive(lambda prompt: completion_stream(client, model.id, prompt, args.max_tokens), prompts, args)


async def engine_run(engine: AsyncLLMEngine, prompts: list[str], args):
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    async def one(prompt: str) -> tuple[list[float], int]:
        times = []
        async for output in engine.generate(prompt, params, delta=True):
            times += [time.perf_counter()] * len(output.outputs[0].token_ids)
        return times, len(times)

    return await drive(one, prompts, args)


def make_prompts(run: int, n: int) -> list[str]:
    """``n`` short requests new to the prefix cache, as long in every run (its number is written with 3 digits)."""
    return [f"Run {run:03d}, request {i}: tell me about the number {i * 7}." for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64, help="0: unlimited (use with --rate)")
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0 sends at once")
    parser.add_argument("--rounds", type=int, default=3, help="engine, gRPC and offline runs, interleaved")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--http", action="store_true", help="also through spindle serve's --http-port, OpenAI SSE")
    parser.add_argument("--gateway", action="store_true", help="also through the SMG gateway (PyPI smg), OpenAI SSE")
    args = parser.parse_args()
    config = EngineConfig.of(model=args.model, kv_cache_memory=args.kv_cache_memory)
    n = args.num_requests
    # The same stream offline: no more requests at a time than the clients keep in flight.
    in_flight = {"max_num_seqs": args.concurrency} if 0 < args.concurrency < n else {}
    llm = LLM(config.model.model, kv_cache_memory=config.cache.kv_cache_memory, **in_flight)
    paths = ["engine", "gRPC", *(["HTTP"] if args.http else []), *(["gateway"] if args.gateway else [])]
    rates: dict[str, list[float]] = {path: [] for path in [*paths, "offline"]}
    times = {path: ([], [], []) for path in paths}  # TTFTs, ITLs, request latencies over all rounds
    cpu = {path: collections.Counter() for path in paths}  # CPU seconds per process, and the tokens generated
    with spindle_server(config, args.port, args.http) as server, contextlib.ExitStack() as stack:
        processes = {"this process": os.getpid(), "spindle serve": server.frontend.pid, "backend": server.backend.pid}
        engine = AsyncLLMEngine.from_args(backend_address=server.backend_address)
        address = f"127.0.0.1:{server.port}"
        runs = {
            "engine": lambda prompts: asyncio.run(engine_run(engine, prompts, args)),
            "gRPC": lambda prompts: asyncio.run(grpc_run(address, prompts, args)),
        }
        if args.http:
            runs["HTTP"] = lambda prompts: asyncio.run(openai_run(server.http_url, prompts, args))
        if args.gateway:
            base_url = stack.enter_context(smg_gateway(server.port))
            runs["gateway"] = lambda prompts: asyncio.run(openai_run(base_url, prompts, args))
        run_numbers = itertools.count()
        try:
            for run in runs.values():
                run(make_prompts(next(run_numbers), 4))  # warm-ups
            offline_rate(llm, make_prompts(next(run_numbers), 4), args.max_tokens)
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}/{args.rounds}")
                for path, run in runs.items():
                    before = {name: cpu_seconds(pid) for name, pid in processes.items()}
                    elapsed, *latency, tokens = run(make_prompts(next(run_numbers), n))
                    cpu[path].update({name: cpu_seconds(pid) - before[name] for name, pid in processes.items()})
                    cpu[path]["tokens"] += tokens
                    rates[path].append(report(path, elapsed, *latency[:2], tokens, n))
                    for kept, new in zip(times[path], latency, strict=True):
                        kept.extend(new)
                rates["offline"].append(offline_rate(llm, make_prompts(next(run_numbers), n), args.max_tokens))
                print(f"offline: {rates['offline'][-1]:8.1f} tok/s (LLM.generate)")
        finally:
            engine.shutdown()
    print(f"over {args.rounds} rounds (medians of the rates; latencies over all requests):")
    for path, (ttfts, itls, _) in times.items():
        ratio = statistics.median(r / o for r, o in zip(rates[path], rates["offline"], strict=True))
        rate = statistics.median(rates[path])
        print(f"{path:>7}: {rate:8.1f} tok/s, {ratio:.0%} of offline | {latencies(ttfts, itls)}")
    cap = f", at most {args.concurrency} requests at a time" if in_flight else ""
    print(f"offline: {statistics.median(rates['offline']):8.1f} tok/s (LLM.generate{cap})")
    print("CPU a generated token over all rounds (this process: the load generator, and the engine path's frontend):")
    for path, spent in cpu.items():
        parts = ", ".join(f"{name} {1e6 * spent[name] / spent['tokens']:5.1f} us" for name in processes)
        print(f"{path:>7}: {parts}")
    print("as fractions of the engine path (rate: median over rounds of the ratio; latencies: ratio of the p50s):")
    for path in paths[1:]:
        rate = statistics.median(r / e for r, e in zip(rates[path], rates["engine"], strict=True))
        pairs = zip(times[path], times["engine"], strict=True)
        medians = [percentile(kept, 0.5) / percentile(base, 0.5) for kept, base in pairs]
        print(f"{path:>7}: rate {rate:.0%} | TTFT {medians[0]:.2f}x, ITL {medians[1]:.2f}x, latency {medians[2]:.2f}x")


if __name__ == "__main__":
    main()
