"""Soak test: many concurrent gRPC clients with random prompts, parameters, cancellations and deadlines, for a while.

Starts a backend and ``spindle serve`` on the embedded model (or ``--model``), runs ``--clients`` client loops for
``--duration`` seconds and samples the resident memory of both processes every ``--sample-every`` seconds. At the end,
once idle, it checks that every KV block is free again, and prints the RSS table and the backend's growth after the
warm-up (the first ``--warmup`` seconds, when per-shape caches and the allocator's pools fill)::

    python -m bench.soak --duration 1800 --clients 48
"""

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.serving import spindle_server
from spindle.client import sampling_params
from spindle.shared.config import EngineConfig
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

WORDS = "the a river stone light market number story engine winter quiet bright seven city garden letter".split()


def rss_mib(pid: int) -> float:
    """Resident set size of a process, MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Tally:
    """Outcomes of the requests sent."""

    outcomes: dict[str, int] = field(default_factory=dict)
    tokens: int = 0

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def random_request(rng: random.Random) -> spindle_pb2.GenerateRequest:
    """A prompt of 3-300 words and a random mix of sampling parameters."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 300)))
    params = sampling_params(
        temperature=rng.choice([0.0, 0.7, 1.0]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 40]),
        max_tokens=rng.randint(1, 160),
        n=rng.choice([1, 1, 1, 2]),
        seed=rng.choice([None, rng.randrange(2**31)]),
        logprobs=rng.choice([None, None, 3]),
        repetition_penalty=rng.choice([1.0, 1.1]),
    )
    return spindle_pb2.GenerateRequest(prompt=spindle_pb2.Prompt(text=prompt), sampling_params=params)


async def client(stub: spindle_pb2_grpc.SpindleServiceStub, seed: int, until: float, tally: Tally) -> None:
    """Send requests back to back until ``until``: some cancelled part-way, some with a short deadline."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        request = random_request(rng)
        action = rng.random()
        timeout = rng.uniform(0.05, 2.0) if action < 0.15 else None
        call = stub.Generate(request, timeout=timeout)
        cancel_after = rng.randint(1, 8) if 0.15 <= action < 0.3 else None
        try:
            async for response in call:
                tally.tokens += sum(len(choice.token_ids) for choice in response.choices)
                if cancel_after is not None and (cancel_after := cancel_after - 1) == 0:
                    call.cancel()
                    break
            tally.add("cancelled" if cancel_after == 0 else "ok")
        except grpc.aio.AioRpcError as error:
            tally.add(error.code().name)


async def soak(port: int, args: argparse.Namespace, pids: dict[str, int]) -> tuple[list[tuple], Tally, object]:
    tally = Tally()
    samples: list[tuple] = []
    start = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = spindle_pb2_grpc.SpindleServiceStub(channel)
        until = start + args.duration
        clients = [asyncio.create_task(client(stub, i, until, tally)) for i in range(args.clients)]
        while time.monotonic() < until:
            rss = [rss_mib(pid) for pid in pids.values()]
            samples.append((time.monotonic() - start, *rss))
            print(
                f"{samples[-1][0]:7.0f} s  " + "  ".join(f"{n} {r:7.1f} MiB" for n, r in zip(pids, rss, strict=True)),
                flush=True,
            )
            await asyncio.sleep(min(args.sample_every, max(0.0, until - time.monotonic())))
        await asyncio.gather(*clients)
        await asyncio.sleep(2)  # let aborts of the last cancelled requests land
        info = await stub.GetServerInfo(spindle_pb2.GetServerInfoRequest())
        samples.append((time.monotonic() - start, *(rss_mib(pid) for pid in pids.values())))
    return samples, tally, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--warmup", type=float, default=None, help="seconds not counted (default: a sixth, <= 300)")
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else min(300.0, args.duration / 6)

    with spindle_server(EngineConfig.of(model=args.model, kv_cache_memory=args.kv_cache_memory)) as server:
        pids = {"frontend": server.frontend.pid, "backend": server.backend.pid}
        samples, tally, info = asyncio.run(soak(server.port, args, pids))

    print(f"\nrequests: {dict(sorted(tally.outcomes.items()))}, {tally.tokens} tokens streamed")
    print(f"KV blocks free after the load: {info.num_free_kv_blocks} of {info.num_total_kv_blocks}")
    for column, name in enumerate(pids, start=1):
        after = [s[column] for s in samples if s[0] >= warmup]
        base = next((s[column] for s in samples if s[0] >= warmup), samples[-1][column])
        print(
            f"{name}: {samples[0][column]:.0f} MiB at start, {base:.0f} after {warmup:.0f} s warm-up, "
            f"max {max(after, default=base):.0f}, end {samples[-1][column]:.0f} "
            f"({(samples[-1][column] / base - 1) * 100:+.1f}% since the warm-up)"
        )
    errors = {k: v for k, v in tally.outcomes.items() if k not in ("ok", "cancelled", "DEADLINE_EXCEEDED")}
    if errors or info.num_free_kv_blocks != info.num_total_kv_blocks:
        raise SystemExit(f"errors {errors} or KV blocks still held")


if __name__ == "__main__":
    main()
