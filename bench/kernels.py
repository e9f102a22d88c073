"""Times each Triton kernel on one CUDA GPU against the device's peak and a torch peer, checking every result first.

Memory-bound kernels (decode attention, cache write, RMSNorm, rotary, SiLU-and-mul) print the bandwidth they
achieve: the bytes they must move (each operand read once, each result written once) over the median time. The
prefill kernel prints its FLOP rate (two matmuls over the causal half of the score matrix). Next to each: the
device's peak (memory: clock x bus width from the device properties; compute: the spec sheet's dense bf16 figure
for known GPUs, and in every case a large cuBLAS matmul, the practical ceiling), and a peer on the same data: decode
and prefill attention against ``torch.nn.functional.scaled_dot_product_attention`` on K/V gathered densely out of
the paged cache (the gather not timed), the elementwise kernels against the torch references of :mod:`kernels`.

Two model shapes: SmolLM2-135M (9 query heads, 3 KV heads, head 64) and Llama-3-8B (32, 8, head 128). Runs
unattended in a minute or two on any single GPU::

    .venv/bin/python -m bench.kernels            # bfloat16; --dtype float16 or float32 also work

Run it as a module: as a script, bench/ comes first on sys.path and this file would shadow the kernels package.
"""

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SPEC_BF16_TFLOPS = {"H200": 989, "H100 SXM": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "A100": 312}
"""Dense bf16 tensor-core peaks from the vendor's spec sheets, by device-name substring (first match wins)."""

BLOCK_SIZE = 16


@dataclass
class Shape:
    """Attention heads of one model."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int


SHAPES = [Shape("SmolLM2-135M", 9, 3, 64), Shape("Llama-3-8B", 32, 8, 128)]


def bench(fn: Callable[[], object]) -> float:
    """Median seconds of ``fn`` on the GPU, with the L2 cache flushed before each run (Triton's ``do_bench``)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def row(name: str, seconds: float, amount: float, unit: str, peak: float, peer_seconds: float | None) -> None:
    """Print one result: time, achieved rate, share of the peak, and the speed-up over the peer."""
    rate = amount / seconds
    peer = f"{peer_seconds / seconds:6.2f}x" if peer_seconds else "      -"
    print(
        f"{name:58s} {seconds * 1e6:9.1f} us {rate / 1e9 if unit == 'GB/s' else rate / 1e12:9.1f} {unit:7s}"
        f" {100 * rate / peak:5.1f}%  {peer}"
    )


def paged_cache(shape: Shape, num_seqs: int, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A random K/V cache with room for ``num_seqs`` contexts of ``seq_len`` tokens, plus one spare block."""
    num_blocks = num_seqs * -(-seq_len // BLOCK_SIZE) + 1
    cache_shape = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_size)
    return torch.randn(cache_shape, dtype=dtype, device="cuda"), torch.randn(cache_shape, dtype=dtype, device="cuda")


def scattered_tables(num_seqs: int, seq_len: int, num_blocks: int) -> list[list[int]]:
    """Each sequence's blocks, drawn at random from the whole cache as a long-running server's are."""
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    order = torch.randperm(num_blocks)[: num_seqs * blocks_per_seq].view(num_seqs, blocks_per_seq)
    return order.tolist()


def dense(cache: torch.Tensor, tables: list[list[int]], seq_len: int) -> torch.Tensor:
    """Gather each sequence's K or V as ``[num_seqs, num_kv_heads, seq_len, head_size]`` for SDPA."""
    index = torch.tensor(tables, device=cache.device)
    gathered = cache[index].flatten(1, 2)[:, :seq_len]
    return gathered.transpose(1, 2).contiguous()


def bench_decode(shape: Shape, num_seqs: int, seq_len: int, dtype: torch.dtype, peak_bandwidth: float) -> None:
    """Decode attention for ``num_seqs`` contexts of ``seq_len``, against SDPA over the densely gathered K/V."""
    import spindle.kernels.triton as tk
    from spindle.kernels import AttentionMetadata
    from spindle.kernels.triton.decode_attention import num_splits_for

    scale = shape.head_size**-0.5
    k_cache, v_cache = paged_cache(shape, num_seqs, seq_len, dtype)
    tables = scattered_tables(num_seqs, seq_len, k_cache.shape[0])
    meta = AttentionMetadata.from_lists([1] * num_seqs, [seq_len] * num_seqs, tables, BLOCK_SIZE, "cuda")
    query = torch.randn(num_seqs, shape.num_heads, shape.head_size, dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    splits = num_splits_for(num_seqs, shape.num_kv_heads, seq_len, query.device)
    key, value = dense(k_cache, tables, seq_len), dense(v_cache, tables, seq_len)

    def ours() -> None:
        tk.decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, out, splits)

    def peer() -> torch.Tensor:
        return F.scaled_dot_product_attention(query[:, :, None], key, value, scale=scale, enable_gqa=True)

    ours()
    torch.testing.assert_close(out, peer()[:, :, 0], atol=2e-2, rtol=2e-2)
    kv_bytes = 2 * num_seqs * seq_len * shape.num_kv_heads * shape.head_size * query.element_size()
    name = f"decode   {shape.name:12s} batch {num_seqs:3d} x ctx {seq_len:5d} ({splits:2d} splits)"
    row(name, bench(ours), kv_bytes + 2 * query.nbytes, "GB/s", peak_bandwidth, bench(peer))


def bench_prefill(shape: Shape, num_seqs: int, cached: int, new: int, dtype: torch.dtype, peak_flops: float) -> None:
    """Causal prefill of ``new`` tokens after ``cached`` ones, against SDPA on the densely gathered K/V."""
    import spindle.kernels.triton as tk
    from spindle.kernels import AttentionMetadata

    scale = shape.head_size**-0.5
    seq_len = cached + new
    k_cache, v_cache = paged_cache(shape, num_seqs, seq_len, dtype)
    tables = scattered_tables(num_seqs, seq_len, k_cache.shape[0])
    meta = AttentionMetadata.from_lists([new] * num_seqs, [seq_len] * num_seqs, tables, BLOCK_SIZE, "cuda")
    query = torch.randn(num_seqs * new, shape.num_heads, shape.head_size, dtype=dtype, device="cuda")
    out = torch.empty_like(query)
    key, value = dense(k_cache, tables, seq_len), dense(v_cache, tables, seq_len)
    sdpa_query = query.view(num_seqs, new, shape.num_heads, shape.head_size).transpose(1, 2)
    # Query row i sits at position cached + i and sees keys 0..cached + i (SDPA's is_causal aligns top-left).
    mask = torch.ones(new, seq_len, dtype=torch.bool, device="cuda").tril(cached) if cached else None

    def ours() -> None:
        tk.prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, new, scale, out
        )

    def peer() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            sdpa_query, key, value, attn_mask=mask, is_causal=not cached, scale=scale, enable_gqa=True
        )

    ours()
    torch.testing.assert_close(out, peer().transpose(1, 2).reshape_as(out), atol=2e-2, rtol=2e-2)
    # QK^T and PV over the visible (causal) part of each score matrix, 2 FLOPs per multiply-add.
    visible = num_seqs * (new * cached + new * (new + 1) / 2)
    flops = 2 * 2 * shape.num_heads * shape.head_size * visible
    name = f"prefill  {shape.name:12s} {num_seqs} seqs x {new:4d} new after {cached:4d} cached"
    row(name, bench(ours), flops, "TFLOP/s", peak_flops, bench(peer))


