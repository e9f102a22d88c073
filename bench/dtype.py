"""Which dtype should ``--dtype auto`` pick on CPU? Times fp32 and bf16 through our model and paged attention.

On the embedded SmolLM2 it measures, for each dtype, the median of several runs of: one prefill of ``--prefill``
tokens, and one decode step at batch 1 and at batch 32 over contexts of ``--context`` tokens. It then checks that
bf16 greedy decoding agrees with fp32 on a few chat prompts, and prints the timings, the fp32/bf16 ratios and the
agreement in one table. Run from the repository root: ``python -m bench.dtype`` (the first run converts the GGUF).
"""

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoTokenizer

from spindle.backend.models import LlamaForCausalLM, load_model, resolve_model
from spindle.kernels import AttentionMetadata

BLOCK_SIZE = 16
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
]


def make_caches(model: LlamaForCausalLM, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = model.config
    shape = (-(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    dtype = model.embed_tokens.dtype
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_layers)]


def step_inputs(
    query_lens: list[int], seq_lens: list[int], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and metadata for sequences laid out back to back in the cache."""
    tables, positions, next_block = [], [], 0
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        num_blocks = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
        positions += range(seq_len - query_len, seq_len)
    meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, BLOCK_SIZE)
    input_ids = torch.randint(0, vocab_size, (len(positions),), generator=torch.Generator().manual_seed(0))
    return input_ids, torch.tensor(positions), meta


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_models(
    models: dict[torch.dtype, LlamaForCausalLM], prefill: int, context: int, repeats: int
) -> dict[str, dict[torch.dtype, float]]:
    """Median seconds per case and dtype; the dtypes take turns, so load from other processes hits both alike."""
    cases = {
        f"prefill {prefill}": ([prefill], [prefill]),
        "decode b=1": ([1], [context]),
        "decode b=32": ([1] * 32, [context] * 32),
    }
    caches = {dtype: make_caches(model, 32 * (context + BLOCK_SIZE)) for dtype, model in models.items()}
    vocab_size = next(iter(models.values())).config.vocab_size
    results = {}
    for name, (query_lens, seq_lens) in cases.items():
        input_ids, positions, meta = step_inputs(query_lens, seq_lens, vocab_size)
        last = meta.query_start_loc[1:].long() - 1
        steps = {
            dtype: functools.partial(run_step, model, input_ids, positions, meta, caches[dtype], last)
            for dtype, model in models.items()
        }
        for step in steps.values():
            step()  # warm-up
        times = {dtype: [] for dtype in models}
        for _ in range(repeats):
            for dtype, step in steps.items():
                times[dtype].append(seconds(step))
        results[name] = {dtype: statistics.median(t) for dtype, t in times.items()}
    return results


@torch.inference_mode()
def run_step(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    last: torch.Tensor,
) -> torch.Tensor:
    """One engine step: forward, then the logits of each sequence's last token."""
    return model.compute_logits(model(input_ids, positions, meta, caches)[last])


def greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    caches = make_caches(model, len(prompt) + max_new_tokens)
    table = list(range(caches[0][0].shape[0]))
    tokens, new = list(prompt), list(prompt)
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            meta = AttentionMetadata.from_lists([len(new)], [len(tokens)], [table], BLOCK_SIZE)
            hidden = model(torch.tensor(new), torch.arange(len(tokens) - len(new), len(tokens)), meta, caches)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
            new = tokens[-1:]
    return tokens[len(prompt) :]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--context", type=int, default=256, help="context length of each decoding sequence")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt for the parity check")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"]
        for p in PROMPTS
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {model_dir.name}")
    dtypes = (torch.float32, torch.bfloat16)
    models = {dtype: load_model(model_dir, dtype, torch.device("cpu")) for dtype in dtypes}
    timings = time_models(models, args.prefill, args.context, args.repeats)
    print(f"{'case':<16}{'fp32 ms':>10}{'bf16 ms':>10}{'fp32/bf16':>11}")
    for case, by_dtype in timings.items():
        fp32, bf16 = by_dtype[torch.float32], by_dtype[torch.bfloat16]
        print(f"{case:<16}{fp32 * 1e3:>10.1f}{bf16 * 1e3:>10.1f}{fp32 / bf16:>11.2f}")
    for i, prompt in enumerate(prompts):
        fp32, bf16 = (greedy(models[dtype], prompt, args.new_tokens) for dtype in dtypes)
        same = next((j for j, (x, y) in enumerate(zip(fp32, bf16, strict=True)) if x != y), len(fp32))
        print(f"prompt {i}: bf16 greedy equals fp32 for the first {same}/{len(fp32)} tokens")


if __name__ == "__main__":
    main()
