"""Offline batch throughput: Spindle's ``LLM.generate`` against Hugging Face transformers' ``generate``.

Both run the embedded SmolLM2-135M-Instruct on this machine's CPU, greedy (eos ignored), on the same prompts of 10 to
160 words. Two workloads:

- ``varied`` (the default): prompt ``i`` generates its own length, from ``--min-tokens`` to ``--max-tokens``, as real
  requests do. transformers runs static batches of ``--peer-batches`` prompts (its best size counts); each batch runs
  until its longest request is done, and only the tokens each request asked for count as output.
- ``fixed``: every prompt generates ``--max-tokens`` tokens: a static batch's best case.

``--dtypes auto`` is what ``LLM`` picks on this CPU (bf16 with AVX-512 bf16, else float32). Prints each side's
output-token rate (median of ``--repeats`` runs), the ratio per dtype and against transformers' best dtype, and the
fraction of the machine's matmul rate that Spindle's run achieved: the run's FLOPs (every projection, the attention
and the LM head rows sampled, counted from the model's shapes and the run's token counts) over its time, against a
large ``torch.mm`` in the same dtype, measured in the same run. Defaults are the workload of issue 10 (64 prompts,
16 to 192 tokens each, transformers at batch 32 and 64):

    .venv/bin/python -m bench.offline_throughput

``--projection-bound`` adds one more Spindle run with every projection call timed (the layers' linears and the LM
head, whichever kernel each call runs): their share of the run, and the rate the run would reach if nothing else took
any time, the bound that this machine's matmul kernels set on any engine that computes the same projections.
"""

import argparse
import random
import statistics
import time
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.flops import Shapes, matmul_rate
from spindle import LLM, SamplingParams
from spindle.backend.models.loader import resolve_dtype, resolve_model
from spindle.kernels.linear import Projection

TOPICS = ["the ocean", "a small town", "machine learning", "the history of Rome", "coffee", "a robot", "winter", "jazz"]
CONTEXT = "Make it vivid and surprising, with a twist at the end. "  # 10 words


def make_prompts(num_prompts: int, first: int = 0) -> list[str]:
    """Prompts of 10 to 160 words: a topic numbered from ``first`` and a different amount of context for each.

    The number comes within the first cache block, so that no two prompts share a cached prefix: the prefill is
    computed in full, as transformers computes it. Each run needs prompts of its own numbers (the same words
    otherwise): a run of the same prompts again finds all but their last blocks in the prefix cache (6,384 of 6,934
    prompt tokens), which made a median of three runs 40% faster than the first.
    """
    return [
        f"Story {first + i}: write about {TOPICS[i % len(TOPICS)]}. " + CONTEXT * ((i * 7) % 16)
        for i in range(num_prompts)
    ]


def output_lengths(workload: str, num_prompts: int, min_tokens: int, max_tokens: int) -> list[int]:
    """How many tokens each prompt generates in ``workload``."""
    if workload == "fixed":
        return [max_tokens] * num_prompts
    rng = random.Random(0)
    return [rng.randint(min_tokens, max_tokens) for _ in range(num_prompts)]


def greedy_params(lengths: list[int]) -> list[SamplingParams]:
    """Greedy sampling of exactly ``lengths[i]`` tokens for prompt ``i`` (eos ignored), as transformers runs them."""
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]


