"""What a run of the model computes, and how fast this machine multiplies matrices: the ceiling benchmarks report
their runs against.

A Llama-family decoder's work is its projections (two FLOPs per weight per token), its attention (each position's
dot products with its context, and the weighted sum of the values) and the LM head rows that are sampled.
:func:`matmul_rate` measures the matmul rate of the device the run computes on (the CUDA GPU when there is one, else
the CPU) in a dtype with one large ``torch.mm``, in the benchmark's own run, so that the fraction printed beside a
throughput is of this device at this moment (these machines are shared). :func:`median_seconds` times one call, as
the kernel and projection benchmarks do. As a script it prints the rate::

    python -m bench.flops --device cuda --dtype bfloat16 --size 8192
"""

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoConfig


@dataclass
class Shapes:
    """What the FLOP count needs of a model: its projection sizes, attention heads and vocabulary."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, model_dir: str) -> "Shapes":
        """Read from the checkpoint's ``config.json``."""
        config = AutoConfig.from_pretrained(model_dir)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            config.num_hidden_layers,
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            config.vocab_size,
        )

    def flops(self, prompt_lens: list[int], output_lens: list[int]) -> float:
        """FLOPs of generating ``output_lens`` tokens after ``prompt_lens``, request for request.

        Every position that runs the layers (the prompt, and all outputs but the last), its attention over its
        context, and one LM-head row per output.
        """
        qkv_o = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        per_token = 2 * self.layers * (qkv_o + 3 * self.hidden * self.intermediate)
        total = 0.0
        for prompt, output in zip(prompt_lens, output_lens, strict=True):
            positions = prompt + output - 1
            # Position p attends p + 1 keys: q.k and p.v, 2 FLOPs per multiply-add, per head and layer.
            attention = 4 * self.layers * self.heads * self.head_dim * positions * (positions + 1) / 2
            total += positions * per_token + attention + output * 2 * self.hidden * self.vocab
        return total


def median_seconds(fn: Callable[[], object], repeats: int = 15) -> float:
    """The median wall time of ``fn()`` in seconds over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def default_device() -> str:
    """The device a run computes on: ``cuda`` when there is one, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def matmul_rate(dtype: torch.dtype, size: int = 2048, repeats: int = 10, device: str | None = None) -> float:
    """``device``'s matmul rate in ``dtype``, FLOP/s: the best of ``repeats`` ``size``-cubed ``torch.mm``.

    ``device`` defaults to :func:`default_device`; on CUDA each product is timed to its end (a synchronize).
    """
    device = device or default_device()
    a, b = torch.randn(2, size, size, dtype=dtype, device=device).unbind(0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description="Print a device's matmul rate (the best of N size-cubed products).")
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--size", type=int, default=2048)
    args = parser.parse_args()
    rate = matmul_rate(getattr(torch, args.dtype), args.size, device=args.device)
    print(f"{args.device} {args.dtype} {args.size}^3 matmul: {rate / 1e12:.2f} TFLOP/s")


if __name__ == "__main__":
    main()
