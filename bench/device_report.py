"""What the first hour on a GPU must yield: the numbers of a random-weight Llama-3-8B on the device, in one run.

Each section prints one ``RESULT`` line (bench/device_run.py's summary shows them), and a section that fails prints
its error there and the next one runs:

- ``copy``: the device-to-device copy bandwidth (bytes read and written per second), the ceiling of the next line.
- ``decode attention``: the decode attention kernel over a batch of long contexts with Llama-3-8B's heads: K/V
  bytes read per second, and their fraction of the copy bandwidth.
- ``matmul``: the device's bf16 matmul rate (:func:`bench.flops.matmul_rate`), the ceiling of prefill.
- ``model``: the random checkpoint's writing (:mod:`bench.random_llama`) and the engine's start-up, timed.
- ``ttft`` and ``prefill``: the time to the first token of one 4,096-token prompt, and the prompt's FLOPs
  (:class:`bench.flops.Shapes`) over it, against the matmul rate.
- ``tokens/s``: output tokens per second of an offline batch of 1 and of 256 requests (128-token prompts, greedy, eos
  ignored), prefill included.
- ``syncs/step``: the host synchronizations per decode step, counted as the warnings of
  ``torch.cuda.set_sync_debug_mode("warn")`` over a number of decode steps (CUDA only).
- ``kv budget``: the inputs and result of the engine's KV-cache budget (``ModelRunner.kv_budget``).

``--device cpu`` runs the same code on a tiny model with tiny sizes (the Triton kernel under its interpreter,
``TRITON_INTERPRET=1``): the numbers mean nothing, the code path is exercised (``make test`` does, through
tests/test_device_run.py)::

    python -m bench.device_report --model-dir /tmp/llama3-8b-random            # on a GPU: 8B shapes
    TRITON_INTERPRET=1 python -m bench.device_report --device cpu --model-dir /tmp/tiny-random
"""

import argparse
import dataclasses
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.flops import Shapes, matmul_rate, median_seconds
from bench.kernels import BLOCK_SIZE, SHAPES, Shape, bench, scattered_tables
from bench.random_llama import write
from spindle.backend.engine_core import EngineCore
from spindle.shared import SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.protocol import EngineRequest

