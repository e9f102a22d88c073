"""Multi-LoRA throughput: a workload spread over 4 adapters against the base model alone, in one run.

The embedded SmolLM2-135M-Instruct in bfloat16 (``--quantization`` as the server's default), with 4 random rank-8
adapters on all seven projections loaded (``--max-lora-rank 8``: the slots are sized for the largest rank served).
``--num-prompts`` prompts generate ``--max-tokens`` greedy tokens each (eos ignored), all queued at once, through the
engine core: once all on the base model, once with prompt ``i`` on adapter ``i % 4``, so that every step mixes the
four. The prefix cache is off, so both runs compute the same prompts. Prints each run's output-token rate (median of
``--repeats``) and mixed / base (the target is at least 0.8):

    .venv/bin/python -m bench.lora --num-prompts 32 --max-tokens 64

``--formulations`` instead times the ways the CPU path could compute the LoRA deltas of one step (SmolLM2's 30 layers
x 4 projections, 4 adapters) for decode batches of 32 and 64 tokens and prefill chunks of 512: the numbers behind
the choice in ``spindle.kernels.lora``.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from bench.offline_throughput import make_prompts
from spindle.backend.engine_core import EngineCore
from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.loader import resolve_model
from spindle.kernels import cpu
from spindle.kernels.linear import Projection, pack_weight
from spindle.shared import SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.protocol import EngineRequest

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: Path, config: CheckpointConfig, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA adapter of ``config``'s model with random matrices on all seven projections."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, intermediate = config.hidden_size, config.intermediate_size
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (hidden, q_size),
        "self_attn.k_proj": (hidden, kv_size),
        "self_attn.v_proj": (hidden, kv_size),
        "self_attn.o_proj": (q_size, hidden),
        "mlp.gate_proj": (hidden, intermediate),
        "mlp.up_proj": (hidden, intermediate),
        "mlp.down_proj": (intermediate, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (in_features, out_features) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path


def run(core: EngineCore, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> float:
    """Queue every prompt with its adapter, step until all are done; returns output tokens per second."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        core.add_request(EngineRequest(f"{name}-{i}-{start}", prompt, params, time.time(), lora_name=name))
    num_tokens = 0
    while core.has_unfinished_requests():
        num_tokens += sum(len(delta.new_token_ids) for delta in core.step())
    return num_tokens / (time.perf_counter() - start)


def throughput(args: argparse.Namespace) -> None:
    model_dir = resolve_model(None)
    config = CheckpointConfig.from_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(text) for text in make_prompts(args.num_prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            f"lora{i}": str(write_random_adapter(Path(tmp) / f"lora{i}", config, args.rank, seed=i))
            for i in range(args.num_adapters)
        }
        core = EngineCore(
            EngineConfig.of(
                dtype="bfloat16",
                quantization=args.quantization,
                kv_cache_memory="2GiB",
                max_decode_slowdown=0,
                enable_prefix_caching=False,
                lora_modules=adapters,
                max_loras=args.num_adapters,
                max_lora_rank=args.max_lora_rank,
            )
        )
    mixed_names = [f"lora{i % args.num_adapters}" for i in range(args.num_prompts)]
    workloads: dict[str, list[str | None]] = {"base": [None] * args.num_prompts, "mixed": list(mixed_names)}
    for names in workloads.values():
        run(core, prompts[:4], names[:4], 4)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(args.repeats):
        for workload, names in workloads.items():  # alternated, so that both see the same machine load
            rates[workload].append(run(core, prompts, names, args.max_tokens))
    base, mixed = (statistics.median(rates[name]) for name in workloads)
    print(
        f"prompts={args.num_prompts} max_tokens={args.max_tokens} adapters={args.num_adapters} rank={args.rank} "
        f"max_lora_rank={args.max_lora_rank} quantization={args.quantization} threads={torch.get_num_threads()}"
    )
    print(
        f"base {base:7.1f} tok/s  mixed over {args.num_adapters} adapters {mixed:7.1f} tok/s  "
        f"ratio {mixed / base:5.2f}  (medians of {args.repeats}; target >= 0.80)"
    )


