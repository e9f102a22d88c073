"""The CPU attention kernels, one layer: prefill against torch's flash attention, and decode per call.

Each row is a prefill chunk of ``n`` tokens after ``c`` cached ones, its context in a paged cache whose blocks lie
anywhere (as they do in serving): Spindle's kernel (``spindle.kernels.cpu``'s ``prefill_attention``, which reads the
context in place) against the gather of that context plus torch's flash attention (``_flash_chunk``: the chunk's own
keys causally, the cached prefix unmasked, merged; the torch reference path's). Prints the
medians (ms a layer), Spindle's rate over the causal part of the score matrix (two matmuls, 2 FLOPs a multiply-add),
the two outputs' largest difference, and flash's time over ours::

    .venv/bin/python -m bench.cpu_attention --dtype bfloat16

With ``--decode`` it times instead, per call, a decode step's attention block at the shapes of issue 43's single
stream (1 sequence, 12/4 heads of 128, contexts of 64, 128 and 512 tokens), of ``bench.moe``'s tiny Mixtral (64
sequences, 4/2 heads of 64, contexts of 16-96 tokens) and of a batch-64 decode step of the embedded SmolLM2 (9/3
heads of 64, contexts of 50-300 tokens, each call on the next of 30 layers' caches, so that it reads its keys and
values from memory, as a step's layers do), on 1 and 2 threads: the decode kernel alone (``decode_attention``, with
the rate at which it reads the cache), the rotation and cache write (``rotary_embedding_and_cache``), and the whole of
:func:`~spindle.kernels.attend` (both, and the Python around them), medians in microseconds::

    .venv/bin/python -m bench.cpu_attention --decode
"""

import argparse
import itertools
import random

import torch

from bench.flops import median_seconds
from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.loader import resolve_dtype, resolve_model
from spindle.kernels import (
    AttentionMetadata,
    attend,
    attention_metadata,
    build_cos_sin_cache,
    rotary_embedding_and_cache,
)
from spindle.kernels.attention import _flash_chunk
from spindle.kernels.cpu import cpu_ops

CHUNKS = [
    (2048, 0),
    (2048, 4096),
    (1024, 6000),
    (512, 7000),
    (512, 500),
    (256, 3000),
    (64, 3000),
    (16, 2000),
    (4, 7000),
]
"""(new tokens, cached tokens) of the chunks measured: a long prompt's chunks, and short ones after long prefixes."""
BLOCK_SIZE = 16


