"""Offline batch throughput: Spindle's ``LLM.generate`` against Hugging Face transformers' ``generate``.

Both run the embedded SmolLM2-135M-Instruct on this machine's CPU, greedy (eos ignored), on the same prompts of 10 to
160 words. Two workloads:

- ``varied`` (the default): prompt ``i`` generates its own length, from ``--min-tokens`` to ``--max-tokens``, as real
  requests do. transformers runs static batches of ``--peer-batches`` prompts (its best size counts); each batch runs
  until its longest request is done, and only the tokens each request asked for count as output.
- ``fixed``: every prompt generates ``--max-tokens`` tokens: a static batch's best case.

``--dtypes auto`` is what ``LLM`` picks on this CPU (bf16 with AVX-512 bf16, else float32). Both sides are loaded
together and run in ``--repeats`` rounds (Spindle, then transformers at each batch size, on the round's prompts), so
that a shared machine's drift over minutes weighs on both alike. Prints each side's output-token rate (median of the
rounds), the ratio per dtype (median of the rounds' ratios against transformers' best batch size, each round's
listed), with several dtypes the ratio against transformers' best dtype, and the fraction of the machine's matmul
rate that Spindle's run achieved: the run's FLOPs (every projection, the attention and the LM head rows sampled,
counted from the model's shapes and the run's token counts) over its time, against a large ``torch.mm`` in the same
dtype, measured in the same run; and beside each dtype's line the engine's perplexity against the unquantized model's
(:func:`bench.quality.guard`). Defaults are the workload of issue 10 (64 prompts, 16 to 192 tokens each,
transformers at batch 32 and 64):

    .venv/bin/python -m bench.offline_throughput

``--projection-bound`` adds one more Spindle run with every projection call timed (the layers' linears and the LM
head, whichever kernel each call runs): their share of the run, and the rate the run would reach if nothing else took
any time, the bound that this machine's matmul kernels set on any engine that computes the same projections.

``--enforce-eager`` runs Spindle on torch's ops alone (``enforce_eager=True``: no C++ kernels of ours on the CPU, no
CUDA graphs), the path a machine without a compiler takes, against the same peer.
"""

import argparse
import random
import statistics
import time
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench import quality
from bench.flops import Shapes, matmul_rate
from spindle import LLM, SamplingParams
from spindle.backend.models.llama import LlamaForCausalLM
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


