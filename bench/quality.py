"""What quantization costs in quality: perplexity on a fixed public-domain text, and greedy output side by side.

The text is the Book of Ruth in the King James Version (``bench/data/ruth_kjv.txt``; the translation's copyright
has long expired; taken from Debian's ``bible-kjv-text``), tokenized once by the embedded SmolLM2's tokenizer and cut
into windows of ``--window`` tokens; every token of a window after its first is scored. Every engine scores the same
token ids:

- Spindle, once per ``--quantization``: ``none`` (bf16), ``int8`` (quantized at load, per row), ``auto`` (the
  GGUF's own Q4_1 blocks as int4). A quantized projection computes with its quantized weights at every batch size
  (``spindle.kernels.linear``), the prompt windows included, which is what a decode step computes with; by default
  with its activations quantized to int8 where the CPU allows (``a8_linear``, W8A8), and with a ``:weight-only``
  suffix (``auto:weight-only``) with float activations, so that the activations' share of the loss shows.
- llama.cpp on the same GGUF file (``llama-cpp-python``, the ``bench`` extra), as the file's reference.

Then each Spindle variant's greedy continuation of a few prompts, printed under bf16's:

    .venv/bin/python -m bench.quality

The speed benchmarks print :func:`guard` beside their numbers: the perplexity of the engine they timed against the
unquantized model's on the text's first windows, so that a speed-up bought with quality shows where it is claimed.
"""

import argparse
import math
from pathlib import Path

import numpy as np

from spindle import LLM, SamplingParams
from spindle.backend.models.loader import embedded_gguf, resolve_dtype
from spindle.kernels.linear import weight_only

TEXT = Path(__file__).parent / "data" / "ruth_kjv.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


def windows(llm: LLM, size: int) -> list[list[int]]:
    """The text's token ids in consecutive windows of ``size`` (the last one shorter)."""
    ids = llm.get_tokenizer().encode(TEXT.read_text())
    return [ids[i : i + size] for i in range(0, len(ids), size) if len(ids) - i > 1]


def perplexity(llm: LLM, chunks: list[list[int]]) -> float:
    """``llm``'s perplexity over ``chunks`` of token ids, every token of a chunk after its first scored."""
    scored = llm.generate(
        [{"prompt_token_ids": ids} for ids in chunks],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    nll = [
        -out.prompt_logprobs[pos][ids[pos]].logprob
        for out, ids in zip(scored, chunks, strict=True)
        for pos in range(1, len(ids))
    ]
    return math.exp(sum(nll) / len(nll))


GUARD_WINDOWS = 16
"""Windows of 256 tokens :func:`guard` scores (~4,000 tokens: a few seconds per engine; short enough for any
engine's context)."""

_reference_perplexity: dict[tuple[str | None, int], float] = {}  # (model, windows) -> the unquantized model's, once


def guard(llm: LLM, model: str | None = None, windows_scored: int = GUARD_WINDOWS, window: int = 256) -> str:
    """The quality line a speed benchmark prints beside its numbers: ``llm``'s perplexity on the text's first
    ``windows_scored`` windows against the unquantized model's (``model``, default the embedded file, with
    ``quantization="none"``: its weights in this CPU's ``auto`` dtype, bf16 where the CPU has AVX-512 bf16, else
    float32; no integer activations), which issue 44 asks to stay within 1% of bf16's."""
    chunks = windows(llm, window)[:windows_scored]
    score = perplexity(llm, chunks)
    key = (model, windows_scored)
    if key not in _reference_perplexity:
        reference = LLM(model, kv_cache_memory="256MiB", quantization="none", max_model_len=window + 1)
        _reference_perplexity[key] = perplexity(reference, chunks)
        reference.shutdown()
    base = _reference_perplexity[key]
    scored = sum(len(ids) - 1 for ids in chunks)
    dtype = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    return (
        f"quality: perplexity {score:.3f} against {dtype}'s {base:.3f} ({score / base - 1:+.2%}), "
        f"{scored} tokens of {TEXT.name}"
    )


def spindle_run(variant: str, window: int, max_tokens: int) -> tuple[float, int, list[str]]:
    """(perplexity, scored tokens, greedy continuations of PROMPTS) of a ``--quantization`` value, with
    ``:weight-only`` its projections built within ``spindle.kernels.linear.weight_only`` (float activations)."""
    quantization, _, mode = variant.partition(":")
    with weight_only(mode == "weight-only"):
        llm = LLM(kv_cache_memory="1GiB", quantization=quantization)
    chunks = windows(llm, window)
    score = perplexity(llm, chunks)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return score, sum(len(ids) - 1 for ids in chunks), [out.outputs[0].text for out in greedy]


def llama_cpp_perplexity(chunks: list[list[int]], window: int) -> float:
    from llama_cpp import Llama

    model = Llama(str(embedded_gguf()), n_ctx=window, n_batch=window, logits_all=True, verbose=False)
    nll = []
    for ids in chunks:
        model.reset()
        model.eval(ids)
        logits = np.asarray(model.scores[: len(ids)], dtype=np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll += [-logprobs[pos - 1, ids[pos]] for pos in range(1, len(ids))]
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--quantization", nargs="+", default=["none", "int8:weight-only", "int8", "auto:weight-only", "auto"]
    )
    args = parser.parse_args()

    results = {q: spindle_run(q, args.window, args.max_tokens) for q in args.quantization}
    base, scored, _ = results[args.quantization[0]]
    print(f"Perplexity on {TEXT.name} ({scored} scored tokens, windows of {args.window}):")
    for quantization, (perplexity, _, _) in results.items():
        print(f"  spindle --quantization {quantization:<16} {perplexity:8.3f}  ({perplexity / base - 1:+.2%})")
    # Only its tokenizer is used: a context of one window keeps the cache small (float32 where bf16 is slow).
    chunks = windows(LLM(kv_cache_memory="256MiB", max_model_len=args.window), args.window)
    peer = llama_cpp_perplexity(chunks, args.window)
    print(f"  llama.cpp (Q4_1 file)                     {peer:8.3f}  ({peer / base - 1:+.2%})")
    print("Greedy continuations:")
    for i, prompt in enumerate(PROMPTS):
        print(f"  {prompt!r}")
        for quantization, (_, _, texts) in results.items():
            print(f"    {quantization:<16} {texts[i]!r}")


if __name__ == "__main__":
    main()
