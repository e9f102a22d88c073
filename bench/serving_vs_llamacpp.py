"""Serving against llama.cpp's server: ``spindle serve`` through gRPC and ``llama-server`` through its OpenAI API, on
the same GGUF file, the same cores and the same request stream.

Both serve the embedded SmolLM2-135M-Instruct Q4_1 (or ``--gguf``) with their defaults on every core (Spindle:
``spindle serve``'s; llama.cpp: ``--threads``, the cores by default, one slot per concurrent client, continuous
batching, 1,024 tokens of context a slot). The stream: ``--num-requests`` prompts of 20-200 random words, each with
its own greedy length of ``--min-tokens`` to ``--max-tokens`` tokens (eos ignored), ``--concurrency`` clients at a
time. Each of ``--rounds`` rounds runs both servers on its own prompts, one after the other. Prints each round's
output tokens/s, mean time to first token and median inter-token latency, then the medians over rounds and Spindle's
ratios (issue 44 asks for 4x the rate, and a mean TTFT and median ITL no worse than a third of llama.cpp's)::

    .venv/bin/python -m bench.serving_vs_llamacpp --rounds 3

llama-server comes from ``bench.llamacpp``'s build of the ``bench`` extra's pinned sdist (built on first use).
"""

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import time
from pathlib import Path

import grpc
import openai

from bench import llamacpp, quality
from bench.serving import completion_stream, drive, grpc_stream, spindle_server
from spindle import LLM
from spindle.backend.models.loader import embedded_gguf
from spindle.client import sampling_params
from spindle.shared.config import EngineConfig
from spindle.v1 import spindle_pb2_grpc

WORDS = (
    "river city market window garden morning number story letter music paper table voice street light winter "
    "summer friend teacher doctor engine bridge forest mountain island harbor village station kitchen library "
    "question answer reason minute evening history science travel weather animal flower"
).split()

Request = tuple[str, int]
"""A prompt and the greedy tokens it asks for."""


def make_requests(round_: int, n: int, args: argparse.Namespace) -> list[Request]:
    """``n`` requests of this round, new to either server's cache: random words and lengths, seeded by the round."""
    rng = random.Random(round_)
    requests = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(20, 200))]
        requests.append(
            (f"Round {round_} request {i}: {' '.join(words)}", rng.randint(args.min_tokens, args.max_tokens))
        )
    return requests


async def grpc_requests(address: str, requests: list[Request], args: argparse.Namespace):
    """The requests through Spindle's gRPC ``Generate`` stream: one time per streamed token."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = spindle_pb2_grpc.SpindleServiceStub(channel)

        async def one(request: Request) -> tuple[list[float], int]:
            prompt, max_tokens = request
            return await grpc_stream(
                stub, prompt, sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )

        return await drive(one, requests, args)


async def openai_requests(base_url: str, requests: list[Request], args: argparse.Namespace):
    """The requests as streamed OpenAI text completions: one time per SSE chunk with text (llama-server sends one a
    token), the count from the final usage.

    Each request opens its own connection: llama-server's HTTP library closes a kept-alive connection after a few
    requests, and a pooled one reused as it closes failed a request ("Server disconnected without sending a response").
    """

    async def one(request: Request) -> tuple[list[float], int]:
        prompt, max_tokens = request
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1200) as client:
            times, tokens = await completion_stream(client, "model", prompt, max_tokens)
        return times, tokens or len(times)

    return await drive(one, requests, args)


def llama_server(gguf: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start ``llama-server`` on ``gguf`` (one slot per client, 1,024 tokens of context each); its OpenAI base URL
    once it answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tool = llamacpp.build().tool("llama-server")
    command = [str(tool), "-m", str(gguf), "-t", str(args.threads), "-np", str(args.concurrency)]
    command += ["-c", str(1024 * args.concurrency), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    deadline = time.monotonic() + 300
    while True:
        try:
            client.models.list()
            return server, base_url
        except openai.OpenAIError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise SystemExit(f"llama-server did not answer within 300 s (exit code {server.poll()})") from None
            time.sleep(0.5)


def summary(elapsed: float, ttfts: list[float], itls: list[float], tokens: int) -> tuple[float, float, float]:
    """Output tokens/s, mean TTFT (s) and median inter-token latency (s) of one run."""
    return tokens / elapsed, statistics.mean(ttfts), statistics.median(itls)


def main() -> None:
    """Run both servers on the same stream for ``--rounds`` rounds and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2 Q4_1")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's (Spindle uses every core)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.rate = 0.0  # drive()'s arrivals: all at once, --concurrency at a time
    gguf = args.gguf or embedded_gguf()
    results: dict[str, list[tuple[float, float, float]]] = {"spindle": [], "llama.cpp": []}
    server, base_url = llama_server(gguf, args)
    try:
        with spindle_server(EngineConfig.of(model=str(gguf))) as spindle:
            address = f"127.0.0.1:{spindle.port}"
            asyncio.run(grpc_requests(address, make_requests(1000, 4, args), args))  # warm-ups
            asyncio.run(openai_requests(base_url, make_requests(1001, 4, args), args))
            for round_ in range(args.rounds):
                requests = make_requests(round_, args.num_requests, args)
                elapsed, ttfts, itls, _, tokens = asyncio.run(grpc_requests(address, requests, args))
                results["spindle"].append(summary(elapsed, ttfts, itls, tokens))
                elapsed, ttfts, itls, _, tokens = asyncio.run(openai_requests(base_url, requests, args))
                results["llama.cpp"].append(summary(elapsed, ttfts, itls, tokens))
                for name, runs in results.items():
                    rate, ttft, itl = runs[-1]
                    print(
                        f"round {round_ + 1}, {name:>9}: {rate:7.1f} tok/s, TTFT mean {ttft:6.2f} s, ITL p50 "
                        f"{itl * 1e3:6.1f} ms"
                    )
    finally:
        server.terminate()
        server.wait(60)
    print(f"{args.num_requests} requests, {args.concurrency} at a time, {args.threads} threads, {gguf.name}; medians:")
    medians = {name: [statistics.median(run[k] for run in runs) for k in range(3)] for name, runs in results.items()}
    for name, (rate, ttft, itl) in medians.items():
        print(f"  {name:>9}: {rate:7.1f} tok/s, TTFT mean {ttft:6.2f} s, ITL p50 {itl * 1e3:6.1f} ms")
    (ours_rate, ours_ttft, ours_itl), (peer_rate, peer_ttft, peer_itl) = medians["spindle"], medians["llama.cpp"]
    print(
        f"  spindle / llama.cpp: rate {ours_rate / peer_rate:.2f}x, TTFT {ours_ttft / peer_ttft:.2f}x, "
        f"ITL {ours_itl / peer_itl:.2f}x (asked: >= 4x, <= 0.33x, <= 0.33x)"
    )
    print(f"  spindle's defaults (LLM() on the same file): {quality.guard(LLM(str(gguf)), str(gguf))}")


if __name__ == "__main__":
    main()
