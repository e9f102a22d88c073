"""Long-prompt prefill: time to first token of one fresh prompt against transformers' single forward, and what a
long prefill does to the decode streams running beside it.

Part 1: one prompt of ``--lengths`` tokens (fresh random ids each run, so no prefix-cache hit) through
``LLM.generate`` with ``max_tokens=1``, against Hugging Face transformers' one forward (same ``--dtype``; ``auto`` is
what ``LLM`` picks on this CPU: bf16 with AVX-512 bf16, else float32) over the same ids
(``logits_to_keep=1``: the last position's logits only, as we compute). Prints tokens per second of each (medians of
``--repeats``), the ratio, and each side's FLOP rate as a fraction of this machine's matmul rate in that dtype
(:mod:`bench.flops`): a side near the matmul rate cannot be outrun by much more than the rest of its fraction.

Part 2: ``--streams`` greedy decode streams run alone, then beside one ``--beside``-token prompt, in an engine with
the serving default ``max_decode_slowdown=2`` and in one without the bound (``0``, as ``LLM`` runs). Prints the
streams' mean inter-token latency (one engine step yields one token per stream; the mean is the inverse of their
rate) alone (before the prompt and after its first token) and during the prefill, the ratio, the medians and the p99
beside it, and the long prompt's time to first token beside them.

With ``--quantization auto int8``, one engine of each runs against the same transformers runs; ``int8`` runs the
projections W8A8 (int8 weights and activations) where the CPU has VNNI, past the bf16 matmul rate.

    .venv/bin/python -m bench.prefill --lengths 1024 7680
"""

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from bench import quality
from bench.flops import Shapes, matmul_rate
from bench.serving import percentile
from spindle import LLM, LLMEngine, SamplingParams
from spindle.backend.models.loader import resolve_dtype, resolve_model
from spindle.shared.config import EngineConfig


def fresh_ids(length: int, seed: int) -> list[int]:
    """Random token ids from the ordinary part of the vocabulary, different for every seed.

    Prompts of one seed share their first tokens whatever their lengths (a 1,024-token prompt starts with the
    256-token one), so every prompt that must miss the prefix cache needs a seed of its own.
    """
    return torch.randint(1000, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def spindle_prefill(llm: LLM, length: int, repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1)
    rates = []
    for seed in range(repeats):
        ids = fresh_ids(length, length * 1000 + seed)
        start = time.perf_counter()
        output = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        rates.append(length / (time.perf_counter() - start))
        assert not output.num_cached_tokens  # the whole prompt computed, as transformers computes it
    return statistics.median(rates)


def transformers_prefill(model: torch.nn.Module, length: int, repeats: int) -> float:
    rates = []
    with torch.inference_mode():
        for seed in range(repeats):
            ids = torch.tensor([fresh_ids(length, length * 1000 + seed)])
            start = time.perf_counter()
            model(ids, logits_to_keep=1)
            rates.append(length / (time.perf_counter() - start))
    return statistics.median(rates)


def decode_latency(engine: LLMEngine, streams: int, beside: int, steps: int) -> tuple[list[float], list[float], float]:
    """Step times of ``streams`` decodes alone, then while a ``beside``-token prompt is prefilled, and the seconds
    that prompt waited for its first token.

    The decodes alone are timed before the prompt and again after its first token: their contexts grow by one token
    a step during the prefill, and so does their step time, so both ends together are the fair reference.
    """
    params = SamplingParams(temperature=0, max_tokens=8192 - 32, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"stream-{i}", {"prompt_token_ids": fresh_ids(32, 100 + i)}, params)
    while any(not o.outputs[0].token_ids for o in engine.step()):
        pass  # the streams' prefills

    def alone() -> list[float]:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    before = alone()
    engine.add_request("long", {"prompt_token_ids": fresh_ids(beside, 999)}, SamplingParams(max_tokens=1))
    during = []
    begin = time.perf_counter()
    while True:
        start = time.perf_counter()
        outputs = engine.step()
        during.append(time.perf_counter() - start)
        if any(o.request_id == "long" for o in outputs):
            break
    ttft = time.perf_counter() - begin
    after = alone()
    engine.abort_request([f"stream-{i}" for i in range(streams)])
    return before + after, during, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 7680])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--beside", type=int, default=7680)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["auto"],
        help="Spindle's --quantization, one engine each against the same transformers runs (the first also runs "
        "part 2); int8 runs W8A8 where the CPU has VNNI",
    )
    args = parser.parse_args()
    dtype = str(resolve_dtype(args.dtype, "cpu")).removeprefix("torch.")
    engine_args = {"dtype": dtype, "max_model_len": 8192, "kv_cache_memory": "2GiB"}
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    engines = {name: LLM(**engine_args, quantization=name) for name in args.quantization}
    model_dir = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    for llm in engines.values():
        spindle_prefill(llm, 256, 1)  # warm-up
    transformers_prefill(model, 256, 1)
    budget = llm.llm_engine.config.scheduler.max_num_batched_tokens
    shapes, ceiling = Shapes.of(str(model_dir)), matmul_rate(getattr(torch, dtype))
    print(f"prefill, {dtype}, threads={torch.get_num_threads()}, {engine_args}, LLM's step budget {budget} tokens")
    print(f"  this machine's {dtype} matmul rate: {ceiling / 1e9:.0f} GFLOP/s (2048-cubed torch.mm, best of 10)")
    for length in args.lengths:
        theirs = transformers_prefill(model, length, args.repeats)
        per_token = shapes.flops([length], [1]) / length
        for name, llm in engines.items():
            ours = spindle_prefill(llm, length, args.repeats)
            print(
                f"  {length:5d} tokens  spindle (quantization {name}) {ours:7.1f} tok/s ({length / ours:5.2f} s to "
                f"first token, {ours * per_token / ceiling:4.0%} of the {dtype} matmul rate)  transformers "
                f"{theirs:7.1f} tok/s ({theirs * per_token / ceiling:4.0%})  ratio {ours / theirs:4.2f}x  "
                f"(medians of {args.repeats})"
            )
    for name, llm in engines.items():
        print(f"  quantization {name}: {quality.guard(llm)}")
    del model, llm, engines
    engine_args["quantization"] = args.quantization[0]
    for slowdown in (0, 2):
        engine = LLMEngine(EngineConfig.of(**engine_args, max_decode_slowdown=slowdown))
        alone, during, ttft = decode_latency(engine, args.streams, args.beside, steps=20)
        mean_alone, mean_during = statistics.mean(alone), statistics.mean(during)
        print(
            f"  max_decode_slowdown={slowdown}: {args.streams} decode streams' inter-token latency "
            f"{mean_alone * 1e3:6.1f} ms alone, {mean_during * 1e3:6.1f} ms beside a {args.beside}-token prefill "
            f"({mean_during / mean_alone:4.1f}x, means; medians {statistics.median(alone) * 1e3:.1f} and "
            f"{statistics.median(during) * 1e3:.1f} ms, p99 beside {percentile(during, 0.99) * 1e3:.1f} ms); "
            f"that prompt's first token after {ttft:5.1f} s"
        )
        engine.shutdown()


if __name__ == "__main__":
    main()
