"""n-gram speculation in a batch: no drafts, every draft verified, and only the drafts worth verifying.

``LLM()`` with its defaults on the embedded SmolLM2-135M-Instruct Q4_1 generates ``--max-tokens`` greedy tokens (eos
ignored) for each of ``--streams`` chat prompts, every other one asking to restate a passage (whose output copies
from its input, where prompt lookup pays) and the others to explain something (where it rarely does), all in one
``LLM.generate``. Three runs a round, interleaved over ``--repeats`` rounds: ``num_speculative_tokens`` 0, then
``--drafts`` with every draft found verified (``adaptive_drafts=False``, vLLM's way), then with the default adaptive
drafts (the drafts that give the step the most expected tokens per second). Each engine has its own ``LLM``; every
prompt is numbered anew each round and the prefix cache is off, so every run prefills. Prints the medians of the
output-token rates, each against no speculation, and the drafts verified and accepted::

    .venv/bin/python -m bench.speculation
    .venv/bin/python -m bench.speculation --streams 1 --drafts 7
"""

import argparse
import statistics
import time

from bench.single_stream import PROMPTS
from spindle import LLM, SamplingParams


def run(llm: LLM, prompts: list[str], drafts: int, max_tokens: int) -> float:
    """Generated tokens per second of one ``LLM.generate`` over ``prompts``."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=drafts)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt": prompt} for prompt in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(output.outputs[0].token_ids) for output in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--drafts", type=int, default=4, help="num_speculative_tokens of the speculative runs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engines = {
        "every draft": LLM(kv_cache_memory="512MiB", enable_prefix_caching=False, adaptive_drafts=False),
        "adaptive": LLM(kv_cache_memory="512MiB", enable_prefix_caching=False),
    }
    tokenizer = engines["adaptive"].get_tokenizer()

    def prompts(round_: int) -> list[str]:
        texts = [PROMPTS["summarize" if i % 2 else "explain"] for i in range(args.streams)]
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": f"Request {round_}.{i}. {text}"}])
            for i, text in enumerate(texts)
        ]

    for llm in engines.values():  # warm-up
        run(llm, prompts(-1), args.drafts, args.max_tokens)
    rates: dict[str, list[float]] = {"no drafts": [], **{name: [] for name in engines}}
    for round_ in range(args.repeats):
        rates["no drafts"].append(run(engines["adaptive"], prompts(round_), 0, args.max_tokens))
        for name, llm in engines.items():
            rates[name].append(run(llm, prompts(round_), args.drafts, args.max_tokens))

    print(f"{args.streams} streams x {args.max_tokens} greedy tokens, {args.drafts} drafts, medians of {args.repeats}:")
    plain = statistics.median(rates["no drafts"])
    for name, values in rates.items():
        rate = statistics.median(values)
        rounds = ", ".join(f"{value:.1f}" for value in values)
        print(f"  {name:<12} {rate:7.1f} tok/s  {rate / plain:5.2f}x  (rounds: {rounds})")
    for name, llm in engines.items():
        stats = llm.llm_engine.engine_core.stats()
        print(f"  {name}: {stats.num_accepted_draft_tokens} of {stats.num_draft_tokens} drafts accepted")


if __name__ == "__main__":
    main()
