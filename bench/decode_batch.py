"""Batch decode with the defaults: how close a decode step of ``--batch`` sequences comes to its matmul bound.

``LLM()`` with no flags (the embedded SmolLM2-135M-Instruct Q4_1, its projections on whatever kernel the defaults pick
on this CPU) generates for ``--batch`` new prompts (``bench.offline_throughput``'s, 10-160 words), greedy, eos
ignored, once ``--max-tokens`` tokens each and once one token: the difference is ``--max-tokens - 1`` decode steps of
the whole batch. The same pair runs again with every projection call timed (the layers' linears and the LM head,
``offline_throughput.projection_seconds``): the projections' seconds in those steps over the untimed steps' are the
share of the step that the active matmul kernels bound, the rest being attention, norms, rotary, sampling and host
work. Issue 44 asks that share to be at least 50% at batch 32. Medians of ``--repeats`` pairs; prints the default's
perplexity against the unquantized model's beside it (:func:`bench.quality.guard`)::

    .venv/bin/python -m bench.decode_batch --batch 32
"""

import argparse
import statistics

import torch

from bench import quality
from bench.offline_throughput import make_prompts, projection_seconds, spindle_run
from spindle import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM()
    batch, steps = args.batch, args.max_tokens - 1
    first = 0

    def prompts() -> list[str]:  # new numbers each run: no prompt finds another's blocks in the prefix cache
        nonlocal first
        first += batch
        return make_prompts(batch, first)

    spindle_run(llm, prompts(), [args.max_tokens] * batch)  # warm-up
    step_ms, shares = [], []
    for _ in range(args.repeats):
        long, _ = spindle_run(llm, prompts(), [args.max_tokens] * batch)
        short, _ = spindle_run(llm, prompts(), [1] * batch)
        step_ms.append((long - short) / steps * 1e3)
        _, long_projections = projection_seconds(llm, prompts(), [args.max_tokens] * batch)
        _, short_projections = projection_seconds(llm, prompts(), [1] * batch)
        shares.append((long_projections - short_projections) / (long - short))
    step, share = statistics.median(step_ms), statistics.median(shares)
    print(f"batch {batch} decode with the defaults, {torch.get_num_threads()} threads, medians of {args.repeats}:")
    print(f"  {step:.2f} ms a step ({batch / step * 1e3:.0f} tok/s); its projections {share:.0%} of it")
    each = ", ".join(f"{s:.0%}" for s in shares)
    print(f"  (each pair's share: {each}; the projections alone: {step * share:.2f} ms a step)")
    print(f"  {quality.guard(llm)}")


if __name__ == "__main__":
    main()