def spindle_run(llm: LLM, prompts: list[str], lengths: list[int]) -> tuple[float, list[int]]:
    """One run of ``llm`` on ``prompts``: its seconds and the prompts' token counts."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy_params(lengths), use_tqdm=False)
    seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert not any(o.num_cached_tokens for o in outputs)  # every prefill computed, as transformers computes it
    return seconds, [len(o.prompt_token_ids) for o in outputs]


def projection_seconds(llm: LLM, prompts: list[str], lengths: list[int]) -> tuple[float, float]:
    """One run of ``llm`` on ``prompts`` with every projection call timed: the run's seconds and the projections'.

    ``LLM`` steps the model in this process, so the timer sees every call; the wrapper adds ~1 us to each of a
    step's ~120 calls. The decode steps run their layers in Python here, not in the C++ ``DecodeStack``, whose
    projections the timer would not see: the same kernels on the same inputs, with more host time between them (so
    the run's own seconds overstate the defaults'; divide the projections' by an untimed run's).
    """
    spent = 0.0
    call = Projection.__call__

    def timed(projection: Projection, x: torch.Tensor) -> torch.Tensor:
        nonlocal spent
        start = time.perf_counter()
        out = call(projection, x)
        spent += time.perf_counter() - start
        return out

    def no_stack(model: LlamaForCausalLM, kv_caches: object) -> None:
        return None

    params = greedy_params(lengths)
    stack_off = mock.patch.object(LlamaForCausalLM, "_decode_stack", no_stack)
    with mock.patch.object(Projection, "__call__", timed), stack_off:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, spent


class Transformers:
    """The peer: transformers' ``generate`` on the same model, in static batches."""

    def __init__(self, model: str | None, dtype: torch.dtype) -> None:
        model_dir = resolve_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.run(make_prompts(2), [4, 4], 2)  # warm-up, on prompts no run has

    def run(self, prompts: list[str], lengths: list[int], size: int) -> float:
        """Seconds to generate ``lengths[i]`` tokens for prompt ``i`` in batches of ``size``; each batch runs until
        its longest request is done."""
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), size):
                longest = max(lengths[i : i + size])
                inputs = self.tokenizer(prompts[i : i + size], return_tensors="pt", padding=True)
                self.model.generate(
                    **inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0
                )
        return time.perf_counter() - start


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
    parser.add_argument(
        "--enforce-eager", action="store_true", help="Spindle on torch's ops alone (no C++ kernels, no CUDA graphs)"
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
        f"enforce_eager={args.enforce_eager} transformers batches={args.peer_batches}"
    )
    for workload in args.workloads:
        lengths = output_lengths(workload, args.num_prompts, args.min_tokens, args.max_tokens)
        print(f"{workload}: {min(lengths)}-{max(lengths)} tokens per prompt, {sum(lengths)} in all")
        rates: dict[torch.dtype, tuple[float, float]] = {}
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            llm = LLM(
                args.model,
                kv_cache_memory="2GiB",
                dtype=name,
                quantization=args.quantization,
                enforce_eager=args.enforce_eager,
            )
            llm.generate(make_prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
            peer = None if args.no_peer else Transformers(args.model, dtype)
            # Rounds interleave the two sides, so that a machine whose speed drifts over minutes (shared cores)
            # weighs on both alike: each round's ratio is taken against the peer's run of that round.
            times: list[float] = []
            peer_times: dict[int, list[float]] = {size: [] for size in args.peer_batches}
            for prompts in runs:
                seconds, prompt_lens = spindle_run(llm, prompts, lengths)
                times.append(seconds)
                if peer is not None:
                    for size, spent in peer_times.items():
                        spent.append(peer.run(prompts, lengths, size))
            seconds = statistics.median(times)
            spindle = sum(lengths) / seconds
            bound = None
            if args.projection_bound:
                prompts = make_prompts(args.num_prompts, first=2 + args.repeats * args.num_prompts)
                _, spent = projection_seconds(llm, prompts, lengths)
                bound = sum(lengths) / spent
                print(
                    f"  {name:8s} projections {spent:.1f} s, {spent / seconds:.0%} of a {seconds:.1f} s run: "
                    f"with all else free, {bound:.1f} tok/s"
                )
            guard = quality.guard(llm, args.model)
            del llm, peer
            achieved, ceiling = shapes.flops(prompt_lens, lengths) / seconds, matmul_rate(dtype)
            line = (
                f"  {name:8s} spindle {spindle:7.1f} tok/s = {achieved / 1e9:5.1f} GFLOP/s, "
                f"{achieved / ceiling:4.0%} of this machine's {name} matmul rate ({ceiling / 1e9:.0f} GFLOP/s)"
            )
            if not args.no_peer:
                size = min(peer_times, key=lambda size: statistics.median(peer_times[size]))
                hf = sum(lengths) / statistics.median(peer_times[size])
                ratios = [theirs / ours for ours, theirs in zip(times, peer_times[size], strict=True)]
                ratio = statistics.median(ratios)
                rates[dtype] = (spindle, hf)
                line += (
                    f"  transformers {hf:7.1f} tok/s (batch {size})  ratio {ratio:5.2f}x"
                    f" (rounds {', '.join(f'{r:.2f}' for r in ratios)})"
                )
                if bound is not None:
                    line += f" (projection bound {bound / hf:.2f}x)"
            print(line + f"  (medians of {args.repeats})", flush=True)
            print(f"  {name:8s} {guard}")
        if len(rates) > 1:  # the dtypes ran one after the other: a ratio of medians
            best_dtype, (_, best_hf) = max(rates.items(), key=lambda item: item[1][1])
            spindle_best = max(spindle for spindle, _ in rates.values())
            print(
                f"  best: spindle {spindle_best:.1f} tok/s against transformers' best ({best_dtype}) "
                f"{best_hf:.1f} tok/s: {spindle_best / best_hf:.2f}x"
            )


if __name__ == "__main__":
    main()
