"""The Triton kernels against their torch references (the CPU serving path), on the GPU or under the interpreter.

Without CUDA (or with ``SPINDLE_TEST_DEVICE=cpu``), ``TRITON_INTERPRET=1`` is set before Triton is first imported and
the kernels run on CPU tensors through :func:`spindle.kernels.force_triton`; with CUDA they run compiled, on CUDA
tensors. The references always run on CPU copies of the inputs (:func:`on_cpu`; attention's has no CUDA kernel) and
the results are compared on the CPU (:func:`assert_close`).

Tolerances, against the reference on the same inputs: float32 ``1e-5`` (summation order and fused multiply-adds
differ); bfloat16 and float16 two units in the last place (``2 * 2**-7`` and ``2 * 2**-10`` relative). Those cover
the attention kernels rounding the softmax probabilities to the cache dtype before P @ V (as flash attention does;
the reference keeps them in float32), the rotary kernel rounding once where the reference rounds three times, and
Triton's interpreter truncating when it narrows float32 to bfloat16 (GPUs round to nearest).
"""

import dataclasses
import mmap
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from conftest import TEST_DEVICE as DEVICE

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("without CUDA these tests need TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")

import spindle.kernels  # noqa: E402
import spindle.kernels.triton  # noqa: E402
from spindle.backend.engine_core import EngineCore  # noqa: E402
from spindle.backend.model_runner import DecodeGraphs  # noqa: E402
from spindle.kernels import AttentionMetadata, activation, attention, build_cos_sin_cache, norm, rotary  # noqa: E402
from spindle.kernels.triton import decode_attention, prefill_attention  # noqa: E402
from spindle.shared import SamplingParams, TokenLogprobs  # noqa: E402
from spindle.shared.config import EngineConfig  # noqa: E402
from spindle.shared.protocol import EngineRequest  # noqa: E402

NUM_KV_HEADS = 2
NUM_BLOCKS = 96
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2 * 2**-7, "rtol": 2 * 2**-7},
    torch.float16: {"atol": 2 * 2**-10, "rtol": 2 * 2**-10},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Sequences as (cached tokens, new tokens), decodes first. The lengths are not multiples of anything, so they cross
# cache-block and key-tile boundaries at different offsets for every block size. In "long_contexts" several whole
# key tiles precede a query tile's first token (the prefill kernel's unmasked path) and the queries end in partial
# query tiles at every tile height (128 rows are 128 tokens at group 1, 16 at group 8).
BATCHES = {
    "decodes": [(0, 1), (6, 1), (32, 1), (69, 1), (130, 1)],
    "prefills": [(0, 5), (0, 77)],
    "cached_prefills": [(13, 3), (63, 66), (130, 2)],
    "mixed": [(69, 1), (8, 1), (0, 41), (37, 30)],
    "long_contexts": [(197, 1), (300, 45), (0, 150)],
}


T = TypeVar("T")


def to_cpu(value: T) -> T:
    """``value`` with every tensor in it (in tuples, lists and dataclasses such as the metadata) on the CPU.

    A tensor already there is passed as it is, not copied, so a reference that writes into one writes there.
    """
    if isinstance(value, torch.Tensor):
        return value.cpu()  # type: ignore[return-value]
    if isinstance(value, tuple | list):
        return type(value)(to_cpu(item) for item in value)  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: to_cpu(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)  # type: ignore[return-value]
    return value


def on_cpu(reference: Callable[..., T], *args: Any) -> T:
    """``reference(*args)`` run on CPU copies of the arguments: the references are the CPU serving path's torch code,
    and attention's runs aten's flash attention for the CPU, which has no CUDA kernel."""
    return reference(*to_cpu(args))


def assert_close(actual: object, expected: object, **tolerances: float) -> None:
    """``torch.testing.assert_close`` on the CPU: a kernel's result (on ``DEVICE``) against :func:`on_cpu`'s."""
    torch.testing.assert_close(to_cpu(actual), to_cpu(expected), **tolerances)


@pytest.fixture(autouse=True)
def _triton_on_cpu() -> Iterator[None]:
    """Send the dispatched kernels to Triton even on CPU tensors (CUDA tensors go there anyway)."""
    with spindle.kernels.force_triton():
        yield


