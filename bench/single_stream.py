"""Single-stream decode: one request at a time, Spindle against llama.cpp on the same GGUF file.

Both run the embedded SmolLM2-135M-Instruct Q4_1 GGUF on this machine's CPU with 2 threads, greedy, eos ignored:
one chat prompt, ``--max-tokens`` generated tokens, timed from the request to its last token (a short prompt's
prefill included). Spindle runs once per ``--quantization`` (``auto`` keeps the file's Q4_1 blocks as int4);
llama.cpp (``llama-cpp-python``, the ``bench`` extra, built with ``CMAKE_ARGS=-DGGML_NATIVE=ON``) runs the file as
it is. Prints each one's generated tokens per second (median of ``--repeats``) and its ratio to llama.cpp, in one run:

    .venv/bin/python -m bench.single_stream --quantization none int8 auto
"""

import argparse
import os
import statistics
import time

from spindle import LLM, SamplingParams
from spindle.backend.models.loader import embedded_gguf

PROMPT = "Explain in detail how a bicycle works, part by part."


def bench_spindle(quantization: str, max_tokens: int, repeats: int) -> float:
    llm = LLM(kv_cache_memory="1GiB", quantization=quantization)
    prompt = {"prompt": llm.get_tokenizer().apply_chat_template([{"role": "user", "content": PROMPT}])}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        rates.append(len(output.outputs[0].token_ids) / (time.perf_counter() - start))
    llm.shutdown()
    return statistics.median(rates)


def bench_llama_cpp(max_tokens: int, repeats: int) -> float:
    from llama_cpp import Llama

    model = Llama(str(embedded_gguf()), n_ctx=1024, n_threads=os.cpu_count() or 1, verbose=False)
    eos = model.token_eos()
    rates = []
    for i in range(repeats + 1):
        model.reset()  # no reuse of the previous run's cache: every run prefills the prompt, as Spindle's does
        start = time.perf_counter()
        output = model.create_chat_completion(
            [{"role": "user", "content": PROMPT}], max_tokens=max_tokens, temperature=0, logit_bias={eos: -1e9}
        )
        if i:  # the first run warms up
            rates.append(output["usage"]["completion_tokens"] / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "auto"])
    args = parser.parse_args()

    peer = bench_llama_cpp(args.max_tokens, args.repeats)
    print(f"llama.cpp (Q4_1 file, {os.cpu_count()} threads): {peer:7.1f} tok/s")
    for quantization in args.quantization:
        rate = bench_spindle(quantization, args.max_tokens, args.repeats)
        print(f"spindle --quantization {quantization:<5}: {rate:7.1f} tok/s  = {rate / peer:.2f}x llama.cpp")


if __name__ == "__main__":
    main()
