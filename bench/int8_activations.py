"""Dynamic int8 activations x int8 weights for the batched projections: what they would gain and cost on this CPU.

Issue 10 asked to try int8 GEMMs past the dense bound where the quality holds. Spindle runs a projection of more than
a few tokens on its dense weight (float32, or bf16 where oneDNN has it; pre-packed, see ``spindle.kernels.linear``).
This script measures the alternative in one run, on the embedded SmolLM2, with torch's dynamic int8 linear
(``quantized::linear_dynamic``: the weight int8 per output row, the activations quantized on each call):

1. Each projection shape at a decode batch (64 tokens) and a prefill chunk (512 tokens): GFLOP/s of the dense packed
   weight against int8 with the activations quantized per tensor (torch's own) and per token (each row scaled to its
   own maximum first).
2. Perplexity on ``bench.quality``'s text with every call of more than 8 tokens in int8, per token: plain, and with
   SmoothQuant's migration (each input channel divided by ``max|x|^a / max|w|^(1-a)``, the weight's column
   multiplied by it; ``a = --alpha``), the maxima calibrated on ``bench.offline_throughput``'s prompts.
3. ``bench.offline_throughput``'s varied workload, dense against int8 per token.

Quantized engines: ``--engine onednn`` quantizes activations to 8 bits; ``x86``/``fbgemm`` reduce them to 7 (their
AVX2 kernels would otherwise saturate 16-bit sums), which costs more perplexity::

    .venv/bin/python -m bench.int8_activations
"""

import argparse
import functools
import statistics
import warnings

import torch

from bench.flops import median_seconds
from bench.offline_throughput import make_prompts, output_lengths, spindle_run
from bench.quality import perplexity, windows
from spindle import LLM, SamplingParams
from spindle.kernels.linear import Projection

DENSE_TOKENS = 8
"""Calls of at most this many tokens stay as Spindle runs them (the quantized weight-only kernels' range)."""


class Int8Projection:
    """A prepared projection whose calls of more than :data:`DENSE_TOKENS` tokens run dynamic int8 per token.

    Args:
        inner: Spindle's projection, which keeps the smaller calls.
        weight: its float32 ``[out, in]`` weight (:func:`dense_weight`).
        smooth: SmoothQuant's per-input-channel divisor, or None for plain per-token quantization.
        reduce_range: 7-bit activations (the x86 and fbgemm engines need them; onednn does not).

    """

    def __init__(
        self, inner: Projection, weight: torch.Tensor, smooth: torch.Tensor | None, reduce_range: bool
    ) -> None:
        self.inner = inner
        self.inverse_smooth = None if smooth is None else 1 / smooth
        if smooth is not None:
            weight = weight * smooth
        scales = weight.abs().amax(1).clamp_min(1e-8) / 127
        with warnings.catch_warnings():  # torch deprecates quantized tensors; its int8 GEMMs still take them
            warnings.simplefilter("ignore")
            zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.reduce_range = reduce_range

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= DENSE_TOKENS:
            return self.inner(x)
        # torch's dynamic int8 linear takes float32: a bf16 model's rows are widened, then narrowed.
        rows = rows.float()
        if self.inverse_smooth is not None:
            rows = rows * self.inverse_smooth
        row_max = rows.abs().amax(1, keepdim=True).clamp_min(1e-8)
        out = torch.ops.quantized.linear_dynamic(rows / row_max, self.packed, self.reduce_range).mul_(row_max)
        if self.inner.bias is not None:
            out += self.inner.bias
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


class MaxRecorder:
    """A prepared projection that records each input channel's largest magnitude (SmoothQuant's calibration)."""

    def __init__(self, inner: Projection) -> None:
        self.inner = inner
        self.channel_max: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Record, then project as ``inner`` does."""
        seen = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        self.channel_max = seen if self.channel_max is None else torch.maximum(self.channel_max, seen)
        return self.inner(x)


def stored(projection: Projection) -> torch.Tensor:
    """The dense weight a prepared CPU projection keeps (tiled for our bf16 kernel, oneDNN-packed, or plain)."""
    return next(w for w in (projection.tiled, projection.packed, projection.dense) if w is not None)


def dense_weight(projection: Projection) -> torch.Tensor:
    """The float32 ``[out, in]`` weight a prepared projection applies (recovered through it: packed copies only)."""
    identity = torch.eye(projection.in_features, dtype=stored(projection).dtype)
    out = projection(identity)  # more rows than DENSE_TOKENS: the dense weight, not the quantized kernel
    if projection.bias is not None:
        out = out - projection.bias
    return out.float().T.contiguous()


def slots(llm: LLM) -> list[tuple[dict, str]]:
    """Where each prepared projection of ``llm``'s model sits: ``(prepared dict, key)``."""
    model = llm.llm_engine.core.runner.model
    found = []
    for name, (module, _) in model.projections().items():
        owner = model if name == "lm_head" else module
        found.append((owner.prepared, name.rsplit(".", 1)[-1]))
    return found