def make_batch(
    seqs: list[tuple[int, int]], block_size: int, group: int, head_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's query, a K/V cache holding every sequence's context, and the metadata, on ``DEVICE``.

    The cache is finite garbage outside the contexts (read past a context, it would show) and each sequence's
    blocks are scattered over it.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, head_size)
    k_cache, v_cache = (torch.randn(2, *shape, generator=generator) * 10).to(dtype).unbind(0)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables = [[free.pop() for _ in range(-(-(cached + new) // block_size))] for cached, new in seqs]
    meta = AttentionMetadata.from_lists([n for _, n in seqs], [c + n for c, n in seqs], tables, block_size, DEVICE)
    # Every context slot gets unit-scale K/V; the garbage stays outside the contexts.
    for (cached, new), table in zip(seqs, tables, strict=True):
        for p in range(cached + new):
            k_cache[table[p // block_size], p % block_size] = torch.randn(NUM_KV_HEADS, head_size, generator=generator)
            v_cache[table[p // block_size], p % block_size] = torch.randn(NUM_KV_HEADS, head_size, generator=generator)
    query = torch.randn(sum(n for _, n in seqs), NUM_KV_HEADS * group, head_size, generator=generator).to(dtype)
    return query.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta


def reference_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """The torch reference's attention, on the CPU."""
    return on_cpu(attention.paged_attention, query, k_cache, v_cache, meta, query.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("batch", BATCHES)
def test_paged_attention(batch: str, block_size: int, group: int, dtype: torch.dtype) -> None:
    query, k_cache, v_cache, meta = make_batch(BATCHES[batch], block_size, group, 64, dtype, seed=block_size + group)

    out = spindle.kernels.paged_attention(query, k_cache, v_cache, meta, 64**-0.5)

    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, reference_attention(query, k_cache, v_cache, meta), **TOLERANCES[dtype])


# (batch, GQA group, head size): every head size, and the big heads' tiles (128 rows, 64 keys in 16-bit; 32 rows,
# 16 keys in float32) over long contexts at the groups of Llama-3-8B (4) and -70B (8).
HEAD_SIZE_CASES = [("mixed", 3, head_size) for head_size in (64, 80, 96, 128)]
HEAD_SIZE_CASES += [("long_contexts", 4, 64), ("long_contexts", 4, 128), ("long_contexts", 8, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("batch", "group", "head_size"), HEAD_SIZE_CASES)
def test_paged_attention_head_sizes(batch: str, group: int, head_size: int, dtype: torch.dtype) -> None:
    query, k_cache, v_cache, meta = make_batch(BATCHES[batch], 16, group, head_size, dtype, seed=head_size + group)

    out = spindle.kernels.paged_attention(query, k_cache, v_cache, meta, head_size**-0.5)

    assert_close(out, reference_attention(query, k_cache, v_cache, meta), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_attention_split_context(block_size: int, num_splits: int, dtype: torch.dtype) -> None:
    # 5 splits of 64-key tiles leave the short contexts' last splits empty; the merge must ignore them.
    query, k_cache, v_cache, meta = make_batch(BATCHES["decodes"], block_size, 3, 64, dtype, seed=num_splits)
    out = torch.full_like(query, torch.nan)

    decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 64**-0.5, out, num_splits)

    assert_close(out, reference_attention(query, k_cache, v_cache, meta), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_prefill_kernel_takes_a_whole_mixed_batch(dtype: torch.dtype) -> None:
    query, k_cache, v_cache, meta = make_batch(BATCHES["mixed"], 16, 3, 64, dtype, seed=7)
    out = torch.full_like(query, torch.nan)

    prefill_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, 30, 64**-0.5, out
    )

    assert_close(out, reference_attention(query, k_cache, v_cache, meta), **TOLERANCES[dtype])


def test_reshape_and_cache_matches_reference_and_skips_negative_slots() -> None:
    generator = torch.Generator().manual_seed(0)
    head_size = 80
    # K and V as the model has them: strided views of one fused qkv row per token.
    qkv = torch.randn(6, 3 * NUM_KV_HEADS * head_size, generator=generator).to(DEVICE)
    key, value = (t.view(6, NUM_KV_HEADS, head_size) for t in qkv.split(NUM_KV_HEADS * head_size, dim=-1)[1:])
    slots = torch.tensor([5, 0, -1, 13, 22, -1], device=DEVICE)
    caches = torch.randn(2, 4, 8, NUM_KV_HEADS, head_size, generator=generator).to(DEVICE)
    expected = caches.to("cpu", copy=True)
    valid = slots >= 0

    spindle.kernels.reshape_and_cache(key, value, caches[0], caches[1], slots)

    on_cpu(attention.reshape_and_cache, key[valid], value[valid], expected[0], expected[1], slots[valid])
    assert torch.equal(caches.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual: bool, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 3, 5, 96, generator=generator) * 3).to(dtype).to(DEVICE).unbind(0)
    weight = (torch.rand(96, generator=generator) + 0.5).to(dtype).to(DEVICE)
    args = (x, weight, 1e-5, residual if with_residual else None)

    out, expected = spindle.kernels.rms_norm(*args), on_cpu(norm.rms_norm, *args)

    if with_residual:
        assert_close(out[1], expected[1], **TOLERANCES[dtype])
        out, expected = out[0], expected[0]
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected, **TOLERANCES[dtype])


ROPE_SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_rotary_embedding(scaling: str, dtype: torch.dtype) -> None:
    num_heads, head_size, num_tokens = 6, 64, 9
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator).to(DEVICE)
    # Query and key as the model has them: strided views of one fused qkv row per token.
    qkv = torch.randn(num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_size, generator=generator).to(dtype)
    query, key, _ = qkv.to(DEVICE).split([num_heads * head_size, *[NUM_KV_HEADS * head_size] * 2], dim=-1)
    query, key = query.view(num_tokens, num_heads, head_size), key.view(num_tokens, NUM_KV_HEADS, head_size)
    cache = build_cos_sin_cache(head_size, 4096, 500000.0, ROPE_SCALINGS[scaling], dtype).to(DEVICE)

    ours = spindle.kernels.rotary_embedding(positions, query, key, cache)

    for got, expected in zip(ours, on_cpu(rotary.rotary_embedding, positions, query, key, cache), strict=True):
        assert got.shape == expected.shape
        assert_close(got, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_act_and_mul(dtype: torch.dtype, op: str) -> None:
    x = (torch.randn(5, 3, 2 * 1000, generator=torch.Generator().manual_seed(0)) * 4).to(dtype).to(DEVICE)

    out = getattr(spindle.kernels, op)(x)

    assert out.shape == (5, 3, 1000) and out.dtype == dtype
    assert_close(out, on_cpu(getattr(activation, op), x), **TOLERANCES[dtype])


def test_dispatch_sends_cpu_tensors_to_torch_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(spindle.kernels.triton, "silu_and_mul", lambda x: calls.append(x) or x)
    x = torch.randn(2, 8)

    with spindle.kernels.force_triton(False):
        torch.testing.assert_close(spindle.kernels.silu_and_mul(x), activation.silu_and_mul(x))
    assert calls == []
    spindle.kernels.silu_and_mul(x)
    assert calls == [x]


@pytest.mark.skipif(DEVICE == "cuda", reason="tests/gpu runs the model through the compiled kernels")
@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager", "decode_graphs"])
def test_tiny_llama_greedy_tokens_match_the_torch_path(
    decode_graphs: bool, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine on the Triton kernels against the torch path, both on the CPU.

    With ``decode_graphs`` the decode steps go through the runner's CUDA-graph path, which on the CPU runs the same
    padded static-buffer forward eagerly: 4 requests of different lengths leave decode batches of 3 padded to 4.
    """
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 19, 40, 9)]
    batches: list[tuple[int, int]] = []
    replays: list[int] = []
    triton_attention = spindle.kernels.triton.paged_attention

    def recording_attention(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *options: float | None,
    ) -> torch.Tensor:
        batches.append((meta.num_decodes, len(meta.query_lens_list) - meta.num_decodes))
        return triton_attention(query, k_cache, v_cache, meta, scale, *options)

    def generate(with_graphs: bool) -> dict[str, list[TokenLogprobs]]:
        # A small token budget chunks the longer prompts, so decodes and prefill chunks share steps.
        config = EngineConfig.of(
            model=str(tiny_llama_dir),
            dtype="float32",
            device="cpu",
            block_size=8,
            max_num_batched_tokens=24,
            kv_cache_memory="1MiB",
        )
        core = EngineCore(config)
        if with_graphs:
            graphs = core.runner.decode_graphs = DecodeGraphs(core.runner.model, core.runner.kv_caches, 4, 512, 8)
            replay = graphs.replay
            monkeypatch.setattr(graphs, "replay", lambda step: replays.append(step.input_ids.shape[0]) or replay(step))
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True, logprobs=2)
            core.add_request(EngineRequest(str(i), prompt, params, arrival_time=0.0))
        outputs: dict[str, list[TokenLogprobs]] = {str(i): [] for i in range(len(prompts))}
        while core.has_unfinished_requests():
            for delta in core.step():
                outputs[delta.request_id] += delta.new_logprobs
        return outputs

    with spindle.kernels.force_triton(False):
        expected = generate(with_graphs=False)
    monkeypatch.setattr(spindle.kernels.triton, "paged_attention", recording_attention)
    got = generate(decode_graphs)

    assert any(decodes and prefills for decodes, prefills in batches), "no step mixed decodes and prefill chunks"
    if decode_graphs:
        assert 3 in replays, "no decode batch was padded"
    for ours, theirs in zip(got.values(), expected.values(), strict=True):
        assert [t.token_ids[0] for t in ours] == [t.token_ids[0] for t in theirs]
        torch.testing.assert_close(
            torch.tensor([t.logprobs for t in ours]), torch.tensor([t.logprobs for t in theirs]), atol=1e-5, rtol=1e-5
        )


KERNEL_NAMES = ["_reshape_and_cache_kernel", "_decode_kernel", "_merge_kernel", "_prefill_kernel", "_rotary_kernel"]
KERNEL_NAMES += ["_rms_norm_kernel", "_act_and_mul_kernel", "_quant_linear_kernel", "_split_k_reduce_kernel"]
KERNEL_NAMES += ["_lora_shrink_kernel", "_lora_expand_kernel"]

# compile_check's runs, one chain per architecture, the two side by side (about two minutes on two cores): every dtype
# with head sizes 64 and 128 (both weight bit widths come with every dtype), GQA groups 1 and 8 in bf16 (the group is
# a constant of the same tiles: fp32, whose tiles take the most shared memory, and fp16 compile group 1 only), then
# head size 80 (padded to a 128-wide tile) with group 3 (no power of two) in bf16. The runs share a Triton cache: a
# later run of a chain finds the kernels that head size and group do not change (norms, activations, GEMMs, LoRA)
# compiled by an earlier one, where a third process beside them compiled them again.
COMPILE_CHECK_RUNS = {
    arch: [
        ["--arch", arch[3:], "--dtype", "float32", "--dtype", "float16", "--head-size", "64", "--head-size", "128"]
        + ["--group", "1"],
        ["--arch", arch[3:], "--dtype", "bfloat16", "--head-size", "64", "--head-size", "128", "--group", "1"]
        + ["--group", "8"],
        ["--arch", arch[3:], "--head-size", "80", "--group", "3", "--dtype", "bfloat16"],
    ]
    for arch in ("sm_80", "sm_90")
}
GROUPS = {"float32": ("1",), "float16": ("1",), "bfloat16": ("1", "8")}

# Shared memory per block: consumer Ampere/Ada GPUs (sm_86/sm_89: 99 KiB) compile to sm_80's layouts; sm_90 is
# H100/H200 (227 KiB).
MAX_SHARED_KIB = {"sm_80": 99, "sm_90": 227}


def compiled_variants(stdout: str) -> list[dict[str, object]]:
    """compile_check's lines as dicts: ``arch``, ``dtype``, ``kernel``, ``shared_kib`` and compile-time constants."""
    variants = []
    for line in stdout.splitlines():
        arch, dtype, kernel, *_ = line.split()
        shared_kib = float(re.search(r"([\d.]+) KiB shared", line)[1])
        constants = dict(re.findall(r"(\w+)=(\S+)", line))
        variants.append({"arch": arch, "dtype": dtype, "kernel": kernel, "shared_kib": shared_kib, **constants})
    return variants


@pytest.mark.timeout(900)  # ~80 s on a quiet 2-core machine, 150-250 s on a loaded one: every variant is compiled
def test_every_kernel_compiles_for_sm80_and_sm90(tmp_path: Path) -> None:
    # The interpreter accepts what the GPU compiler may refuse; this compiles down to a cubin with Triton's ptxas.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}

    def run_chain(arch: str) -> str:
        """The chain's runs one after the other; their output lines."""
        lines = ""
        for index, args in enumerate(COMPILE_CHECK_RUNS[arch]):
            command = [sys.executable, "-m", "spindle.kernels.triton.compile_check", *args]
            run = subprocess.run(command, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True)
            assert run.returncode == 0, f"{arch} run {index}: {run.stderr[-4000:]}"
            lines += run.stdout
        return lines

    with ThreadPoolExecutor(len(COMPILE_CHECK_RUNS)) as pool:
        outputs = list(pool.map(run_chain, COMPILE_CHECK_RUNS))
    variants = [v for stdout in outputs for v in compiled_variants(stdout)]
    archs, dtypes = MAX_SHARED_KIB, ["float32", "bfloat16", "float16"]
    kernels = {(v["arch"], v["dtype"], v["kernel"]) for v in variants}
    assert kernels == {(arch, dtype, name) for arch in archs for dtype in dtypes for name in KERNEL_NAMES}
    prefills = {
        (v["arch"], v["dtype"], v["HEAD_SIZE"], v["GROUP"]) for v in variants if v["kernel"] == "_prefill_kernel"
    }
    expected = {(arch, dtype, h, g) for arch in archs for dtype in dtypes for h in ("64", "128") for g in GROUPS[dtype]}
    assert prefills == expected | {(arch, "bfloat16", "80", "3") for arch in archs}
    assert [v for v in variants if v["shared_kib"] > MAX_SHARED_KIB[v["arch"]]] == []


# (bits, out_features, in_features, group_size, offsets): neither dimension a multiple of the tiles where the layout
# allows it (int8 K = 208 leaves a masked 16-input tail), int4 with the smallest group and with groups that span K
# steps, int8 by GGUF Q6_K's groups of 16 and with Q5_K's offsets per group of 32.
QUANT_WEIGHTS = {
    "int8-72x96": (8, 72, 96, 96, False),
    "int8-24x208": (8, 24, 208, 208, False),
    "int4-g32-72x96": (4, 72, 96, 32, True),
    "int4-g64-40x128": (4, 40, 128, 64, True),
    "int8-g16-72x96": (8, 72, 96, 16, False),
    "int8-g32-offsets-40x128": (8, 40, 128, 32, True),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("num_rows", [1, 5, 33])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("weight_case", QUANT_WEIGHTS)
def test_quantized_linear(weight_case: str, dtype: torch.dtype, num_rows: int, with_bias: bool) -> None:
    weight = _quantized_weight(*QUANT_WEIGHTS[weight_case])
    out_features, in_features = weight.shape
    generator = torch.Generator().manual_seed(num_rows)
    # 33 rows as [3, 11, in]: leading dimensions flatten into rows.
    shape = (3, 11, in_features) if num_rows == 33 else (num_rows, in_features)
    x = torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)
    bias = torch.randn(out_features, generator=generator).to(DEVICE) if with_bias else None
    weight = weight.to(DEVICE)

    out = spindle.kernels.triton.quantized_linear(x, weight, bias)

    expected = on_cpu(spindle.kernels.quant.quantized_linear, x, weight, bias)
    assert out.dtype == dtype and out.shape == (*shape[:-1], out_features)
    # The kernel rounds dequantized int4 weights to the activation dtype for the dot (the reference keeps them in
    # float32), and near-zero outputs are sums of large terms: the absolute tolerance scales with the output.
    unit = 1e-5 if dtype == torch.float32 else 2 * 2**-7
    assert_close(out, expected, atol=unit * expected.float().abs().max().item(), rtol=unit)


FAR_ROW_STRIDE = 2**30 + 2**20
"""Elements between the rows of the ``far_rows`` views: the third row starts past 2**31 elements, where a row offset
computed in int32 wraps."""


@pytest.fixture
def far_rows(tmp_path: Path) -> Callable[[int], torch.Tensor]:
    """A maker of ``[3, width]`` bfloat16 views of random values, their rows :data:`FAR_ROW_STRIDE` elements apart.

    The views (2048 columns in all) share one 8 GiB buffer, on the CPU a sparse file mapped into memory: only the
    pages written take memory or disk. They start 2**31 elements in, so that an offset that wrapped to a negative
    int32 still reads inside the buffer (zeros: a wrong result) instead of crashing the process.
    """
    numel = 2**31 + 2 * FAR_ROW_STRIDE + 2048
    if DEVICE == "cuda":
        buffer = torch.empty(numel, dtype=torch.bfloat16, device=DEVICE)
    else:
        with (tmp_path / "far_rows").open("w+b") as file:
            file.truncate(2 * numel)
            buffer = torch.frombuffer(mmap.mmap(file.fileno(), 2 * numel), dtype=torch.bfloat16)
    rows = buffer[2**31 :].as_strided((3, 2048), (FAR_ROW_STRIDE, 1))
    generator = torch.Generator().manual_seed(0)
    used = 0

    def take(width: int) -> torch.Tensor:
        nonlocal used
        view = rows[:, used : used + width]
        used += width
        return view.copy_(torch.randn(3, width, generator=generator))

    return take


def _far_attention(
    take: Callable[[int], torch.Tensor], seqs: list[tuple[int, int]], num_splits: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes (in ``num_splits`` slices) or one prefill: the query read from far rows, the output written to them."""
    query, k_cache, v_cache, meta = make_batch(seqs, 16, 2, 64, torch.bfloat16, seed=0)
    far_query, out = (take(query[0].numel()).view(query.shape) for _ in range(2))
    far_query.copy_(query)
    if meta.num_decodes:
        decode_attention(far_query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 64**-0.5, out, num_splits)
    else:
        tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
        prefill_attention(far_query, k_cache, v_cache, tables, lens, starts, query.shape[0], 64**-0.5, out)
    return out, reference_attention(query, k_cache, v_cache, meta)


def _far_rotary(take: Callable[[int], torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
    query, key = take(4 * 64).view(3, 4, 64), take(NUM_KV_HEADS * 64).view(3, NUM_KV_HEADS, 64)
    positions = torch.tensor([3, 70, 511], device=DEVICE)
    cache = build_cos_sin_cache(64, 512, 10000.0, None, torch.bfloat16).to(DEVICE)
    args = (positions, query, key, cache)
    return spindle.kernels.rotary_embedding(*args), on_cpu(rotary.rotary_embedding, *args)


def _far_reshape_and_cache(take: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = (take(NUM_KV_HEADS * 64).view(3, NUM_KV_HEADS, 64) for _ in range(2))
    slots = torch.tensor([5, 17, 30], device=DEVICE)
    ours, expected = torch.zeros(2, 2, 2, 16, NUM_KV_HEADS, 64, dtype=torch.bfloat16, device=DEVICE).unbind(0)
    spindle.kernels.reshape_and_cache(key, value, ours[0], ours[1], slots)
    expected = expected.cpu()
    on_cpu(attention.reshape_and_cache, key, value, expected[0], expected[1], slots)
    return ours, expected


def _far_quantized_linear(take: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    dense = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    weight, x = spindle.kernels.quant.quantize(dense, 8, 64).to(DEVICE), take(64)
    return spindle.kernels.triton.quantized_linear(x, weight), on_cpu(spindle.kernels.quant.quantized_linear, x, weight)


def _far_silu_and_mul(take: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x = take(2 * 96)
    return spindle.kernels.silu_and_mul(x), on_cpu(activation.silu_and_mul, x)


def _far_rms_norm(take: Callable[[int], torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
    x, residual = take(96), take(96)
    weight = torch.linspace(0.5, 1.5, 96, device=DEVICE).to(torch.bfloat16)
    return spindle.kernels.rms_norm(x, weight, 1e-5, residual), on_cpu(norm.rms_norm, x, weight, 1e-5, residual)


# Each takes its inputs (and, for attention, its output) from far rows and returns (Triton's, the reference's). Split
# decodes write their output from the merge kernel.
FAR_ROW_CASES: dict[str, Callable[[Callable[[int], torch.Tensor]], tuple[object, object]]] = {
    "decode_attention": lambda take: _far_attention(take, [(20, 1), (9, 1), (140, 1)]),
    "decode_attention_split": lambda take: _far_attention(take, [(20, 1), (9, 1), (140, 1)], num_splits=2),
    "prefill_attention": lambda take: _far_attention(take, [(20, 3)]),
    "rotary_embedding": _far_rotary,
    "reshape_and_cache": _far_reshape_and_cache,
    "quantized_linear": _far_quantized_linear,
    "rms_norm": _far_rms_norm,
    "silu_and_mul": _far_silu_and_mul,
}


@pytest.mark.parametrize("kernel", FAR_ROW_CASES)
def test_rows_past_2_31_elements(kernel: str, far_rows: Callable[[int], torch.Tensor]) -> None:
    """Row offsets (row x stride) are int64: a row that starts past 2**31 elements is read and written there."""
    ours, expected = FAR_ROW_CASES[kernel](far_rows)

    assert_close(ours, expected, **TOLERANCES[torch.bfloat16])


JIT_STALL_CHECK = """
import random, sys, torch
from spindle.kernels.triton import compile_check
from spindle.kernels.triton.decode_attention import SPLIT_COUNTS, decode_attention, num_splits_for, warm_up
sys.modules["spindle.kernels.triton.decode_attention"]._multiprocessors = lambda device: 132  # an H200's SMs
from spindle.kernels.triton.prefill_attention import prefill_attention

heads, kv_heads, head_size, block = 8, 2, 64, 16
cache = torch.zeros(2, 4096, block, kv_heads, head_size, dtype=torch.bfloat16)
query = torch.zeros(512, heads, head_size, dtype=torch.bfloat16)
warmed, served = set(), set()

compile_check.record_only(warmed)  # what the runner's start-up compiles: every split count, and one prefill step
for count in SPLIT_COUNTS:
    warm_up(query[:1], cache[0], cache[1], count)
tables = torch.zeros(2, 1, dtype=torch.int32)
lens = torch.tensor([1, 5], dtype=torch.int32)
prefill_attention(query, cache[0], cache[1], tables, lens, torch.tensor([0, 1, 5], dtype=torch.int32), 4, 0.1, query, 1)

compile_check.record_only(served)  # a varied workload: batch sizes, contexts, table widths, decodes before prefills
rng = random.Random(0)
for _ in range(200):
    num_decodes, num_prefills = rng.randint(0, 40), rng.randint(0, 3)
    seq_lens = [rng.randint(1, 30000) for _ in range(num_decodes + num_prefills)]
    width = max(-(-n // block) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    if num_decodes:
        splits = num_splits_for(num_decodes, kv_heads, max(seq_lens[:num_decodes]), torch.device("cuda"))
        out = query[:num_decodes]
        decode_attention(query[:num_decodes], cache[0], cache[1], tables, lens, 0.1, out, splits)
    if num_prefills:
        starts = torch.tensor([0] * (num_decodes + 1) + [rng.randint(1, 100)] * num_prefills).cumsum(0)
        prefill_attention(query, cache[0], cache[1], tables, lens, starts.int(), 100, 0.1, query, num_decodes)
new = served - warmed
print(len(warmed), len(served), len(new))
assert not new, new
"""


def test_a_varied_workload_compiles_nothing_after_warm_up() -> None:
    """Every Triton variant a varied workload launches was compiled by the start-up warm-up: no stall mid-request.

    Run without the interpreter, with launches recorded instead of compiled (``compile_check.record_only``): the
    decode kernel's split counts come from a small set, and the integers that change from step to step (the first
    prefill's index, the block tables' width) are not specialised on.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", JIT_STALL_CHECK], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


Launch = tuple[str, tuple[int, ...], dict[str, object]]
"""A recorded Triton launch: the kernel's name, its grid and its compile-time constants."""


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """Every Triton kernel launch from here to the test's end, appended as it happens (compiled or interpreted)."""
    recorded: list[Launch] = []
    launcher = type(spindle.kernels.triton.rotary._rotary_kernel)  # JITFunction, or the interpreter's stand-in
    run = launcher.run

    def recording_run(self: object, *args: object, grid: tuple[int, ...], **kwargs: object) -> object:
        constants = {name: value for name, value in kwargs.items() if name.isupper()}
        recorded.append((self.fn.__name__, grid, constants))  # type: ignore[attr-defined]
        return run(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(launcher, "run", recording_run)
    return recorded


# (bits, out_features, in_features, group_size, bias): decode-sized shapes that split K on any device (the CPU counts
# as one SM). int8 per row with K = 1000: splits of 512 inputs, the last one short and ending in a masked K step;
# int4 with 4 groups per K step (32) and with 2 K steps per group (256, 4 splits in float32); int8 by groups of 32
# (GGUF's Q8_0: scales per group, no zero points) and of 16 (Q6_K).
SPLIT_K_WEIGHTS = {
    "int8-72x1000-bias": (8, 72, 1000, 1000, True),
    "int4-g32-96x1024-bias": (4, 96, 1024, 32, True),
    "int4-g256-40x1024": (4, 40, 1024, 256, False),
    "int8-g32-64x1024": (8, 64, 1024, 32, False),
    "int8-g16-64x1024": (8, 64, 1024, 16, False),
}


def _quantized_weight(
    bits: int, out_features: int, in_features: int, group_size: int, offsets: bool = False
) -> spindle.kernels.quant.QuantizedWeight:
    """A random weight in the layout given; int8 by groups is quantized row by row over each group's inputs, and
    given random offsets per group with ``offsets`` (int4 always has them)."""
    generator = torch.Generator().manual_seed(in_features)
    dense = torch.randn(out_features, in_features, generator=generator)
    if bits == 4 or group_size == in_features:
        return spindle.kernels.quant.quantize(dense, bits, group_size)
    per_group = spindle.kernels.quant.quantize(dense.view(-1, group_size), 8)
    qweight, scales = per_group.qweight.view(out_features, in_features), per_group.scales.view(out_features, -1)
    zeros = torch.randn(scales.shape, generator=generator) if offsets else None
    return spindle.kernels.quant.QuantizedWeight(qweight, scales, zeros, group_size)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("weight_case", SPLIT_K_WEIGHTS)
def test_decode_sized_quantized_linear_splits_k_in_one_variant(
    weight_case: str, dtype: torch.dtype, launches: list[Launch]
) -> None:
    """1 to 16 tokens: K split over programs, summed by the reduction in a fixed order; one compile for all of them."""
    bits, out_features, in_features, group_size, with_bias = SPLIT_K_WEIGHTS[weight_case]
    weight = _quantized_weight(bits, out_features, in_features, group_size).to(DEVICE)
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=generator).to(DEVICE) if with_bias else None
    unit = 1e-5 if dtype == torch.float32 else 2 * 2**-7

    for num_rows in range(1, 17):
        x = torch.randn(num_rows, in_features, generator=generator).to(dtype).to(DEVICE)
        out = spindle.kernels.triton.quantized_linear(x, weight, bias)
        expected = on_cpu(spindle.kernels.quant.quantized_linear, x, weight, bias)
        assert_close(out, expected, atol=unit * expected.float().abs().max().item(), rtol=unit)
    assert torch.equal(spindle.kernels.triton.quantized_linear(x, weight, bias), out), "not deterministic"

    products = [(grid, constants) for name, grid, constants in launches if name == "_quant_linear_kernel"]
    assert all(len(grid) == 3 and grid[2] > 1 and constants["SPLIT_K"] for grid, constants in products)
    assert len({repr(constants) for _, constants in products}) == 1
    assert [name for name, *_ in launches].count("_split_k_reduce_kernel") == len(products)


LLAMA_3_8B_PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.parametrize("projection", LLAMA_3_8B_PROJECTIONS)
def test_split_k_gives_an_h200_two_waves_of_decode_programs(projection: str) -> None:
    """Llama-3-8B's decode projections launch at least 2 programs per SM of an H200 (132), splits tiling K exactly."""
    ql = spindle.kernels.triton.quant_linear
    out_features, in_features = LLAMA_3_8B_PROJECTIONS[projection]
    column_tiles = -(-out_features // ql.DECODE_BLOCK_N)

    splits, inputs_per_split = ql.split_k(column_tiles, in_features, ql.DECODE_BLOCK_K, 132)

    assert column_tiles * splits >= 2 * 132
    assert inputs_per_split % ql.DECODE_BLOCK_K == 0
    assert (splits - 1) * inputs_per_split < in_features <= splits * inputs_per_split
    assert inputs_per_split >= ql.MIN_STEPS_PER_SPLIT * ql.DECODE_BLOCK_K


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rotary_embedding_and_cache_matches_rotary_then_cache_write(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    head_size, num_heads, tokens = 80, 3 * NUM_KV_HEADS, 6
    # Q, K and V as the model has them: strided views of one fused qkv row per token.
    qkv = torch.randn(tokens, (num_heads + 2 * NUM_KV_HEADS) * head_size, generator=generator).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_size, NUM_KV_HEADS * head_size, NUM_KV_HEADS * head_size], dim=-1)
    query, key, value = q.view(tokens, num_heads, head_size), *(t.view(tokens, NUM_KV_HEADS, head_size) for t in (k, v))
    positions = torch.tensor([3, 0, 7, 40, 41, 2], device=DEVICE)
    slots = torch.tensor([5, 0, -1, 13, 22, -1], device=DEVICE)
    cos_sin = build_cos_sin_cache(head_size, 64, 10000.0, dtype=dtype).to(DEVICE)
    caches = torch.randn(2, 4, 8, NUM_KV_HEADS, head_size, generator=generator).to(dtype).to(DEVICE)
    expected = caches.to("cpu", copy=True)
    valid = (slots >= 0).cpu()

    got = spindle.kernels.rotary_embedding_and_cache(positions, query, key, value, cos_sin, *caches, slots)

    rotated = on_cpu(rotary.rotary_embedding, positions, query, key, cos_sin)
    on_cpu(attention.reshape_and_cache, rotated[1][valid], value.cpu()[valid], *expected, slots.cpu()[valid])
    assert_close(got, rotated[0], **TOLERANCES[dtype])
    assert_close(caches, expected, **TOLERANCES[dtype])
    assert torch.equal(caches[1].cpu(), expected[1]), "values are copied, not rounded"


@pytest.mark.skipif(DEVICE == "cuda", reason="counts launches of the CPU engine under the interpreter")
def test_a_mixed_step_launches_six_triton_kernels_per_layer(tiny_llama_dir: Path, launches: list[Launch]) -> None:
    """A step with a decode and a prefill chunk: the norms, rotary with the cache write, attention (decode and prefill
    kernels), SiLU-and-mul. The projections of this unquantized model are the CPU's (cuBLAS' on a GPU)."""
    # A small token budget keeps the start-up's profiling step short under the interpreter.
    config = EngineConfig.of(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_batched_tokens=32, kv_cache_memory="1MiB"
    )
    core = EngineCore(config)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineRequest("decode", list(range(3, 10)), params, arrival_time=0.0))
    core.step()  # its prefill: the next step decodes it
    core.add_request(EngineRequest("prefill", list(range(3, 30)), params, arrival_time=0.0))
    steps: list[AttentionMetadata] = []
    bounds: list[int] = []  # the launches before and after the first layer
    model = core.runner.model
    model.register_forward_pre_hook(lambda _, args: steps.append(args[2]))
    model.layers[0].register_forward_pre_hook(lambda *_: bounds.append(len(launches)))
    model.layers[0].register_forward_hook(lambda *_: bounds.append(len(launches)))

    core.step()

    assert [(meta.num_decodes, len(meta.query_lens_list)) for meta in steps] == [(1, 2)]
    start, end = bounds
    assert [name for name, *_ in launches[start:end]] == [
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_decode_kernel",
        "_prefill_kernel",
        "_rms_norm_kernel",
        "_act_and_mul_kernel",
    ]