def chunk_row(n: int, cached: int, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """One chunk's line: ``query`` holds its ``n`` tokens, the caches room for their context in scattered blocks."""
    seq_len, (_, heads, head_size) = n + cached, query.shape
    table = torch.randperm(k_cache.shape[0])[: -(-seq_len // BLOCK_SIZE)].tolist()
    meta = AttentionMetadata.from_lists([n], [seq_len], [table], BLOCK_SIZE)
    scale = head_size**-0.5

    def ours() -> torch.Tensor:
        return cpu_ops().prefill_attention(
            query, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale
        )

    def flash() -> torch.Tensor:
        return _flash_chunk(query, k_cache, v_cache, meta.block_tables[0], seq_len, scale)

    diff = (ours().float() - flash().float()).abs().max().item()
    repeats = max(3, min(30, int(3e9 / (n * seq_len * heads * head_size * 4))))
    ours_ms, flash_ms = median_seconds(ours, repeats) * 1e3, median_seconds(flash, repeats) * 1e3
    flops = 2 * 2 * heads * head_size * (n * cached + n * (n + 1) / 2)
    return (
        f"{n:5d} after {cached:5d} cached {ours_ms:11.2f} {flops / ours_ms / 1e6:8.0f} {flash_ms:9.2f} {diff:9.4f} "
        f"{flash_ms / ours_ms:9.2f}x"
    )


DECODE_CASES = [
    ("1 x 12/4 heads of 128, context 64", [64], 12, 4, 128, 1),
    ("1 x 12/4 heads of 128, context 128", [128], 12, 4, 128, 1),
    ("1 x 12/4 heads of 128, context 512", [512], 12, 4, 128, 1),
    ("64 x 4/2 heads of 64, contexts 16-96", [random.Random(0).randint(16, 96) for _ in range(64)], 4, 2, 64, 1),
    ("64 x 9/3 heads of 64, 50-300, 30 layers", [random.Random(0).randint(50, 300) for _ in range(64)], 9, 3, 64, 30),
]
"""(label, context lengths, query heads, KV heads, head size, layers) of the decode steps timed: with several layers,
each call takes the next layer's cache."""


def decode_row(seq_lens: list[int], heads: int, kv_heads: int, head_size: int, layers: int, dtype: torch.dtype) -> str:
    """Median microseconds a call of one decode step's attention pieces, its contexts in scattered blocks (of a cache
    with room for twice as many), and the rate at which the decode kernel reads them."""
    num_seqs, tables = len(seq_lens), []
    num_blocks = 2 * sum(-(-n // BLOCK_SIZE) for n in seq_lens)
    free = torch.randperm(num_blocks).tolist()
    for n in seq_lens:
        tables.append([free.pop() for _ in range(-(-n // BLOCK_SIZE))])
    caches = [
        tuple(torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_size).to(dtype) for _ in range(2))
        for _ in range(layers)
    ]
    layer = itertools.cycle(caches)
    meta = AttentionMetadata.from_lists([1] * num_seqs, seq_lens, tables, BLOCK_SIZE)
    # Q, K and V as the model has them: views of one fused qkv row per token.
    qkv = torch.randn(num_seqs, (heads + 2 * kv_heads) * head_size).to(dtype)
    q, k, v = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1)
    query, key, value = q.view(num_seqs, heads, head_size), *(t.view(num_seqs, kv_heads, head_size) for t in (k, v))
    positions = torch.tensor(seq_lens) - 1
    cos_sin = build_cos_sin_cache(head_size, max(seq_lens), 10000.0, dtype=dtype)
    scale, dense_query = head_size**-0.5, query.contiguous()
    pieces = {
        "decode_attention": lambda: cpu_ops().decode_attention(
            dense_query, *next(layer), meta.block_tables, meta.seq_lens, scale
        ),
        "rotary + cache": lambda: rotary_embedding_and_cache(
            positions, query, key, value, cos_sin, *next(layer), meta.slot_mapping
        ),
        "attend": lambda: attend(query, key, value, *next(layer), scale, positions, cos_sin),
    }
    with attention_metadata(meta):  # once a step in the runner, not once a layer
        seconds = [median_seconds(fn, 400) for fn in pieces.values()]
    cache_bytes = sum(seq_lens) * 2 * kv_heads * head_size * dtype.itemsize  # keys and values
    return f"{seconds[0] * 1e6:17.1f} {cache_bytes / seconds[0] / 1e9:5.1f} GB/s" + "".join(
        f"{t * 1e6:17.1f}" for t in seconds[1:]
    )


def decode_main(dtype: torch.dtype) -> None:
    """Print :data:`DECODE_CASES`' rows on 1 and 2 threads."""
    print(f"{dtype}, block size {BLOCK_SIZE}, median us a call")
    print(f"{'case':>40s} {'threads':>7s} {'decode_attention':>27s} {'rotary + cache':>17s} {'attend':>17s}")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for label, seq_lens, heads, kv_heads, head_size, layers in DECODE_CASES:
            row = decode_row(seq_lens, heads, kv_heads, head_size, layers, dtype)
            print(f"{label:>40s} {threads:7d} {row}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto: what LLM picks on this CPU (bf16 with AVX-512 bf16)")
    parser.add_argument("--model", default=None, help="whose heads to use (default: the embedded SmolLM2)")
    parser.add_argument("--decode", action="store_true", help="time the decode step's pieces instead")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, "cpu")
    if args.decode:
        decode_main(dtype)
        return
    config = CheckpointConfig.from_dir(resolve_model(args.model))
    heads, kv_heads, head_size = config.num_heads, config.num_kv_heads, config.head_dim
    torch.manual_seed(0)
    num_blocks = max(n + c for n, c in CHUNKS) // BLOCK_SIZE + 64
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_size).to(dtype) for _ in range(2))
    print(f"{dtype}, {heads}/{kv_heads} heads of {head_size}, threads={torch.get_num_threads()}")
    print(f"{'chunk':>22s} {'spindle ms':>11s} {'GFLOP/s':>8s} {'flash ms':>9s} {'max diff':>9s} {'flash/ours':>10s}")
    for n, cached in CHUNKS:
        print(chunk_row(n, cached, torch.randn(n, heads, head_size).to(dtype), k_cache, v_cache), flush=True)


if __name__ == "__main__":
    main()