LLAMA3_8B = next(shape for shape in SHAPES if shape.name == "Llama-3-8B")


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is.

    Attributes:
        config: the random model, one of :data:`bench.random_llama.CONFIGS`.
        heads: the decode attention kernel's heads.
        copy_bytes: the device-to-device copy's size.
        attention_batch, attention_context: the decode attention kernel's contexts, and their length.
        matmul_size: the side of the square bf16 matmul.
        prompt_len: the prompt timed to its first token.
        batches: the offline runs' batch sizes.
        batch_prompt_len, batch_output_len: each request's prompt and output in those runs.
        sync_batch, sync_steps: the decode batch and steps whose host syncs are counted.
    """

    config: str
    heads: Shape
    copy_bytes: int
    attention_batch: int
    attention_context: int
    matmul_size: int
    prompt_len: int
    batches: tuple[int, ...]
    batch_prompt_len: int
    batch_output_len: int
    sync_batch: int
    sync_steps: int


SIZES = {
    "cuda": Sizes(
        config="llama3-8b",
        heads=LLAMA3_8B,
        copy_bytes=2**30,
        attention_batch=64,
        attention_context=4096,
        matmul_size=8192,
        prompt_len=4096,
        batches=(1, 256),
        batch_prompt_len=128,
        batch_output_len=128,
        sync_batch=8,
        sync_steps=32,
    ),
    "cpu": Sizes(
        config="tiny",
        heads=Shape("tiny", 4, 2, 16),
        copy_bytes=2**22,
        attention_batch=2,
        attention_context=48,
        matmul_size=256,
        prompt_len=96,
        batches=(1, 4),
        batch_prompt_len=8,
        batch_output_len=4,
        sync_batch=2,
        sync_steps=4,
    ),
}
"""The GPU run's sizes (Llama-3-8B's), and the CPU rehearsal's, tiny so that it takes seconds."""


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """The median time of ``fn``: on CUDA by Triton's ``do_bench`` (L2 flushed, CUDA events), else one timed call."""
    return bench(fn) if device.type == "cuda" else median_seconds(fn, repeats=1)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read and written per second by a device-to-device copy of ``nbytes``."""
    src, dst = torch.empty(2, nbytes, dtype=torch.uint8, device=device).unbind(0)
    return 2 * nbytes / seconds(lambda: dst.copy_(src), device)


def decode_attention_rate(device: torch.device, heads: Shape, batch: int, context: int) -> float:
    """K/V bytes read per second by the Triton decode attention kernel, ``batch`` contexts of ``context`` tokens."""
    import spindle.kernels.triton as tk
    from spindle.kernels import AttentionMetadata
    from spindle.kernels.triton.decode_attention import num_splits_for

    dtype = torch.bfloat16
    blocks = batch * -(-context // BLOCK_SIZE) + 1
    cache_shape = (blocks, BLOCK_SIZE, heads.num_kv_heads, heads.head_size)
    k_cache, v_cache = (torch.randn(cache_shape, dtype=dtype, device=device) for _ in range(2))
    tables = scattered_tables(batch, context, blocks)
    meta = AttentionMetadata.from_lists([1] * batch, [context] * batch, tables, BLOCK_SIZE, device)
    query = torch.randn(batch, heads.num_heads, heads.head_size, dtype=dtype, device=device)
    out = torch.empty_like(query)
    splits = num_splits_for(batch, heads.num_kv_heads, context, device)
    scale = heads.head_size**-0.5

    def attend() -> None:
        tk.decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out, splits)

    kv_bytes = 2 * batch * context * heads.num_kv_heads * heads.head_size * query.element_size()
    return kv_bytes / seconds(attend, device)


class Engine:
    """An :class:`~spindle.backend.engine_core.EngineCore` on the random model, fed token ids directly."""

    def __init__(self, model_dir: Path, device: torch.device, sizes: Sizes) -> None:
        memory = {"gpu_memory_utilization": 0.9} if device.type == "cuda" else {"kv_cache_memory": "64MiB"}
        self.core = EngineCore(
            EngineConfig.of(
                model=str(model_dir),
                device=device.type,
                max_model_len=sizes.prompt_len + sizes.batch_output_len + 1,
                max_num_seqs=max(sizes.batches),
                max_num_batched_tokens=sizes.prompt_len,  # the timed prompt prefills in one step
                **memory,
            )
        )
        self.vocab = Shapes.of(str(model_dir)).vocab
        self.generator = torch.Generator().manual_seed(0)
        self.next_id = 0

    def add(self, num: int, prompt_len: int, output_len: int) -> None:
        """Queue ``num`` requests of random prompts (never sharing a cached prefix), greedy, eos ignored."""
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for _ in range(num):
            prompt = torch.randint(3, self.vocab, (prompt_len,), generator=self.generator).tolist()
            self.core.add_request(EngineRequest(str(self.next_id), prompt, params, arrival_time=time.monotonic()))
            self.next_id += 1

    def run(self) -> int:
        """Step until every request is done; returns the tokens generated."""
        generated = 0
        while self.core.has_unfinished_requests():
            generated += sum(len(delta.new_token_ids) for delta in self.core.step())
        return generated

    def first_token_seconds(self, prompt_len: int) -> float:
        """Wall time from queueing one ``prompt_len``-token prompt to its first token."""
        start = time.perf_counter()
        self.add(1, prompt_len, 1)
        self.run()
        return time.perf_counter() - start

    def tokens_per_second(self, batch: int, prompt_len: int, output_len: int) -> float:
        """Output tokens per second of ``batch`` requests run to the end, prefill included."""
        start = time.perf_counter()
        self.add(batch, prompt_len, output_len)
        generated = self.run()
        return generated / (time.perf_counter() - start)

    def syncs_per_step(self, batch: int, steps: int) -> float:
        """Host synchronizations per decode step, over ``steps`` steps of ``batch`` running requests."""
        self.add(batch, 16, steps + 2)
        while self.core.scheduler.waiting:  # the prompts prefilled: what follows are decode steps
            self.core.step()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    self.core.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        self.run()
        return sum("synchroniz" in str(w.message) for w in caught) / steps


class Report:
    """Runs the sections in order, each one's failure printed and counted, never the end of the report."""

    def __init__(self) -> None:
        self.failures = 0

    def section(self, name: str, measure: Callable[[], str]) -> None:
        """Print ``RESULT <name>: <measure()>``, or the section's error."""
        start = time.perf_counter()
        try:
            text = measure()
        except Exception as error:
            traceback.print_exc()
            self.failures += 1
            text = f"FAILED {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        print(f"RESULT {name:18s} {text}  [{time.perf_counter() - start:.1f} s]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=SIZES)
    parser.add_argument("--model-dir", type=Path, required=True, help="written here, unless it holds a model")
    args = parser.parse_args()
    device, sizes = torch.device(args.device), SIZES[args.device]
    report = Report()
    results: dict[str, float] = {}

    def copy() -> str:
        results["copy"] = copy_bandwidth(device, sizes.copy_bytes)
        return f"{results['copy'] / 1e9:.0f} GB/s device-to-device ({sizes.copy_bytes / 2**20:.0f} MiB, read + write)"

    def attention() -> str:
        rate = decode_attention_rate(device, sizes.heads, sizes.attention_batch, sizes.attention_context)
        fraction = f", {100 * rate / results['copy']:.0f}% of the copy bandwidth" if "copy" in results else ""
        return (
            f"{rate / 1e9:.3g} GB/s of K/V read{fraction} (batch {sizes.attention_batch} x context "
            f"{sizes.attention_context}, {sizes.heads.num_heads}/{sizes.heads.num_kv_heads} heads of "
            f"{sizes.heads.head_size}, bf16)"
        )

    def matmul() -> str:
        results["matmul"] = matmul_rate(torch.bfloat16, sizes.matmul_size, device=args.device)
        return f"{results['matmul'] / 1e12:.1f} TFLOP/s bf16 ({sizes.matmul_size}^3 torch.mm)"

    engine: list[Engine] = []

    def model() -> str:
        start = time.perf_counter()
        written = "reused"
        if not (args.model_dir / "model.safetensors").is_file():
            write(args.model_dir, sizes.config, args.device)
            written = f"written in {time.perf_counter() - start:.1f} s"
        start = time.perf_counter()
        engine.append(Engine(args.model_dir, device, sizes))
        size = (args.model_dir / "model.safetensors").stat().st_size
        return (
            f"random {sizes.config} ({size / 1e9:.1f} GB) {written}; engine started in "
            f"{time.perf_counter() - start:.1f} s ({engine[0].core.num_blocks} KV blocks)"
        )

    def ttft() -> str:
        engine[0].first_token_seconds(sizes.prompt_len)  # warm-up: the first long prefill may allocate
        results["ttft"] = engine[0].first_token_seconds(sizes.prompt_len)
        return f"{results['ttft'] * 1e3:.0f} ms to the first token of a {sizes.prompt_len}-token prompt"

    def prefill() -> str:
        flops = Shapes.of(str(args.model_dir)).flops([sizes.prompt_len], [1])
        rate = flops / results["ttft"]
        fraction = f", {100 * rate / results['matmul']:.0f}% of the matmul rate" if "matmul" in results else ""
        return f"{rate / 1e12:.3g} TFLOP/s over the {sizes.prompt_len}-token prompt{fraction}"

    def throughput(batch: int) -> Callable[[], str]:
        def measure() -> str:
            rate = engine[0].tokens_per_second(batch, sizes.batch_prompt_len, sizes.batch_output_len)
            return f"{rate:.0f} output tokens/s ({sizes.batch_prompt_len}-token prompts, {sizes.batch_output_len} out)"

        return measure

    def syncs() -> str:
        if device.type != "cuda":
            return "n/a on cpu (torch.cuda.set_sync_debug_mode is CUDA's)"
        per_step = engine[0].syncs_per_step(sizes.sync_batch, sizes.sync_steps)
        return f"{per_step:.2f} host syncs per decode step ({sizes.sync_steps} steps of batch {sizes.sync_batch})"

    def kv_budget() -> str:
        budget = engine[0].core.runner.kv_budget
        return "None (the CPU's budget is kv_cache_memory)" if budget is None else str(dataclasses.asdict(budget))

    report.section("copy", copy)
    report.section("decode attention", attention)
    report.section("matmul", matmul)
    report.section("model", model)
    report.section("ttft", ttft)
    report.section("prefill", prefill)
    for batch in sizes.batches:
        report.section(f"tokens/s batch {batch}", throughput(batch))
    report.section("syncs/step", syncs)
    report.section("kv budget", kv_budget)
    if engine:
        engine[0].core.close()
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
