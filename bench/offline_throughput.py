"""Offline batch throughput: Spindle's ``LLM.generate`` against Hugging Face transformers' ``generate``.

Both run the embedded SmolLM2-135M-Instruct on this machine's CPU, greedy, on the same prompts with the same
number of generated tokens (eos ignored so both do the same work). Prints each side's output-token rate (median
of --repeats runs) and the ratio, in one run.

    .venv/bin/python bench/offline_throughput.py --num-prompts 32 --max-tokens 64
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backend.models.loader import resolve_model
from frontend import LLM
from shared import SamplingParams

TOPICS = ["the ocean", "a small town", "machine learning", "the history of Rome", "coffee", "a robot", "winter", "jazz"]


def make_prompts(num_prompts: int) -> list[str]:
    """Prompts of different lengths: a topic and a growing amount of context."""
    prompts = []
    for i in range(num_prompts):
        topic = TOPICS[i % len(TOPICS)]
        prompts.append(f"Write a short story about {topic}. " + "Make it vivid and surprising. " * (i % 7))
    return prompts


def bench_spindle(prompts: list[str], max_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    llm = LLM(kv_cache_memory="2GiB")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
    return statistics.median(rates), [o.outputs[0].token_ids for o in outputs]


def bench_transformers(prompts: list[str], max_tokens: int, repeats: int, dtype: torch.dtype) -> float:
    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(**tokenizer(prompts[:2], return_tensors="pt", padding=True), **kwargs)  # warm-up
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(**batch, **kwargs)
            rates.append((out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts)
    spindle, _ = bench_spindle(prompts, args.max_tokens, args.repeats)
    hf = bench_transformers(prompts, args.max_tokens, args.repeats, torch.float32)
    print(f"prompts={args.num_prompts} max_tokens={args.max_tokens} threads={torch.get_num_threads()}")
    print(f"spindle LLM.generate:          {spindle:8.1f} output tok/s (median of {args.repeats})")
    print(f"transformers generate (fp32):  {hf:8.1f} output tok/s (median of {args.repeats})")
    print(f"ratio spindle / transformers:  {spindle / hf:8.2f}x")


if __name__ == "__main__":
    main()