def bench_elementwise(shape: Shape, dtype: torch.dtype, peak_bandwidth: float) -> None:
    """Cache write, RMSNorm with residual, rotary and SiLU-and-mul on a 4096-token step, against torch."""
    import spindle.kernels.triton as tk
    from spindle.kernels import activation, attention, build_cos_sin_cache, norm, rotary

    tokens = 4096
    hidden, intermediate = shape.num_heads * shape.head_size, 4 * shape.num_heads * shape.head_size
    element = torch.empty((), dtype=dtype).element_size()
    kv_size = shape.num_kv_heads * shape.head_size
    k_cache, v_cache = paged_cache(shape, 4, tokens, dtype)
    key, value = torch.randn(2, tokens, shape.num_kv_heads, shape.head_size, dtype=dtype, device="cuda").unbind(0)
    slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device="cuda")[:tokens]
    x, residual = torch.randn(2, tokens, hidden, dtype=dtype, device="cuda").unbind(0)
    weight = torch.rand(hidden, dtype=dtype, device="cuda") + 0.5
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    query = torch.randn(tokens, shape.num_heads, shape.head_size, dtype=dtype, device="cuda")
    cos_sin = build_cos_sin_cache(shape.head_size, 8192, 500000.0, None, dtype).cuda()
    gate_up = torch.randn(tokens, 2 * intermediate, dtype=dtype, device="cuda")
    cases = [
        (
            "cache write",
            lambda: tk.reshape_and_cache(key, value, k_cache, v_cache, slots),
            lambda: attention.reshape_and_cache(key, value, k_cache, v_cache, slots),
            2 * 2 * tokens * kv_size * element,
            None,
        ),
        (
            "add + rms_norm",
            lambda: tk.rms_norm(x, weight, 1e-5, residual),
            lambda: norm.rms_norm(x, weight, 1e-5, residual),
            4 * tokens * hidden * element,
            lambda ours, ref: torch.testing.assert_close(ours[0], ref[0], atol=2e-2, rtol=2e-2),
        ),
        (
            "rotary (q and k)",
            lambda: tk.rotary_embedding(positions, query, key, cos_sin),
            lambda: rotary.rotary_embedding(positions, query, key, cos_sin),
            # q and k read and written, plus one cos/sin row per token.
            2 * tokens * (hidden + kv_size) * element + tokens * shape.head_size * element,
            lambda ours, ref: torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2),
        ),
        (
            "silu_and_mul",
            lambda: tk.silu_and_mul(gate_up),
            lambda: activation.silu_and_mul(gate_up),
            3 * tokens * intermediate * element,
            lambda ours, ref: torch.testing.assert_close(ours, ref, atol=2e-2, rtol=2e-2),
        ),
    ]
    for name, ours, peer, nbytes, check in cases:
        if check is None:  # the cache write: compare the caches each side leaves
            before = k_cache.clone(), v_cache.clone()
            ours()
            after = k_cache.clone(), v_cache.clone()
            k_cache.copy_(before[0])
            v_cache.copy_(before[1])
            peer()
            assert torch.equal(after[0], k_cache) and torch.equal(after[1], v_cache), "cache write differs"
        else:
            check(ours(), peer())
        row(f"{name:16s} {shape.name:12s} {tokens} tokens", bench(ours), nbytes, "GB/s", peak_bandwidth, bench(peer))