def use_int8(llm: LLM, alpha: float | None, reduce_range: bool) -> None:
    """Swap ``llm``'s projections for :class:`Int8Projection` (SmoothQuant with ``alpha``, or plain with None)."""
    recorders = {}
    if alpha is not None:
        for prepared, key in slots(llm):
            recorders[id(prepared), key] = prepared[key] = MaxRecorder(prepared[key])
        llm.generate(make_prompts(64, first=10_000), SamplingParams(max_tokens=1), use_tqdm=False)
        for prepared, key in slots(llm):
            prepared[key] = prepared[key].inner
    for prepared, key in slots(llm):
        weight, smooth = dense_weight(prepared[key]), None
        if alpha is not None:
            weight_max = weight.abs().amax(0).clamp_min(1e-5)
            act_max = recorders[id(prepared), key].channel_max.clamp_min(1e-5)
            smooth = act_max**alpha / weight_max ** (1 - alpha)
        prepared[key] = Int8Projection(prepared[key], weight, smooth, reduce_range)


def restore(llm: LLM) -> None:
    """Undo :func:`use_int8`."""
    for prepared, key in slots(llm):
        if isinstance(prepared[key], Int8Projection):
            prepared[key] = prepared[key].inner


def gemm_rates(llm: LLM, reduce_range: bool) -> None:
    """Print GFLOP/s of each distinct projection shape: dense, int8 per tensor, int8 per token."""
    shapes = {}
    for prepared, key in slots(llm):
        shapes.setdefault((prepared[key].out_features, prepared[key].in_features), (key, prepared[key]))
    print("GFLOP/s per projection shape (dense packed | int8 per tensor | int8 per token):")
    for (out_features, in_features), (key, projection) in shapes.items():
        int8 = Int8Projection(projection, dense_weight(projection), None, reduce_range)

        def per_tensor(x: torch.Tensor, int8: Int8Projection = int8) -> torch.Tensor:
            return torch.ops.quantized.linear_dynamic(x.float(), int8.packed, reduce_range).to(x.dtype)

        for tokens in (64, 512):
            x = torch.randn(tokens, in_features, dtype=stored(projection).dtype)
            rates = [
                2 * tokens * in_features * out_features / median_seconds(functools.partial(f, x)) / 1e9
                for f in (projection, per_tensor, int8)
            ]
            print(
                f"  {key:13s} {in_features:5d}->{out_features:<6d} {tokens:4d} tokens: "
                + " | ".join(f"{r:6.1f}" for r in rates)
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="onednn", choices=["onednn", "x86", "fbgemm"])
    parser.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's migration strength")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="runs of the offline workload per side")
    args = parser.parse_args()
    torch.backends.quantized.engine = args.engine
    reduce_range = args.engine != "onednn"
    # No prefix caching: the perplexity windows are scored three times, and each time must compute them.
    llm = LLM(kv_cache_memory="2GiB", enable_prefix_caching=False)
    print(f"engine={args.engine} threads={torch.get_num_threads()} dtype={llm.llm_engine.core.runner.dtype}")
    gemm_rates(llm, reduce_range)

    chunks = windows(llm, args.window)
    print(f"Perplexity ({sum(len(c) - 1 for c in chunks)} tokens of bench.quality's text):")
    base = perplexity(llm, chunks)
    print(f"  dense                         {base:8.3f}")
    for label, alpha in [("int8 per token", None), (f"int8 per token, smooth {args.alpha}", args.alpha)]:
        use_int8(llm, alpha, reduce_range)
        score = perplexity(llm, chunks)
        print(f"  {label:29s} {score:8.3f}  ({score / base - 1:+.1%})")
        restore(llm)

    lengths = output_lengths("varied", 64, 16, 192)
    runs = [make_prompts(64, first=20_000 + r * 64) for r in range(2 * args.repeats)]

    def rate(prompt_sets: list[list[str]]) -> float:  # output tok/s of the median run
        return sum(lengths) / statistics.median(spindle_run(llm, prompts, lengths)[0] for prompts in prompt_sets)

    dense = rate(runs[: args.repeats])
    use_int8(llm, None, reduce_range)
    int8 = rate(runs[args.repeats :])
    print(
        f"bench.offline_throughput's varied workload (64 prompts, medians of {args.repeats}): dense {dense:.1f} tok/s, "
        f"int8 per token {int8:.1f} tok/s ({int8 / dense:.2f}x)"
    )


if __name__ == "__main__":
    main()
