"""Single-stream decode: one request at a time, Spindle against llama.cpp on the same GGUF file.

Both run the embedded SmolLM2-135M-Instruct Q4_1 GGUF on this machine's CPU with all its threads, greedy, eos
ignored: one chat prompt, ``--max-tokens`` generated tokens, timed from the request to its last token (the prompt's
prefill included: Spindle runs without its prefix cache, as llama.cpp's cache is reset before each run; with it, every
run after the first found all but the prompt's last block cached). Two prompts:

- ``explain``: a question answered in the model's own words, nothing to copy;
- ``summarize``: a passage to restate, whose output copies from its input, where prompt-lookup speculation pays.

Spindle runs each prompt once per ``--quantization`` (``auto`` keeps the file's Q4_1 blocks as int4), and the
``summarize`` prompt also with ``num_speculative_tokens=--speculative`` (int4). llama.cpp (``llama-cpp-python``,
the ``bench`` extra, built with ``CMAKE_ARGS=-DGGML_NATIVE=ON``) runs the file as it is, plainly and with its own
prompt-lookup drafting (``LlamaPromptLookupDecoding``). Prints generated tokens per second (median of ``--repeats``)
and the ratio to plain llama.cpp on the same prompt, in one run:

    .venv/bin/python -m bench.single_stream --quantization none int8 auto --speculative 4
"""

import argparse
import os
import statistics
import time

from spindle import LLM, SamplingParams
from spindle.backend.models.loader import embedded_gguf

PASSAGE = (
    "The city council met on Tuesday evening to debate the new transport plan. After three hours of discussion, "
    "members voted to extend the tram line to the northern suburbs, to add two hundred bicycle parking spaces near "
    "the central station, and to lower bus fares for students and pensioners from the first of March. The mayor "
    "said the plan would cut traffic in the old town and make the city cleaner and quieter."
)
PROMPTS = {
    "explain": "Explain in detail how a bicycle works, part by part.",
    "summarize": f"Rewrite this news item in your own words, keeping every fact:\n\n{PASSAGE}",
}


def bench_spindle(llm: LLM, prompt: str, max_tokens: int, repeats: int, speculative: int) -> float:
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=speculative)
    llm.generate({"prompt": text}, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        output = llm.generate({"prompt": text}, params, use_tqdm=False)[0]
        rates.append(len(output.outputs[0].token_ids) / (time.perf_counter() - start))
    return statistics.median(rates)


def bench_llama_cpp(prompt: str, max_tokens: int, repeats: int, lookup: bool) -> float:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=4) if lookup else None
    model = Llama(str(embedded_gguf()), n_ctx=1024, n_threads=os.cpu_count(), draft_model=draft, verbose=False)
    eos = model.token_eos()
    rates = []
    for i in range(repeats + 1):
        model.reset()  # no reuse of the previous run's cache: every run prefills the prompt, as Spindle's does
        start = time.perf_counter()
        output = model.create_chat_completion(
            [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, logit_bias={eos: -1e9}
        )
        if i:  # the first run warms up
            rates.append(output["usage"]["completion_tokens"] / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "auto"])
    parser.add_argument("--speculative", type=int, default=4, help="draft tokens per step on the summarize prompt")
    args = parser.parse_args()

    peers = {name: bench_llama_cpp(prompt, args.max_tokens, args.repeats, False) for name, prompt in PROMPTS.items()}
    lookup = bench_llama_cpp(PROMPTS["summarize"], args.max_tokens, args.repeats, True)
    rows = [(f"llama.cpp ({os.cpu_count()} threads)", name, rate) for name, rate in peers.items()]
    rows.append(("llama.cpp + prompt lookup", "summarize", lookup))
    for quantization in args.quantization:
        llm = LLM(kv_cache_memory="1GiB", quantization=quantization, enable_prefix_caching=False)
        for name, prompt in PROMPTS.items():
            rate = bench_spindle(llm, prompt, args.max_tokens, args.repeats, 0)
            rows.append((f"spindle --quantization {quantization}", name, rate))
        if quantization == "auto" and args.speculative:
            rate = bench_spindle(llm, PROMPTS["summarize"], args.max_tokens, args.repeats, args.speculative)
            rows.append((f"spindle auto + {args.speculative} ngram drafts", "summarize", rate))
    print(f"{args.max_tokens} greedy tokens, medians of {args.repeats}:")
    for engine, name, rate in rows:
        print(f"  {engine:<34} {name:<10} {rate:7.1f} tok/s  {rate / peers[name]:5.2f}x llama.cpp")


if __name__ == "__main__":
    main()
