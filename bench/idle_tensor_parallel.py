"""Does an idle tensor-parallel backend still serve after longer than its collective timeout?

Starts ``spindle backend`` with ``--tensor-parallel-size 3`` (gloo on the CPU; the embedded model has 9 heads) at
its default collective timeout (``--collective-timeout``, 600 s), runs one greedy request, leaves the engine idle for
``--idle`` seconds (15 minutes by default, past the timeout: without rank 0's keep-alives the workers' wait for the
next step would fail), then runs the same request again and checks that it gets the same text::

    python -m bench.idle_tensor_parallel            # 15 minutes idle
    python -m bench.idle_tensor_parallel --idle 60 --collective-timeout 20
"""

import argparse
import asyncio
import time

from spindle import SamplingParams
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine


async def one_request(engine: AsyncLLMEngine, request_id: str) -> str:
    """The text of one greedy request."""
    params = SamplingParams(temperature=0, max_tokens=24)
    async for output in engine.generate("The three primary colours are", params, request_id):
        text = output.outputs[0].text
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=float, default=900.0, help="seconds the engine stays idle")
    parser.add_argument("--collective-timeout", type=float, default=600.0, help="the backend's collective timeout")
    args = parser.parse_args()
    engine = AsyncLLMEngine.from_args(tensor_parallel_size=3, collective_timeout=args.collective_timeout)
    try:
        before = asyncio.run(one_request(engine, "before"))
        print(f"served: {before!r}; idle for {args.idle:.0f} s (collective timeout {args.collective_timeout:.0f} s)")
        time.sleep(args.idle)  # the point: no step for longer than the timeout
        start = time.perf_counter()
        after = asyncio.run(one_request(engine, "after"))
        print(f"served again in {time.perf_counter() - start:.2f} s: {after!r}")
        print(f"backend restarts: {engine.num_backend_restarts}; same text: {after == before}")
        if after != before or engine.num_backend_restarts:
            raise SystemExit(1)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
