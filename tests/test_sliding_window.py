"""Sliding-window attention and logit soft-capping, in every attention path, against a dense float64 reference.

The paths: the torch reference (``--enforce-eager``), the CPU's C++ kernels, and the Triton kernels (compiled on a
GPU, interpreted on CPU tensors otherwise). A token at position ``p`` sees positions ``p - window + 1..p``, as
transformers' ``sliding_window_overlay`` masks them (``kv_idx > q_idx - sliding_window``). The cache blocks wholly
before a sequence's first query's window point at a block of NaNs, as a freed block may: a path that read one would
return NaN.
"""

import random
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import torch
from conftest import TEST_DEVICE, _with_byte_tokenizer

from spindle import LLM, LLMEngine, SamplingParams
from spindle.backend.models.checkpoint_config import _layer_windows
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
    path: str, seqs: list[tuple[int, int]], window: int | None, softcap: float | None, group: int, dtype: torch.dtype
) -> None:
    """Write a batch's contexts into a cache of garbage, free what lies before each window, attend, compare."""
    block_size, head_size = 16, 64
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
    check_windowed_attention(path, BATCHES[batch], window, None, group, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("path", PATHS)
def test_softcap(path: str, batch: str, window: int | None, dtype: torch.dtype) -> None:
    """Gemma 2's attention soft-cap of 50 would leave these scores as they are: 1.5 caps the large ones hard."""
    check_windowed_attention(path, BATCHES[batch], window, 1.5, 3, dtype)


LONG_DECODES = [(999, 1), (699, 1), (499, 1), (39, 1)]
"""Decodes with work enough (16 heads) for the CPU decode kernel to split them over two threads, in 256-token parts
merged after, except under the 40-token window; on one thread each context is walked whole, in 256-token chunks whose
softmax states it folds as it goes."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (600, None), (40, None), (None, 1.5), (600, 1.5)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_decode_attention_on_one_thread_and_split(
    threads: int, window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_windowed_attention("cpu", LONG_DECODES, window, softcap, 8, dtype)
    finally:
        torch.set_num_threads(previous)


# Each family's rule, as transformers' own config class applies it (its layer_types, or every layer where it has none).
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "mistral_unwindowed": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 3}),
    "qwen2_unwindowed": ("Qwen2Config", "Qwen2ForCausalLM", {"max_window_layers": 3}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": True, "max_window_layers": 5}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
}


@pytest.mark.parametrize("listed", [True, False], ids=["layer_types", "family_rule"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_windows_follow_transformers(family: str, listed: bool) -> None:
    """From a config that lists ``layer_types`` (transformers v5 writes them) and from one without (older ones)."""
    import transformers

    config_class, architecture, extra = FAMILIES[family]
    hf = getattr(transformers, config_class)(**{"num_hidden_layers": 8, "sliding_window": 16, **extra})
    kinds = getattr(hf, "layer_types", None) or ["sliding_attention"] * 8
    config = hf.to_dict()
    if not listed:
        config.pop("layer_types", None)

    windows = _layer_windows(config, architecture)

    assert windows == [hf.sliding_window if kind == "sliding_attention" else None for kind in kinds]
    assert any(windows) == (not family.endswith("_unwindowed"))


MAX_TOKENS = 24
# Prompts shorter than, as long as and longer than the window of 24; every generation goes past it.
PROMPT_LENGTHS = [5, 23, 24, 25, 40, 70]


@pytest.fixture(scope="module")
def mistral_dir(make_tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Mistral (``sliding_window=24``, 512 positions) with the byte-level tokenizer."""
    return _with_byte_tokenizer(make_tiny_model("mistral_window"), tmp_path_factory.mktemp("tiny-mistral"))


@pytest.fixture(scope="module")
def mistral_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def mistral_expected(mistral_dir: Path, mistral_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, its eager attention masking the window."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for ids in mistral_prompts:
        tokens = model.eval().generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
        out.append(tokens[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("budget", [512, 8], ids=["one_batch", "chunked_prefill"])
@pytest.mark.parametrize("path", PATHS)
def test_mistral_greedy_tokens_match_transformers_past_the_window(
    mistral_dir: Path,
    mistral_prompts: list[list[int]],
    mistral_expected: list[list[int]],
    budget: int,
    path: str,
) -> None:
    """The context is the model's 512 positions, not the window: prompts and generations run past it."""
    llm = LLM(
        str(mistral_dir),
        dtype="float32",
        kv_cache_memory="4MiB",
        block_size=8,
        max_num_batched_tokens=budget,
        enforce_eager=path == "torch",
        device=TEST_DEVICE if path == "triton" else "cpu",
    )
    assert llm.llm_engine.engine_core.max_model_len == 512

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    with on_path(path):
        outputs = llm.generate([{"prompt_token_ids": p} for p in mistral_prompts], params, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outputs] == mistral_expected


LONG_TOKENS = 120


@pytest.fixture(scope="module")
def long_expected(mistral_dir: Path, mistral_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for :data:`LONG_TOKENS` new tokens, each prompt 40 tokens long."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, attn_implementation="eager")
    prompts = torch.tensor([p[:40] for p in mistral_prompts[-2:]] * 4)
    tokens = model.eval().generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=LONG_TOKENS,
        min_new_tokens=LONG_TOKENS,
        do_sample=False,
    )
    return tokens[:, 40:].tolist()


@pytest.mark.parametrize("speculative", [0, 4], ids=["plain", "ngram4"])
def test_mistral_releases_the_blocks_outside_its_window(
    mistral_dir: Path, mistral_prompts: list[list[int]], long_expected: list[list[int]], speculative: int
) -> None:
    """Eight 160-token sequences would need 20 blocks of 8 each, 160 of a 72-block cache: holding only the blocks
    of their window (at most ceil(24 / 8) + 1 each in a decode step, one more for up to 4 drafts), they all run at
    once, none preempted. With n-gram speculation the rejected drafts' blocks are trimmed after the release."""
    engine = LLMEngine.from_args(
        model=str(mistral_dir),
        dtype="float32",
        kv_cache_memory=72 * 4096,
        block_size=8,
        max_num_batched_tokens=64,
        adaptive_drafts=False,
    )
    core = engine.engine_core
    assert core.num_blocks == 72 and core.block_manager.sliding_window == 24
    params = SamplingParams(
        temperature=0, max_tokens=LONG_TOKENS, min_tokens=LONG_TOKENS, num_speculative_tokens=speculative
    )
    for i, prompt in enumerate([p[:40] for p in mistral_prompts[-2:]] * 4):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        for seq in core.scheduler.running:
            if len(seq) > seq.num_prompt_tokens + 1:  # its last step was a decode's
                released = core.block_manager.released.get(seq.seq_id, (0, None))[0]
                assert len(seq.block_table) - released <= 4 + bool(speculative)

    assert [finished[str(i)] for i in range(8)] == long_expected
    assert core.scheduler.num_preemptions == 0
    assert (core.stats().num_accepted_draft_tokens > 0) == bool(speculative)
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.block_manager.released