def compare_cpu_formulations(rank: int, num_slots: int = 4) -> None:
    """ms per step of each CPU formulation of the deltas of SmolLM2's 120 adapted projections, bf16."""
    dtype, num_layers = torch.bfloat16, 30
    # (in, out, K) of qkv, gate/up, o, down at this rank (K = parts x rank).
    shapes = [(576, 960, 3 * rank), (576, 3072, 2 * rank), (576, 576, rank), (1536, 576, rank)]
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    # The engine's layout: A [S, K, in] and B.T [S, K, out].
    slots = [[(randn(num_slots, k, i), randn(num_slots, k, o)) for i, o, k in shapes] for _ in range(num_layers)]
    # For gather-bmm: each slot's A.T, gathered per token.
    slots_t = [[(a.transpose(1, 2).contiguous(), b_t) for a, b_t in layer] for layer in slots]
    # For all-slots-dense: every slot's A stacked ([S*K, in]) and B side by side ([out, S*K]), oneDNN-packed
    # (spindle.kernels.linear.pack_weight), for its fused add.
    dense = [
        [(pack_weight(a.flatten(0, 1)), pack_weight(b_t.flatten(0, 1).T.contiguous())) for a, b_t in layer]
        for layer in slots
    ]
    base = [[Projection(randn(o, i)) for i, o, _ in shapes] for _ in range(num_layers)]  # as the engine runs them

    def segments(xs: list, ys: list, runs: list, _: torch.Tensor) -> None:
        for layer in slots:
            for (a, b_t), x, y in zip(layer, xs, ys, strict=True):
                for start, end, slot in runs:
                    y[start:end].addmm_(torch.mm(x[start:end], a[slot].T), b_t[slot])

    def cpp_kernel(xs: list, ys: list, runs: list, _: torch.Tensor) -> None:
        table = torch.tensor(runs, dtype=torch.int64)
        for layer in slots:
            for (a, b_t), x, y, (_, out, k) in zip(layer, xs, ys, shapes, strict=True):
                # A fused projection's part reads only its own rank block (the engine's B is zero elsewhere).
                parts = k // rank
                part_ends = [out * (p + 1) // parts for p in range(parts)]
                cpu.lora_add_(y, x, a, b_t, table, part_ends, torch.full((num_slots, parts), rank))

    def gather_bmm(xs: list, ys: list, _: list, token_slots: torch.Tensor) -> None:
        for layer in slots_t:
            for (a_t, b_t), x, y in zip(layer, xs, ys, strict=True):
                y.add_(torch.bmm(torch.bmm(x.unsqueeze(1), a_t[token_slots]), b_t[token_slots]).squeeze(1))

    def all_slots_dense(xs: list, ys: list, _: list, token_slots: torch.Tensor) -> None:
        masks = {}
        for k in {s[2] for s in shapes}:
            mask = torch.zeros(len(token_slots), num_slots, k, dtype=dtype)
            mask[torch.arange(len(token_slots)), token_slots] = 1
            masks[k] = mask.flatten(1)
        for layer in dense:
            for (a_all, b_all), x, y, (_, _, k) in zip(layer, xs, ys, shapes, strict=True):
                t = torch.ops.mkldnn._linear_pointwise(x, a_all, None, "none", [], "").mul_(masks[k])
                torch.ops.mkldnn._linear_pointwise.binary(t, y, b_all, None, "add")

    def base_projections(xs: list, *_: object) -> None:
        for layer in base:
            for projection, x in zip(layer, xs, strict=True):
                projection(x)

    cases = {
        "decode 32 tokens, 4 adapters": [8] * 4,
        "decode 64 tokens, 4 adapters": [16] * 4,
        "decode 64 tokens, 1 adapter": [64],
        "prefill 512 tokens, 1 adapter": [512],
        "prefill 512 tokens, 4 adapters": [128] * 4,
    }
    print(f"bf16, rank {rank}, {num_slots} slots, ms per step of 30 layers x 4 projections (median of 5)")
    for case, group_sizes in cases.items():
        token_slots = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(group_sizes))
        runs, start = [], 0
        for slot, n in enumerate(group_sizes):
            runs.append((start, start + n, slot))
            start += n
        xs = [randn(start, i) for i, _, _ in shapes]
        ys = [randn(start, o) for _, o, _ in shapes]
        row = []
        for name, fn in [
            ("base", base_projections),
            ("segments", segments),
            ("gather_bmm", gather_bmm),
            ("all_slots_dense", all_slots_dense),
            ("cpp_kernel", cpp_kernel),
        ]:
            if name == "gather_bmm" and start > 64:
                continue  # a [tokens, K, in] copy of the weights per projection: hundreds of MB at 512 tokens
            fn(xs, ys, runs, token_slots)
            times = []
            for _ in range(5):
                begin = time.perf_counter()
                fn(xs, ys, runs, token_slots)
                times.append(time.perf_counter() - begin)
            row.append(f"{name} {1000 * statistics.median(times):6.1f}")
        print(f"{case:32s} " + "  ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    parser.add_argument("--max-lora-rank", type=int, default=8, help="the engine's slot rank")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--formulations", action="store_true", help="time the CPU formulations instead")
    args = parser.parse_args()
    if args.formulations:
        compare_cpu_formulations(args.rank)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
