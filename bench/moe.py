"""Mixture-of-experts on the CPU: a tiny random Mixtral through Spindle's ``LLM`` against transformers' batched
``generate``, and the fused MoE op against a per-expert loop written in torch, printed side by side.

The checkpoint is written here (transformers' ``MixtralForCausalLM`` of random weights, std 0.02, and
``bench.random_llama``'s byte-level tokenizer). Both engines generate ``--max-tokens`` greedy tokens for each of
``--num-prompts`` prompts of random token ids (lengths 16-64); transformers runs them as one left-padded batch,
Spindle as its scheduler batches them. The two alternate over ``--rounds``, one generate of each a round; the summary
is the median of the rounds' ratios, measured a few seconds apart. The kernel part times one MoE layer of the model's
shapes at several token counts: ``spindle.kernels.moe.Experts`` (the C++ op; bf16 weights in ``bf16_linear``'s tiles
where the CPU has AVX-512 bf16, float32 ones in the op's own tiles), the same op on int8 and int4 experts
(``quantize_experts``, dequantized in registers) and on the layouts GGUF's Q5_K and Q6_K experts decode to (int8 with
offsets per 32 inputs; int8 per 16), and ``spindle.kernels.moe.fused_moe_reference`` (one expert at a time in torch, as
transformers' ``MixtralExperts`` runs)::

    python -m bench.moe --dtype bfloat16 --threads 1
    python -m bench.moe --dtype float32 --threads 1 --kernels-only

``--threads`` sets torch's threads (and so the C++ op's OpenMP threads); on a machine whose cores other jobs share,
one thread keeps OpenMP's barriers from waiting on descheduled threads. The kernel part calls one layer's experts
over and over: where they fit the last-level cache, a model's decode steps, which read every layer's in turn, run
them slower than it says (bench/results/moe.md).
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from bench.flops import median_seconds
from bench.random_llama import write_tokenizer
from spindle import LLM, SamplingParams
from spindle.kernels.moe import Experts, fused_moe_reference, quantize_experts, route
from spindle.kernels.quant import QuantizedWeight, quantize, widen

SHAPES = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
)


def write_mixtral(out_dir: Path) -> None:
    """Save a random Mixtral of :data:`SHAPES` (float32 safetensors) and a byte-level tokenizer into ``out_dir``."""
    bos, eos = write_tokenizer(out_dir, SHAPES["vocab_size"])
    config = transformers.MixtralConfig(**SHAPES, bos_token_id=bos, eos_token_id=eos, max_position_embeddings=1024)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)


def engines(
    model_dir: Path, dtype: torch.dtype, num_prompts: int, max_tokens: int, rounds: int
) -> list[tuple[float, float]]:
    """Generated tokens per second of each round: (Spindle's ``LLM``, transformers' batched ``generate``).

    Both engines are loaded and warmed up first, then each round times one of each back to back, so that a ratio
    compares the two at the same moment of a shared machine (transformers' own rate moved by 25-29% between runs).
    """
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 65, (num_prompts,), generator=generator).tolist()
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in lengths]
    total = num_prompts * max_tokens

    # No prefix caching: the repeats would otherwise reuse their own prompts' KV, which transformers cannot.
    llm = LLM(
        str(model_dir), dtype=str(dtype).removeprefix("torch."), kv_cache_memory="256MiB", enable_prefix_caching=False
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    requests = [{"prompt_token_ids": p} for p in prompts]

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    longest = max(lengths)
    ids = torch.zeros(num_prompts, longest, dtype=torch.int64)
    mask = torch.zeros(num_prompts, longest, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1

    def hf_generate() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    def spindle_generate() -> None:
        llm.generate(requests, params, use_tqdm=False)

    def seconds(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    spindle_generate(), hf_generate()  # warm-up
    return [(total / seconds(spindle_generate), total / seconds(hf_generate)) for _ in range(rounds)]


def gguf_layout(weights: torch.Tensor, gguf_type: str) -> QuantizedWeight:
    """``weights [experts, out, in]`` in the layout a GGUF ``Q5_K`` or ``Q6_K`` expert stack decodes to: int4 widened
    exactly to int8 per 32 inputs, offsets kept, resp. int8 per row regrouped per 16 (the values differ from real
    blocks'; the kernel's work does not)."""
    bits, group_size = {"Q5_K": (4, 32), "Q6_K": (8, 16)}[gguf_type]
    experts, outputs, inputs = weights.shape
    flat = widen(quantize(weights.reshape(experts * outputs, inputs), bits), group_size)
    parts = (None if t is None else t.view(experts, outputs, -1) for t in (flat.qweight, flat.scales, flat.zeros))
    return QuantizedWeight(*parts, group_size)


def kernels(dtype: torch.dtype, token_counts: list[int]) -> list[tuple[int, dict[str, float]]]:
    """One MoE layer of :data:`SHAPES`: per token count, median us a call of each of :data:`KERNEL_COLUMNS`."""
    experts, hidden, inter = SHAPES["num_local_experts"], SHAPES["hidden_size"], SHAPES["intermediate_size"]
    generator = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=generator) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=generator) * 0.02).to(dtype)
    calls = {"fused": Experts(w13, w2)}
    for bits in (8, 4):
        calls[f"fused int{bits}"] = Experts(quantize_experts(w13, bits), quantize_experts(w2, bits))
    for gguf_type in ("Q5_K", "Q6_K"):
        calls[f"fused {gguf_type}"] = Experts(gguf_layout(w13, gguf_type), gguf_layout(w2, gguf_type))
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, generator=generator).to(dtype)
        weights, ids = route(torch.randn(tokens, experts, generator=generator), SHAPES["num_experts_per_tok"])
        times = {}
        with torch.inference_mode():
            for name, fused in calls.items():
                times[name] = median_seconds(lambda: fused(x, weights, ids), repeats=20)  # noqa: B023 (timed now)
            times["loop"] = median_seconds(lambda: fused_moe_reference(x, w13, w2, weights, ids), repeats=20)  # noqa: B023
        rows.append((tokens, {name: seconds * 1e6 for name, seconds in times.items()}))
    return rows


KERNEL_COLUMNS = ("fused", "fused int8", "fused int4", "fused Q5_K", "fused Q6_K", "loop")
"""The calls :func:`kernels` times: the C++ op on the model-dtype experts, on int8 and on int4 ones and on the layouts
of GGUF's Q5_K and Q6_K experts (:func:`gguf_layout`; all dequantized in registers), and the per-expert torch loop on
the model-dtype experts."""


def main() -> None:
    """Run both comparisons and print them."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--token-counts", default="1,8,64,256,1024,2048")
    parser.add_argument("--threads", type=int, default=None, help="torch's (and the C++ op's) threads; default torch's")
    parser.add_argument("--kernels-only", action="store_true", help="time the MoE layer alone, not the engines")
    parser.add_argument("--rounds", type=int, default=5, help="engine rounds, each one generate of each engine")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch threads: {torch.get_num_threads()}, dtype {args.dtype}, Mixtral shapes {SHAPES}")
    print(f"\nOne MoE layer, median us a call: {' | '.join(KERNEL_COLUMNS)} | each fused's speed-up over the loop")
    for tokens, times in kernels(dtype, [int(n) for n in args.token_counts.split(",")]):
        columns = " | ".join(f"{times[name]:9.1f}" for name in KERNEL_COLUMNS)
        ratios = " ".join(f"{times['loop'] / times[name]:5.2f}x" for name in KERNEL_COLUMNS[:-1])
        print(f"  {tokens:5d} tokens: {columns} | {ratios}")
    if args.kernels_only:
        return
    with tempfile.TemporaryDirectory(prefix="mixtral-") as model_dir:
        write_mixtral(Path(model_dir))
        rates = engines(Path(model_dir), dtype, args.num_prompts, args.max_tokens, args.rounds)
    print(f"\n{args.num_prompts} prompts x {args.max_tokens} greedy tokens, generated tokens/s, {args.rounds} rounds:")
    for spindle_tps, hf_tps in rates:
        print(f"  Spindle LLM {spindle_tps:8.1f} | transformers generate {hf_tps:8.1f} | {spindle_tps / hf_tps:5.2f}x")
    spindle_tps, hf_tps = (statistics.median(side) for side in zip(*rates, strict=True))
    ratio = statistics.median(spindle / hf for spindle, hf in rates)
    print(f"  medians: Spindle {spindle_tps:8.1f} | transformers {hf_tps:8.1f} | the rounds' ratios {ratio:5.2f}x")


if __name__ == "__main__":
    main()
