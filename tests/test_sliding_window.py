"""Sliding-window attention and logit soft-capping, in every attention path, against a dense float64 reference.

The paths: the torch reference (``--enforce-eager``), the CPU's C++ kernels, and the Triton kernels (compiled on a
GPU, interpreted on CPU tensors otherwise). A token at position ``p`` sees positions ``p - window + 1..p``, as
transformers' ``sliding_window_overlay`` masks them (``kv_idx > q_idx - sliding_window``). The cache blocks wholly
before a sequence's first query's window point at a block of NaNs, as a freed block may: a path that read one would
return NaN.
"""

from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from conftest import TEST_DEVICE

from spindle.kernels import AttentionMetadata, eager, force_triton, paged_attention

NUM_KV_HEADS = 2
NUM_BLOCKS = 160

# Sequences as (cached tokens, new tokens), decodes first: decodes, fresh and cached prefill chunks, short and long
# (several key tiles of every kernel), and contexts that cross the CPU decode kernel's 256-token partitions.
BATCHES = {
    "decodes": [(0, 1), (14, 1), (16, 1), (70, 1), (300, 1), (513, 1)],
    "prefills": [(0, 5), (0, 77)],
    "cached_prefills": [(13, 3), (63, 66), (130, 2)],
    "mixed": [(69, 1), (8, 1), (0, 41), (37, 30), (200, 150)],
    # A short chunk after a long prefix: the CPU prefill kernel splits its keys over the threads and merges them.
    "long_prefix": [(2, 1), (1500, 3)],
}
# Windows of one token (itself), shorter and longer than a block of 16 and a key tile, longer than the CPU prefill
# kernel's 512-key splits, and longer than every context.
WINDOWS = [1, 7, 40, 100, 1200, 4096]
PATHS = ["torch", "cpu", "triton"]
TOLERANCES = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


def on_path(path: str) -> AbstractContextManager[None]:
    """Within the block, CPU tensors go to the named path's kernels."""
    return {"torch": eager(), "cpu": nullcontext(), "triton": force_triton()}[path]


def dense_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    new_lens: list[int],
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Causal attention in float64 over each sequence's whole context, masked to the window, soft-capped."""
    group = query.shape[1] // keys[0].shape[1]
    out = []
    for key, value, q in zip(keys, values, query.split(new_lens), strict=True):
        k = key.double().repeat_interleave(group, dim=1)
        v = value.double().repeat_interleave(group, dim=1)
        distance = torch.arange(key.shape[0] - q.shape[0], key.shape[0])[:, None] - torch.arange(key.shape[0])
        hidden = (distance < 0) | (distance >= (window or key.shape[0]))
        scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out.append(torch.einsum("htl,lhd->thd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v))
    return torch.cat(out)


def check_windowed_attention(
    path: str, batch: str, window: int | None, softcap: float | None, group: int, dtype: torch.dtype
) -> None:
    """Write a batch's contexts into a cache of garbage, free what lies before each window, attend, compare."""
    seqs, block_size, head_size = BATCHES[batch], 16, 64
    generator = torch.Generator().manual_seed(len(seqs) * 100 + (window or 0) + group)
    cache_shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, head_size)
    k_cache = (torch.randn(cache_shape, generator=generator) * 100).to(dtype)
    v_cache = (torch.randn(cache_shape, generator=generator) * 100).to(dtype)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    freed = free.pop()
    k_cache[freed], v_cache[freed] = float("nan"), float("nan")
    keys, values, tables = [], [], []
    for cached, new in seqs:
        keys.append(torch.randn(cached + new, NUM_KV_HEADS, head_size, generator=generator).to(dtype))
        values.append(torch.randn(cached + new, NUM_KV_HEADS, head_size, generator=generator).to(dtype))
        table = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        for p in range(cached + new):
            k_cache[table[p // block_size], p % block_size] = keys[-1][p]
            v_cache[table[p // block_size], p % block_size] = values[-1][p]
        # The blocks no query of this step sees: the block manager may have freed them, and another sequence taken.
        first_seen = cached - window + 1 if window else 0
        tables.append([freed if (i + 1) * block_size <= first_seen else b for i, b in enumerate(table)])
    new_lens = [new for _, new in seqs]
    meta = AttentionMetadata.from_lists(new_lens, [c + n for c, n in seqs], tables, block_size, TEST_DEVICE)
    query = torch.randn(sum(new_lens), NUM_KV_HEADS * group, head_size, generator=generator).to(dtype)
    device = TEST_DEVICE if path == "triton" else "cpu"
    scale = head_size**-0.5

    with on_path(path):
        out = paged_attention(
            query.to(device), k_cache.to(device), v_cache.to(device), to_device(meta, device), scale, window, softcap
        )

    expected = dense_attention(query, keys, values, new_lens, scale, window, softcap)
    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[dtype])


def to_device(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    """The metadata with its tensors on ``device``."""
    tensors = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    return AttentionMetadata(
        **{name: getattr(meta, name).to(device) for name in tensors},
        num_decodes=meta.num_decodes,
        max_seq_len=meta.max_seq_len,
        query_lens_list=meta.query_lens_list,
        seq_lens_list=meta.seq_lens_list,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("path", PATHS)
def test_sliding_window(path: str, batch: str, window: int, group: int, dtype: torch.dtype) -> None:
    check_windowed_attention(path, batch, window, None, group, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("path", PATHS)
def test_softcap(path: str, batch: str, window: int | None, dtype: torch.dtype) -> None:
    """Gemma 2's attention soft-cap of 50 would leave these scores as they are: 1.5 caps the large ones hard."""
    check_windowed_attention(path, batch, window, 1.5, 3, dtype)

