"""What the process split costs: output-token rate of the in-process engine and of frontend + backend processes.

Both serve the same 32 concurrent greedy requests (embedded SmolLM2, default dtype, eos ignored so both do the same
work): ``LLMEngine`` stepping the engine core in this process, and ``AsyncLLMEngine`` streaming 32 ``generate()``
calls from a backend child over ZeroMQ, detokenizing in the frontend. Prints both rates (medians of ``--repeats``)
and the ratio; the target is a split that keeps at least 90% of the in-process rate.

    .venv/bin/python -m bench.split_overhead --concurrency 32 --max-tokens 64
"""

import argparse
import asyncio
import statistics
import time

from spindle import LLMEngine, SamplingParams
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine

PROMPT = "Write a short story about {}. Make it vivid."
TOPICS = ["the ocean", "a small town", "machine learning", "Rome", "coffee", "a robot", "winter", "jazz"]


def prompts(n: int) -> list[str]:
    return [PROMPT.format(TOPICS[i % len(TOPICS)]) + " " * (i // len(TOPICS)) for i in range(n)]


def in_process_rate(engine: LLMEngine, batch: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    for i, prompt in enumerate(batch):
        engine.add_request(f"{start}-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return tokens / (time.perf_counter() - start)


async def split_rate(engine: AsyncLLMEngine, batch: list[str], params: SamplingParams) -> float:
    async def one(prompt: str) -> int:
        count = 0
        async for output in engine.generate(prompt, params, delta=True):
            count += len(output.outputs[0].token_ids)
        return count

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in batch)))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    batch = prompts(args.concurrency)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    # Both engines stay loaded and the runs alternate, so drift in the machine's load hits both alike.
    local_engine = LLMEngine.from_args(kv_cache_memory="2GiB")
    split_engine = AsyncLLMEngine.from_args(kv_cache_memory="2GiB")

    async def measure() -> tuple[list[float], list[float]]:
        in_process_rate(local_engine, batch[:2], params)  # warm-ups
        await split_rate(split_engine, batch[:2], params)
        local_rates, split_rates = [], []
        for _ in range(args.repeats):
            local_rates.append(in_process_rate(local_engine, batch, params))
            split_rates.append(await split_rate(split_engine, batch, params))
        return local_rates, split_rates

    try:
        local_rates, split_rates = asyncio.run(measure())
    finally:
        split_engine.shutdown()
    local, remote = statistics.median(local_rates), statistics.median(split_rates)
    pair_ratio = statistics.median(s / i for i, s in zip(local_rates, split_rates, strict=True))
    print(f"concurrency={args.concurrency} max_tokens={args.max_tokens} (medians of {args.repeats})")
    print(f"in-process LLMEngine:        {local:8.1f} output tok/s")
    print(f"split frontend + backend:    {remote:8.1f} output tok/s")
    print(f"split / in-process:          {pair_ratio:8.1%}  (median of back-to-back pairs; target >= 90%)")


if __name__ == "__main__":
    main()