def peaks(dtype: torch.dtype) -> tuple[float, float]:
    """(memory bytes/s, matmul FLOP/s) to measure against; prints where each comes from."""
    props = torch.cuda.get_device_properties(0)
    # DDR: two transfers per clock; memory_clock_rate is in kHz, the bus width in bits.
    spec_bandwidth = 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8
    src, dst = torch.empty(2, 2**30, dtype=torch.uint8, device="cuda").unbind(0)
    copy_bandwidth = 2 * src.numel() / bench(lambda: dst.copy_(src))
    a, b = torch.randn(2, 8192, 8192, dtype=dtype, device="cuda").unbind(0)
    cublas_flops = 2 * 8192**3 / bench(lambda: a @ b)
    spec_tflops = next((v for k, v in SPEC_BF16_TFLOPS.items() if k in props.name), None)
    print(f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, {dtype}")
    print(f"  memory: {spec_bandwidth / 1e9:.0f} GB/s peak (clock x bus), copy {copy_bandwidth / 1e9:.0f} GB/s")
    spec = f"{spec_tflops} TFLOP/s spec (dense bf16)" if spec_tflops else "no spec figure for this GPU"
    print(f"  compute: {spec}, cuBLAS {dtype} 8192^3 matmul {cublas_flops / 1e12:.0f} TFLOP/s")
    # Percentages are of the spec peak when known (it is what the hardware can do), else of what cuBLAS reaches.
    peak_flops = spec_tflops * 1e12 if spec_tflops and dtype != torch.float32 else cublas_flops
    return spec_bandwidth, peak_flops


def main() -> int:
    """Benchmark every kernel for both model shapes; exits with a message at once without CUDA."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench.kernels needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False here). "
            "Without one, the kernels are checked under Triton's interpreter by `pytest tests/test_kernels_triton.py`.",
            file=sys.stderr,
        )
        return 2
    from spindle.kernels.triton.prefill_attention import prefill_tiles

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    peak_bandwidth, peak_flops = peaks(dtype)
    print(f"\n{'kernel':58s} {'median':>12s} {'achieved':>17s} {'peak':>6s} {'vs peer':>7s}")
    for shape in SHAPES:
        for num_seqs, seq_len in ((1, 8192), (16, 2048), (64, 1024), (256, 512)):
            bench_decode(shape, num_seqs, seq_len, dtype, peak_bandwidth)
        print(f"prefill tiles, {shape.name} (head {shape.head_size}): {prefill_tiles(shape.head_size, dtype)}")
        for num_seqs, cached, new in ((1, 0, 4096), (8, 0, 512), (4, 3584, 512)):
            bench_prefill(shape, num_seqs, cached, new, dtype, peak_flops)
        bench_elementwise(shape, dtype, peak_bandwidth)
    print(f"\npeak: memory {peak_bandwidth / 1e9:.0f} GB/s, compute {peak_flops / 1e12:.0f} TFLOP/s")
    print("vs peer: the peer's time over ours (> 1: Triton is faster). Peers: torch SDPA on densely gathered K/V for")
    print("decode and prefill (the gather untimed), the torch references of `kernels` for the others.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
