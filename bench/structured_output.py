"""The cost of structured output: offline throughput with 0%, 50% and 100% of the requests constrained.

Every request is a chat prompt asking for JSON records, run through ``LLM.chat`` on the embedded SmolLM2, greedy; the
constrained ones carry a JSON schema (an array of at least 8 records with strings, integers, enums and booleans: a
grammar with real work in each step's mask). Every request generates exactly ``--max-tokens`` tokens (the free ones
ignore eos, the constrained ones' arrays are longer than that: their closing before ``max_tokens``, longer than the
search looks, is searched for and not found), so each batch does the same work and the rates compare; the last run
turns the closing off, which gives its cost. Also printed: the compile time of the first schema (with xgrammar's
import and tokenizer table, once per backend) and of a new schema after that.

    .venv/bin/python -m bench.structured_output --num-prompts 32 --max-tokens 96 --repeats 3
"""

import argparse
import statistics
import sys
import time

from spindle import LLM, SamplingParams, StructuredOutput

SCHEMA = {
    "type": "array",
    "minItems": 8,
    "maxItems": 16,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["engineer", "doctor", "artist", "teacher", "pilot"]},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "active"],
    },
}
RUNS = ((0.0, True), (0.5, True), (1.0, True), (1.0, False))
"""(fraction constrained, closing before max_tokens) of each batch measured."""


def chats(num_prompts: int) -> list[list[dict[str, str]]]:
    """Conversations asking for JSON records of people, slightly different each."""
    return [
        [{"role": "user", "content": f"List {2 + i % 5} people as JSON with name, age, role and active."}]
        for i in range(num_prompts)
    ]


def params_for(
    num_prompts: int, fraction: float, max_tokens: int, schema: dict, close: bool = True
) -> list[SamplingParams]:
    """The first ``fraction`` of the requests constrained by ``schema``, the others free; greedy all.

    ``close=False`` turns off the closing before ``max_tokens``: the rates with and without it compare its search.
    """
    constrained = round(num_prompts * fraction)
    spec = StructuredOutput(json_schema=schema, close_at_max_tokens=close)
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=spec)
        if i < constrained
        else SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(num_prompts)
    ]


def rate(llm: LLM, conversations: list, params: list[SamplingParams]) -> float:
    """Generated tokens per second of one batch."""
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return sum(len(c.token_ids) for o in outputs for c in o.outputs) / (time.perf_counter() - start)


def compile_seconds(llm: LLM, schema: dict) -> float:
    """Seconds to compile ``schema`` in the in-process engine core's structured-output manager."""
    start = time.perf_counter()
    llm.llm_engine.engine_core.structured_output.compile(StructuredOutput(json_schema=schema)).result()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    # The grammar compile workers are spawned processes, which import the main module again: by name they would
    # not find it (the bench package takes the repository root off sys.path), by its file they do.
    sys.modules["__main__"].__spec__ = None

    llm = LLM(args.model, kv_cache_memory="2GiB")
    conversations = chats(args.num_prompts)
    cold = compile_seconds(llm, SCHEMA)
    warm = compile_seconds(llm, {**SCHEMA, "maxItems": 17})
    print(f"compile: first schema {cold:.2f} s (xgrammar loads), a new schema after that {warm * 1e3:.0f} ms")
    llm.chat(conversations[:2], params_for(2, 0.5, 8, SCHEMA), use_tqdm=False)  # warm-up

    rates: dict[tuple[float, bool], list[float]] = {run: [] for run in RUNS}
    for _ in range(args.repeats):  # interleaved, so that the machine's drift hits every run alike
        for fraction, close in RUNS:
            params = params_for(len(conversations), fraction, args.max_tokens, SCHEMA, close)
            rates[fraction, close].append(rate(llm, conversations, params))
    base = statistics.median(rates[0.0, True])
    print(f"{args.num_prompts} prompts, greedy, up to {args.max_tokens} tokens, median of {args.repeats}:")
    for fraction, close in RUNS:
        median = statistics.median(rates[fraction, close])
        closing = "" if close else ", no closing"
        ratio = median / base
        print(f"  {fraction:4.0%} constrained{closing}: {median:7.1f} tok/s  ({ratio:.2f}x the unconstrained rate)")
    outputs = llm.chat(conversations[:2], params_for(2, 1.0, args.max_tokens, SCHEMA), use_tqdm=False)
    completion = outputs[0].outputs[0]
    print(f"example ({completion.finish_reason}):", completion.text[:160])


if __name__ == "__main__":
    main()