def bench_spindle(llm: LLM, runs: list[list[str]], lengths: list[int]) -> tuple[float, float, list[int]]:
    """``llm``'s median output rate over ``runs`` (prompts of their own each), the median run's seconds, and the
    prompts' token counts (of the last run)."""
    params = greedy_params(lengths)
    llm.generate(make_prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, on prompts no run has
    times = []
    for prompts in runs:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
        assert not any(o.num_cached_tokens for o in outputs)  # every prefill computed, as transformers computes it
    seconds = statistics.median(times)
    return sum(lengths) / seconds, seconds, [len(o.prompt_token_ids) for o in outputs]


def projection_seconds(llm: LLM, prompts: list[str], lengths: list[int]) -> tuple[float, float]:
    """One run of ``llm`` on ``prompts`` with every projection call timed: the run's seconds and the projections'.

    ``LLM`` steps the model in this process, so the timer sees every call; the wrapper adds ~1 us to each of a
    step's ~120 calls.
    """
    spent = 0.0
    call = Projection.__call__

    def timed(projection: Projection, x: torch.Tensor) -> torch.Tensor:
        nonlocal spent
        start = time.perf_counter()
        out = call(projection, x)
        spent += time.perf_counter() - start
        return out

    params = greedy_params(lengths)
    with mock.patch.object(Projection, "__call__", timed):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, spent


def bench_transformers(
    model: str | None, runs: list[list[str]], lengths: list[int], dtype: torch.dtype, batch_sizes: list[int]
) -> tuple[float, int]:
    """transformers' best median output rate over ``runs`` in static batches of ``batch_sizes``, and the size that
    gave it.

    Each batch runs until its longest request is done.
    """
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    greedy = dict(do_sample=False, pad_token_id=0)
    best = (0.0, 0)
    with torch.inference_mode():
        hf.generate(**tokenizer(make_prompts(2), return_tensors="pt", padding=True), max_new_tokens=4, **greedy)
        for size in batch_sizes:
            rates = []
            for prompts in runs:
                batches = [(prompts[i : i + size], max(lengths[i : i + size])) for i in range(0, len(prompts), size)]
                start = time.perf_counter()
                for chunk, longest in batches:
                    inputs = tokenizer(chunk, return_tensors="pt", padding=True)
                    hf.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, **greedy)
                rates.append(sum(lengths) / (time.perf_counter() - start))
            best = max(best, (statistics.median(rates), size))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=16, help="the varied workload's shortest output")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["varied"], choices=["fixed", "varied"])
    parser.add_argument("--dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--peer-batches", type=int, nargs="+", default=[32, 64], help="transformers' batch sizes")
    parser.add_argument("--quantization", default="auto", help="Spindle's --quantization (auto: the file's int4)")
    parser.add_argument("--model", default=None, help="a model directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers (a large model on a GPU, say)")
    parser.add_argument(
        "--projection-bound", action="store_true", help="one more run, its projections timed: the rate they allow"
    )
    args = parser.parse_args()
    if args.projection_bound and torch.cuda.is_available():
        parser.error("--projection-bound times the CPU path's calls; a CUDA call returns before its kernel has run")
    # Numbered past the warm-up's two prompts, and past each other.
    runs = [make_prompts(args.num_prompts, first=2 + r * args.num_prompts) for r in range(args.repeats)]
    dtypes = list(dict.fromkeys(resolve_dtype(d, torch.device("cpu")) for d in args.dtypes))
    shapes = Shapes.of(str(resolve_model(args.model)))
    print(
        f"prompts={args.num_prompts} threads={torch.get_num_threads()} spindle quantization={args.quantization} "
        f"transformers batches={args.peer_batches}"
    )
    for workload in args.workloads:
        lengths = output_lengths(workload, args.num_prompts, args.min_tokens, args.max_tokens)
        print(f"{workload}: {min(lengths)}-{max(lengths)} tokens per prompt, {sum(lengths)} in all")
        rates: dict[torch.dtype, tuple[float, float]] = {}
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            llm = LLM(args.model, kv_cache_memory="2GiB", dtype=name, quantization=args.quantization)
            spindle, seconds, prompt_lens = bench_spindle(llm, runs, lengths)
            bound = None
            if args.projection_bound:
                prompts = make_prompts(args.num_prompts, first=2 + args.repeats * args.num_prompts)
                run_seconds, spent = projection_seconds(llm, prompts, lengths)
                bound = sum(lengths) / spent
                print(
                    f"  {name:8s} projections {spent:.1f} s of a {run_seconds:.1f} s run ({spent / run_seconds:.0%}): "
                    f"with all else free, {bound:.1f} tok/s"
                )
            del llm  # its KV cache freed before transformers loads
            achieved, ceiling = shapes.flops(prompt_lens, lengths) / seconds, matmul_rate(dtype)
            line = (
                f"  {name:8s} spindle {spindle:7.1f} tok/s = {achieved / 1e9:5.1f} GFLOP/s, "
                f"{achieved / ceiling:4.0%} of this machine's {name} matmul rate ({ceiling / 1e9:.0f} GFLOP/s)"
            )
            if not args.no_peer:
                hf, size = bench_transformers(args.model, runs, lengths, dtype, args.peer_batches)
                rates[dtype] = (spindle, hf)
                line += f"  transformers {hf:7.1f} tok/s (batch {size})  ratio {spindle / hf:5.2f}x"
                if bound is not None:
                    line += f" (projection bound {bound / hf:.2f}x)"
            print(line + f"  (medians of {args.repeats})", flush=True)
        if rates:
            best_dtype, (_, best_hf) = max(rates.items(), key=lambda item: item[1][1])
            spindle_best = max(spindle for spindle, _ in rates.values())
            print(
                f"  best: spindle {spindle_best:.1f} tok/s against transformers' best ({best_dtype}) "
                f"{best_hf:.1f} tok/s: {spindle_best / best_hf:.2f}x"
            )


if __name__ == "__main__":
    main()
