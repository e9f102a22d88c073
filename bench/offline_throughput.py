"""Offline batch throughput: Spindle's ``LLM.generate`` against Hugging Face transformers' ``generate``.

Both run the embedded SmolLM2-135M-Instruct on this machine's CPU, greedy, on the same prompts, in float32 and in
bfloat16. Two workloads:

- ``fixed``: every prompt generates ``--max-tokens`` tokens (eos ignored): a static batch's best case.
- ``varied``: prompt ``i`` generates its own length, from ``--max-tokens / 4`` up to ``--max-tokens``, as real
  requests do. transformers' batch runs until its longest request is done; only the tokens each request asked for
  count as output.

Prints each side's output-token rate (median of ``--repeats`` runs) and the ratios, in one run:

    .venv/bin/python -m bench.offline_throughput --num-prompts 32 --max-tokens 64
"""

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spindle import LLM, SamplingParams
from spindle.backend.models.loader import resolve_model

TOPICS = ["the ocean", "a small town", "machine learning", "the history of Rome", "coffee", "a robot", "winter", "jazz"]


def make_prompts(num_prompts: int) -> list[str]:
    """Prompts of different lengths: a topic and a growing amount of context."""
    prompts = []
    for i in range(num_prompts):
        topic = TOPICS[i % len(TOPICS)]
        prompts.append(f"Write a short story about {topic}. " + "Make it vivid and surprising. " * (i % 7))
    return prompts


def output_lengths(workload: str, num_prompts: int, max_tokens: int) -> list[int]:
    """How many tokens each prompt generates in ``workload``."""
    if workload == "fixed":
        return [max_tokens] * num_prompts
    rng = random.Random(0)
    return [rng.randint(max_tokens // 4, max_tokens) for _ in range(num_prompts)]


def bench_spindle(
    model: str | None, prompts: list[str], lengths: list[int], repeats: int, dtype: str, quantization: str
) -> float:
    llm = LLM(model, kv_cache_memory="2GiB", dtype=dtype, quantization=quantization)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_transformers(
    model: str | None, prompts: list[str], lengths: list[int], repeats: int, dtype: torch.dtype
) -> float:
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    longest = max(lengths)
    kwargs = dict(max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(**tokenizer(prompts[:2], return_tensors="pt", padding=True), **kwargs)  # warm-up
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(**batch, **kwargs)
            rates.append(sum(lengths) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["fixed", "varied"], choices=["fixed", "varied"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", help="Spindle's --quantization (auto: the file's int4)")
    parser.add_argument("--model", default=None, help="a model directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers (a large model on a GPU, say)")
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts)
    print(
        f"prompts={args.num_prompts} max_tokens={args.max_tokens} threads={torch.get_num_threads()} "
        f"spindle quantization={args.quantization}"
    )
    for workload in args.workloads:
        lengths = output_lengths(workload, args.num_prompts, args.max_tokens)
        for dtype in args.dtypes:
            spindle = bench_spindle(args.model, prompts, lengths, args.repeats, dtype, args.quantization)
            if args.no_peer:
                print(f"{workload:6s} {dtype:8s}  spindle {spindle:7.1f} tok/s  (median of {args.repeats})")
                continue
            hf = bench_transformers(args.model, prompts, lengths, args.repeats, getattr(torch, dtype))
            print(
                f"{workload:6s} {dtype:8s}  spindle {spindle:7.1f} tok/s  transformers {hf:7.1f} tok/s  "
                f"ratio {spindle / hf:5.2f}x  (medians of {args.repeats})"
            )


if __name__ == "__main__":
    main()
