"""Quantized CPU projections against the dense packed weight, per batch size: where the crossover lies.

Times one step's projections over SmolLM2-135M's shapes (per layer: fused q/k/v, o, fused gate/up, down) with 30 layers
of distinct random weights, so that each call streams its weight from memory as in a model's step. Per token count it
runs, in turn: the dense float32 weight packed for oneDNN (what a model without quantization runs), and for int8 (one
scale per row) and int4 (groups of 32) the weight-only kernel (up to ``spindle.kernels.cpu.MAX_INT8_TOKENS``) and the
panel kernel, both through :class:`~spindle.kernels.linear.Projection` built within ``weight_only`` with its crossover
forced, and the default projection, which quantizes its activations (``a8_linear`` on AVX2, W8A8 for int8 on AVX-512
VNNI); then the default projection of the int8 weights regrouped per 32 inputs, GGUF's Q8_0 layout, which W8A8 does
not take (``a8_linear`` with VNNI too). Prints the median ms per step of each variant and the ratio of each quantized
one to the dense one (measured in the same rounds, interleaved)::

    .venv/bin/python -m bench.quant_linear                  # 1 to 512 tokens, 5 rounds
    .venv/bin/python -m bench.quant_linear --tokens 1 8 64 --rounds 3 --dtype bfloat16
    .venv/bin/python -m bench.quant_linear --threads 1 --cpu-time   # on a shared machine

Run it as a module: as a script, bench/ comes first on sys.path and this file would shadow the kernels package.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from spindle.kernels import cpu, linear, quant
from spindle.kernels.linear import Projection

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
"""SmolLM2-135M's projections per layer, ``(out, in)``: q/k/v fused, o, gate/up fused, down."""

LAYERS = 30


def step(projections: list[Projection], inputs: dict[int, torch.Tensor]) -> Callable[[], None]:
    """One step's projections: every layer's, each on an input of its width."""

    def run() -> None:
        for projection in projections:
            projection(inputs[projection.in_features])

    return run


def main() -> None:
    """Build the weights, time every variant per token count, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per token count (medians)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time this process' CPU seconds (with --threads 1: others' load aside)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inputs, generator=generator) * 0.05 for _ in range(LAYERS) for out, inputs in SHAPES]
    variants: dict[str, tuple[list[Projection], int]] = {"dense": ([Projection(w.to(dtype)) for w in weights], 0)}
    for bits in (8, 4):
        forms = [quant.quantize(w, bits) for w in weights]
        with linear.weight_only():
            quantized = [Projection(torch.empty(0, dtype=dtype), None, form) for form in forms]
        variants[f"int{bits} weight-only"] = (quantized, cpu.MAX_INT8_TOKENS)
        variants[f"int{bits} panel"] = (quantized, 0)
        variants[f"int{bits} default"] = ([Projection(torch.empty(0, dtype=dtype), None, form) for form in forms], 0)
    q8_0 = [quant.widen(quant.quantize(w, 8), quant.A8_BLOCK) for w in weights]
    variants["Q8_0 default"] = ([Projection(torch.empty(0, dtype=dtype), None, form) for form in q8_0], 0)
    del weights
    what = "CPU ms" if args.cpu_time else "ms"
    threads = torch.get_num_threads()
    print(f"{threads} threads, {args.dtype}, {what} per step of {LAYERS} layers (median of {args.rounds})")
    names = list(variants)
    print(f"{'tokens':>6} " + " ".join(f"{name:>17}" for name in names) + "   ratios to dense")
    for tokens in args.tokens:
        inputs = {width: torch.randn(tokens, width, generator=generator).to(dtype) for _, width in SHAPES}
        times: dict[str, list[float]] = {name: [] for name in names}
        runnable = [name for name in names if "weight-only" not in name or tokens <= cpu.MAX_INT8_TOKENS]
        for round_ in range(args.rounds + 1):
            for name in runnable:
                projections, limit = variants[name]
                for key in linear.MAX_QUANTIZED_TOKENS:
                    linear.MAX_QUANTIZED_TOKENS[key] = limit
                run = step(projections, inputs)
                start = clock()
                run()
                if round_:  # the first round warms up
                    times[name].append(clock() - start)
        medians = {name: 1e3 * statistics.median(times[name]) for name in runnable}
        cells = " ".join(f"{medians[name]:17.1f}" if name in medians else f"{'-':>17}" for name in names)
        ratios = " ".join(f"{medians[name] / medians['dense']:.2f}" for name in runnable[1:])
        print(f"{tokens:6d} {cells}   {ratios}")


if __name__ == "__main__":
    main()
