"""The CPU prefill-attention kernel against torch's flash attention, one layer of the embedded model's heads.

Each row is a prefill chunk of ``n`` tokens after ``c`` cached ones, its context in a paged cache whose blocks lie
anywhere (as they do in serving): Spindle's kernel (``spindle.kernels.cpu``'s ``prefill_attention``, which reads the
context in place) against the gather of that context plus torch's flash attention (``_flash_chunk``: the chunk's own
keys causally, the cached prefix unmasked, merged; what float32 chunks of 64+ tokens after 1,024 run). Prints the
medians (ms a layer), Spindle's rate over the causal part of the score matrix (two matmuls, 2 FLOPs a multiply-add),
the two outputs' largest difference, and flash's time over ours::

    .venv/bin/python -m bench.cpu_attention --dtype bfloat16
"""

import argparse

import torch

from bench.flops import median_seconds
from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.loader import resolve_dtype, resolve_model
from spindle.kernels import AttentionMetadata
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto: what LLM picks on this CPU (bf16 with AVX-512 bf16)")
    parser.add_argument("--model", default=None, help="whose heads to use (default: the embedded SmolLM2)")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, "cpu")
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
