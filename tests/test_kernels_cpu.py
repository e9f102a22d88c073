"""The torch (CPU) kernels against plain dense references and transformers' own Llama pieces."""

import math

import pytest
import torch
import torch.nn.functional as F
from gil_probe import lets_other_threads_run
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from spindle.kernels import (
    AttentionMetadata,
    argmax,
    attend,
    attention,
    attention_metadata,
    build_cos_sin_cache,
    cpu,
    eager,
    gelu_tanh_and_mul,
    paged_attention,
    quant,
    reshape_and_cache,
    rms_norm,
    rotary,
    rotary_embedding,
    rotary_embedding_and_cache,
    silu_and_mul,
)
from spindle.kernels import linear as linear_module
from spindle.kernels.linear import MAX_QUANTIZED_TOKENS, Projection, linear, quantized_embedding, weight_only

NUM_KV_HEADS = 2
HEAD_SIZE = 64
NUM_BLOCKS = 512

# Sequences as (cached tokens, new tokens), in multiples of the block size `b` so that they cross block boundaries.
BATCHES = {
    "decodes": lambda b: [(0, 1), (b - 2, 1), (b - 1, 1), (b, 1), (3 * b + 4, 1)],
    "prefills": lambda b: [(0, 5), (0, b), (0, 2 * b + 3)],
    "cached_prefills": lambda b: [(b, 3), (b - 1, b + 2), (2 * b + 1, 2)],
    "mixed": lambda b: [(b + 4, 1), (2 * b - 1, 1), (0, b + 5), (b + 2, 2 * b + 3)],
    # The CPU prefill kernel walks keys in tiles of 32 for tiles of 16-64 query positions: chunks that span several.
    "long_chunks": lambda b: [(0, 150), (300, 70), (5 * b + 1, 33)],
    # A short chunk after a long prefix: too few tiles for the threads, so its keys split and the partials merge.
    "split_keys": lambda b: [(2 * b, 1), (1500, 3)],
    # Sequences past 1,024 tokens (a fresh chunk, and one after a cached prefix) beside a decode and a short chunk.
    "long_sequences": lambda b: [(b + 1, 1), (0, 1030), (2 * b, 5), (960, 64)],
    # A long chunk after a long prefix: the CPU kernel's bf16 walk (AVX-512 bf16) over many tiles of both kinds.
    "long_chunk_after_prefix": lambda b: [(b + 1, 1), (1300, 800)],
    # The CPU decode kernel splits contexts into 256-token partitions and merges them: cross and meet those edges.
    "skewed_decodes": lambda b: [(40 * b + 3, 1), (2, 1), (255, 1), (256, 1), (0, 1), (511, 1)],
    # Enough decodes that the CPU decode kernel hands each thread a sequence's part with all its KV heads at a time.
    "many_decodes": lambda b: [(b * (i % 7) + i, 1) for i in range(20)] + [(300, 1), (2 * 256 + 9, 1)],
}

# Against a float64 reference on the same inputs. bf16 rounds the output to 8 bits of mantissa (values are O(1)).
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 8e-3, "rtol": 8e-3}}


def naive_attention(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], new_lens: list[int], scale: float
) -> torch.Tensor:
    """Dense causal attention in float64: ``keys[s]``/``values[s]`` hold sequence s's whole context, whose last
    ``new_lens[s]`` positions are the queries'."""
    group = query.shape[1] // keys[0].shape[1]
    out = []
    for key, value, q in zip(keys, values, query.split(new_lens), strict=True):
        k = key.double().repeat_interleave(group, dim=1)
        v = value.double().repeat_interleave(group, dim=1)
        positions = torch.arange(key.shape[0] - q.shape[0], key.shape[0])
        future = torch.arange(key.shape[0])[None, :] > positions[:, None]  # [new, context]
        scores = torch.einsum("thd,lhd->htl", q.double(), k) * scale
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out.append(torch.einsum("htl,lhd->thd", probs, v))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize(
    ("batch", "block_size", "head_size"),
    # Blocks larger than the CPU decode kernel's 256-token partitions make each partition one block. The CPU kernels
    # have compiled-in head sizes (64, 128: the bf16 walks take both) and a run-time one (20: two 8-float vectors and
    # a scalar rest).
    [(batch, block_size, HEAD_SIZE) for batch in BATCHES for block_size in (8, 16, 32)]
    + [("skewed_decodes", 512, HEAD_SIZE), ("decodes", 16, 128), ("long_chunks", 16, 128)]
    + [("skewed_decodes", 16, 20), ("mixed", 16, 20)],
)
def test_paged_attention_matches_dense(
    batch: str, block_size: int, head_size: int, group: int, dtype: torch.dtype
) -> None:
    check_paged_attention(batch, block_size, head_size, group, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", BATCHES)
def test_eager_paged_attention_matches_dense(batch: str, dtype: torch.dtype) -> None:
    """The torch reference, ``--enforce-eager``'s path: each context gathered, torch's flash attention."""
    with eager():
        check_paged_attention(batch, 16, HEAD_SIZE, 3, dtype)


def check_paged_attention(batch: str, block_size: int, head_size: int, group: int, dtype: torch.dtype) -> None:
    """Write a batch's contexts into a cache of garbage, attend, and compare with :func:`naive_attention`."""
    generator = torch.Generator().manual_seed(block_size * 10 + group)
    seqs = sorted(BATCHES[batch](block_size), key=lambda s: s[1] != 1)  # decodes first
    num_heads = NUM_KV_HEADS * group
    cache_shape = (NUM_BLOCKS, block_size, NUM_KV_HEADS, head_size)
    # Finite garbage everywhere: padding and stale slots are read and must be masked out.
    k_cache = (torch.randn(cache_shape, generator=generator) * 100).to(dtype)
    v_cache = (torch.randn(cache_shape, generator=generator) * 100).to(dtype)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    keys, values, tables = [], [], []
    for cached, new in seqs:
        seq_len = cached + new
        keys.append(torch.randn(seq_len, NUM_KV_HEADS, head_size, generator=generator).to(dtype))
        values.append(torch.randn(seq_len, NUM_KV_HEADS, head_size, generator=generator).to(dtype))
        tables.append([free.pop() for _ in range(-(-seq_len // block_size))])
        for p in range(cached):  # the cached prefix, written by an earlier step
            k_cache[tables[-1][p // block_size], p % block_size] = keys[-1][p]
            v_cache[tables[-1][p // block_size], p % block_size] = values[-1][p]
    new_lens = [new for _, new in seqs]
    meta = AttentionMetadata.from_lists(new_lens, [c + n for c, n in seqs], tables, block_size)
    assert meta.num_decodes == sum(n == 1 for n in new_lens)
    new_keys = torch.cat([k[c:] for k, (c, _) in zip(keys, seqs, strict=True)])
    new_values = torch.cat([v[c:] for v, (c, _) in zip(values, seqs, strict=True)])
    reshape_and_cache(new_keys, new_values, k_cache, v_cache, meta.slot_mapping)
    query = torch.randn(sum(new_lens), num_heads, head_size, generator=generator).to(dtype)
    scale = head_size**-0.5

    out = paged_attention(query, k_cache, v_cache, meta, scale)

    assert out.dtype == dtype and out.shape == query.shape
    torch.testing.assert_close(out.double(), naive_attention(query, keys, values, new_lens, scale), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["dense", "qkv_view"])
def test_reshape_and_cache_writes_only_the_slots(fused: bool, dtype: torch.dtype) -> None:
    k_cache, v_cache = torch.randn(2, 6, 4, NUM_KV_HEADS, HEAD_SIZE).to(dtype).unbind(0)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, 0, 13, 22])
    if fused:  # the model's layout: K and V are views into each token's fused q/k/v row
        qkv = torch.randn(4, 3 * NUM_KV_HEADS * HEAD_SIZE).to(dtype)
        key, value = qkv[:, NUM_KV_HEADS * HEAD_SIZE :].view(4, 2, NUM_KV_HEADS, HEAD_SIZE).unbind(1)
    else:
        key, value = torch.randn(2, 4, NUM_KV_HEADS, HEAD_SIZE).to(dtype).unbind(0)

    reshape_and_cache(key, value, k_cache, v_cache, slots)

    for cache, before, new in ((k_cache, before_k, key), (v_cache, before_v, value)):
        flat, flat_before = cache.view(-1, NUM_KV_HEADS, HEAD_SIZE), before.view(-1, NUM_KV_HEADS, HEAD_SIZE)
        assert torch.equal(flat[slots], new)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool).index_fill_(0, slots, False)
        assert torch.equal(flat[untouched], flat_before[untouched])


def test_reshape_and_cache_refuses_a_slot_outside_the_cache_and_writes_nothing() -> None:
    caches = torch.zeros(2, 6, 4, NUM_KV_HEADS, HEAD_SIZE)
    key, value = torch.ones(2, 2, NUM_KV_HEADS, HEAD_SIZE).unbind(0)

    with pytest.raises(RuntimeError, match="slot 24 of token 1 is outside the cache"):
        reshape_and_cache(key, value, caches[0], caches[1], torch.tensor([3, 24]))

    assert not caches.any()


def test_metadata_rejects_a_decode_after_a_prefill() -> None:
    with pytest.raises(ValueError, match="decodes"):
        AttentionMetadata.from_lists([3, 1], [3, 5], [[0], [1]], block_size=8)


def test_decode_attention_refuses_heads_past_its_stack_buffers() -> None:
    query = torch.randn(1, 2, 264)  # past MAX_HEAD (256), the size of the kernel's per-head arrays
    k_cache, v_cache = torch.randn(2, 1, 4, 2, 264).unbind(0)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head_size must be at most 256"):
        cpu.cpu_ops().decode_attention(query, k_cache, v_cache, tables, lens, 1.0)


@pytest.mark.parametrize(("table_rows", "len_rows"), [(1, 2), (2, 1)], ids=["tables", "lens"])
def test_decode_attention_refuses_fewer_table_or_length_rows_than_sequences(table_rows: int, len_rows: int) -> None:
    """It reads the first rows of both (a step's decodes, before its prefill chunks): each sequence needs one."""
    query = torch.randn(2, 2, HEAD_SIZE)
    k_cache, v_cache = torch.randn(2, 1, 4, 2, HEAD_SIZE).unbind(0)
    tables, lens = torch.zeros(table_rows, 1, dtype=torch.int32), torch.ones(len_rows, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="need a row for each of the query's 2 sequences"):
        cpu.cpu_ops().decode_attention(query, k_cache, v_cache, tables, lens, 1.0)


def test_a_kernel_call_lets_other_threads_run() -> None:
    """A kernel runs without the GIL: a Python thread (the backend's I/O thread, say) goes on meanwhile."""
    tokens, block_size = 4096, 16  # one long prefill chunk: a call of a fraction of a second or more
    query = torch.randn(tokens, 4 * NUM_KV_HEADS, HEAD_SIZE)
    k_cache, v_cache = torch.randn(2, tokens // block_size, block_size, NUM_KV_HEADS, HEAD_SIZE).unbind(0)
    tables = torch.arange(tokens // block_size, dtype=torch.int32)[None]
    starts, lens = torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([tokens], dtype=torch.int32)
    ops, scale = cpu.cpu_ops(), HEAD_SIZE**-0.5
    assert lets_other_threads_run(lambda: ops.prefill_attention(query, k_cache, v_cache, tables, starts, lens, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("width", [96, 40], ids=["vectors", "scalar"])  # AVX-512 takes rows of whole 16-value vectors
def test_rms_norm(with_residual: bool, dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 7, width, generator=generator) * 3).to(dtype).unbind(0)
    weight = torch.rand(width, generator=generator).to(dtype) + 0.5
    eps = 1e-5
    summed = x + residual if with_residual else x
    reference = LlamaRMSNorm(width, eps=eps).to(dtype)
    reference.weight.data.copy_(weight)
    formula = summed.double() * torch.rsqrt(summed.double().square().mean(-1, keepdim=True) + eps) * weight.double()

    result = rms_norm(x, weight, eps, residual if with_residual else None)

    out = result[0] if with_residual else result
    if with_residual:
        assert torch.equal(result[1], summed)
    assert out.dtype == dtype
    # Same rounding steps as transformers' LlamaRMSNorm, so equal up to float32 reduction order.
    torch.testing.assert_close(out, reference(summed), atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(out.double(), formula, **TOLERANCES[dtype])


ROPE_PARAMETERS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rope", ROPE_PARAMETERS)
def test_rotary_matches_transformers(rope: str, dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, head_size, max_position, theta = 6, 2, 64, 4096, 500000.0
    rope_parameters = {**ROPE_PARAMETERS[rope], "rope_theta": theta}
    config = LlamaConfig(
        hidden_size=num_heads * head_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_size,
        max_position_embeddings=max_position,
        rope_parameters=rope_parameters,
    )
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, max_position, (37,), generator=generator)
    query = torch.randn(37, num_heads, head_size, generator=generator).to(dtype)
    key = torch.randn(37, num_kv_heads, head_size, generator=generator).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(query, positions[None])
    # transformers wants [batch, heads, tokens, head_size].
    hf_query, hf_key = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin)
    scaling = None if rope == "default" else ROPE_PARAMETERS[rope]
    cache = build_cos_sin_cache(head_size, max_position, theta, scaling, dtype)

    ours_query, ours_key = rotary_embedding(positions, query, key, cache)

    torch.testing.assert_close(ours_query, hf_query[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_key, hf_key[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_embedding_and_cache_matches_rotary_then_cache_write(dtype: torch.dtype) -> None:
    """The CPU's one call against the torch references of its two steps."""
    generator = torch.Generator().manual_seed(0)
    num_heads, tokens = 3 * NUM_KV_HEADS, 4
    # Q, K and V as the model has them: strided views of one fused qkv row per token.
    qkv = torch.randn(tokens, (num_heads + 2 * NUM_KV_HEADS) * HEAD_SIZE, generator=generator).to(dtype)
    q, k, v = qkv.split([num_heads * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], dim=-1)
    query, key, value = q.view(tokens, num_heads, HEAD_SIZE), *(t.view(tokens, NUM_KV_HEADS, HEAD_SIZE) for t in (k, v))
    positions, slots = torch.tensor([3, 0, 40, 41]), torch.tensor([5, 0, 13, 22])
    cos_sin = build_cos_sin_cache(HEAD_SIZE, 64, 10000.0, dtype=dtype)
    caches = torch.randn(2, 4, 8, NUM_KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
    expected = caches.clone()

    got = rotary_embedding_and_cache(positions, query, key, value, cos_sin, *caches, slots)

    rotated_query, rotated_key = rotary.rotary_embedding(positions, query, key, cos_sin)
    attention.reshape_and_cache(rotated_key, value, *expected, slots)
    torch.testing.assert_close(got, rotated_query, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1], expected[1]), "values are copied, not rounded"


def test_rotary_refuses_unknown_scaling() -> None:
    with pytest.raises(ValueError, match="'proportional' is not supported"):
        build_cos_sin_cache(64, 128, 10000.0, {"rope_type": "proportional", "factor": 4.0})


def _gelu_tanh(gate: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` as ``g * sigmoid(2u)``: exact in float64 where ``1 + tanh(u)`` cancels."""
    return gate * torch.sigmoid(math.sqrt(8 / math.pi) * (gate + 0.044715 * gate**3))


# Each gated op of the MLP, its activation in float64, and how close the kernel's exponential keeps it in float32
# over |gate| < 80 (GeGLU's argument u, a cubic of the gate rounded in float, carries the most).
ACTIVATIONS = {
    "silu": (silu_and_mul, F.silu, 4e-6),
    "gelu_tanh": (gelu_tanh_and_mul, _gelu_tanh, 3e-5),
}


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_act_and_mul(dtype: torch.dtype, activation: str) -> None:
    op, reference, _ = ACTIVATIONS[activation]
    x = (torch.randn(5, 3, 2 * 48, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    gate, up = x.double()[..., :48], x.double()[..., 48:]

    out = op(x)

    assert out.shape == (5, 3, 48) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(gate) * up, **TOLERANCES[dtype])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_and_mul_in_bf16_against_torch(activation: str) -> None:
    """Within two bf16 steps of the activation rounded to bf16 times ``up`` (the exponentials differ in their last
    bits), about 0 where the kernel clamps the exponent (GeGLU below a gate of -10, e^-u past 2^126), NaN and
    infinities where torch has them: the vectorized rounding to bf16 keeps its special values."""
    op, reference, _ = ACTIVATIONS[activation]
    x = (torch.randn(64, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(torch.bfloat16)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[1, 1536:1539] = torch.tensor([float("nan"), float("inf"), 0.0])
    gate, up = x.chunk(2, dim=-1)

    out = op(x)

    expected = reference(gate.double()).to(torch.bfloat16) * up
    torch.testing.assert_close(out, expected, atol=1e-30, rtol=2**-6, equal_nan=True)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_act_and_mul_over_the_float_range(activation: str) -> None:
    """The kernel's own exponential holds across the range in float32: close to float64's activation up to
    |gate| = 80, about 0 below, and torch's results for the special values."""
    op, reference, rtol = ACTIVATIONS[activation]
    special = torch.tensor([-100.0, float("inf"), -float("inf"), float("nan")])
    gate = torch.cat([torch.linspace(-80, 80, 100_001), special])
    x = torch.stack([gate, torch.full_like(gate, 3.0)], dim=1)

    out = op(x)[:, 0]

    expected = reference(gate.double()) * 3
    torch.testing.assert_close(out[:-4].double(), expected[:-4], atol=1e-30, rtol=rtol)
    assert abs(out[-4].item()) < 1e-30
    assert out[-3].item() == float("inf") and out[-2].isnan() and out[-1].isnan()


def _argmax_cases() -> dict[str, torch.Tensor]:
    """Rows that exercise each branch of the C++ argmax: its 256-value spans, the values past them, ties, NaN, -inf."""
    g = torch.Generator().manual_seed(0)
    vocab = torch.randn(64, 49152, generator=g)
    ties = torch.zeros(6, 1000)
    ties[0, [3, 700]] = 1.0  # two spans
    ties[1, [300, 301]] = 1.0  # one span
    ties[2, [10, 900]] = 1.0  # a span and the tail past the last whole one (768..999)
    ties[3, [800, 990]] = 1.0  # the tail only
    ties[4] = 1.0  # all equal
    ties[5, 999] = 2.0  # the last value
    nan = torch.randn(5, 600, generator=g)
    nan[0, 40] = nan[0, 500] = float("nan")  # in a span, first of two
    nan[1, 550] = float("nan")  # in the tail
    nan[2, 300], nan[2, 10] = float("nan"), 1e30  # after the maximum
    nan[3, :] = float("-inf")
    nan[4, :] = float("-inf")
    nan[4, 599] = -1e30
    return {
        "vocab": vocab,
        "padded_rows": torch.randn(9, 49160, generator=g)[:, :49152],  # a padded lm head's view: row stride > width
        "short": torch.randn(7, 37, generator=g),
        "ties": ties,
        "nan_and_inf": nan,
        "one_value": torch.tensor([[float("-inf")], [3.0]]),
    }


@pytest.mark.parametrize("case", list(_argmax_cases()))
def test_argmax_matches_torch(case: str) -> None:
    logits = _argmax_cases()[case]

    assert torch.equal(argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
# Output tiles of 48 columns: two whole ones; one and a last of 32; a last of 16 only.
@pytest.mark.parametrize("outputs", [96, 80, 16])
def test_prepared_linear_equals_plain(outputs: int, rows: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(outputs, 64, generator=generator).to(dtype)
    bias = torch.randn(outputs, generator=generator).to(dtype)
    x = torch.randn(rows, 64, generator=generator).to(dtype)
    projection = Projection(weight, bias)

    # bf16 runs our kernel with AVX-512 bf16, float32 oneDNN's packed matmul; bf16 elsewhere oneDNN's where it runs
    # bf16, else the plain weight (AVX2).
    tiled = dtype == torch.bfloat16 and cpu.bf16_linear_supported()
    packed = not tiled and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert (projection.tiled is not None, projection.packed is not None) == (tiled, packed)
    assert (projection.dense is None) == (tiled or packed)
    out = linear(x, torch.empty(0), prepared=projection)
    if tiled:  # sums in float in another order than oneDNN's: at most a bf16 rounding apart from the exact result
        exact = (x.double() @ weight.double().T + bias.double()).float()
        torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=2**-8)
    elif dtype == torch.bfloat16:  # the same oneDNN kernel either way
        assert torch.equal(out, F.linear(x, weight, bias))
    else:  # oneDNN's and MKL's float32 GEMMs sum in different orders
        torch.testing.assert_close(out, F.linear(x, weight, bias))


@pytest.mark.parametrize("bits", [0, 8, 4], ids=["dense", "int8", "int4"])
def test_a_projection_built_within_eager_runs_torch_alone(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--enforce-eager``: no tiles for our bf16 kernel and no quantized kernel, whatever the CPU and batch size.

    A quantized one multiplies by its weight dequantized a panel of output rows at a time (two panels here).
    """

    def refuse(*args: object) -> None:
        raise AssertionError("a C++ op of ours ran")

    kernels = ("bf16_linear_supported", "bf16_pack", "bf16_linear", "int8_linear", "int4_linear", "w8a8_linear")
    for name in (*kernels, "quant_gemm", "a8_linear"):
        monkeypatch.setattr(cpu, name, refuse)
    monkeypatch.setattr(linear_module, "EAGER_PANEL_ROWS", 64)
    generator = torch.Generator().manual_seed(bits)
    weight = torch.randn(96, 128, generator=generator).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    quantized = quant.quantize(weight.float(), bits) if bits else None
    with eager():
        projection = Projection(weight, bias, quantized)

    assert projection.tiled is None and projection.w8a8 is None
    assert (projection.dense is None and projection.packed is None) if bits else True
    for rows in (1, 5, 40):
        x = torch.randn(rows, 128, generator=generator).to(torch.bfloat16)
        assert not projection.runs_weight_only(rows)
        if quantized is None:  # oneDNN's packed bf16 matmul where it runs bf16 is the kernel F.linear runs
            assert torch.equal(projection(x), F.linear(x, weight, bias))
        else:  # torch's bf16 matmul of the bf16-rounded weights: a bf16 rounding or two from the float32 reference
            want = quant.quantized_linear(x.float(), quantized, bias.float())
            torch.testing.assert_close(projection(x).float(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)


def test_tiled_linear_takes_batched_and_strided_inputs() -> None:
    if not cpu.bf16_linear_supported():
        pytest.skip("our bf16 kernel needs AVX-512 bf16")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    projection = Projection(weight)
    wide = torch.randn(2, 5, 100, generator=generator).to(torch.bfloat16)
    x = wide[..., 10:74]  # [2, 5, 64], rows 100 apart

    out = projection(x)

    assert out.shape == (2, 5, 48)
    assert torch.equal(out, projection(x.contiguous()))
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, atol=1e-2, rtol=2**-8)


def test_bf16_pack_refuses_shapes_it_cannot_tile() -> None:
    if not cpu.bf16_linear_supported():
        pytest.skip("our bf16 kernel needs AVX-512 bf16")
    with pytest.raises(RuntimeError, match="out % 16 == 0"):
        cpu.bf16_pack(torch.zeros(40, 64, dtype=torch.bfloat16))
    assert Projection(torch.zeros(40, 64, dtype=torch.bfloat16)).tiled is None  # packed by oneDNN instead


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_rounds_each_weight_to_its_nearest_level(bits: int) -> None:
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(bits)) * 0.1
    q = quant.quantize(weight, bits)

    assert q.shape == (48, 128) and q.bits == bits
    assert torch.equal(quant.pack_int4(q.unpacked()), q.qweight) if bits == 4 else q.qweight.dtype == torch.int8
    steps = q.scales.repeat_interleave(q.group_size, dim=1)
    # Round to nearest: no weight is further than half a step from its level (plus float32 rounding).
    assert ((quant.dequantize(q) - weight).abs() <= steps * (0.5 + 1e-4)).all()
    if bits == 4:  # asymmetric: each group's extremes are levels 0 and 15 exactly
        groups = weight.view(48, -1, q.group_size)
        torch.testing.assert_close(quant.dequantize(q).view_as(groups).amin(-1), groups.amin(-1))
        torch.testing.assert_close(quant.dequantize(q).view_as(groups).amax(-1), groups.amax(-1))


@pytest.mark.parametrize(
    ("bits", "group_size", "offsets"),
    [(8, 96, False), (8, 32, False), (8, 16, False), (8, 32, True), (4, 32, True)],
    ids=["int8_per_row", "int8_q8_0_groups", "int8_q6_k_groups", "int8_q5_k_offsets", "int4_groups"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_kernels_match_the_reference_for_every_token_count(
    dtype: torch.dtype, bits: int, group_size: int, offsets: bool
) -> None:
    generator = torch.Generator().manual_seed(bits)
    quantized = quant.quantize(torch.randn(72, 96, generator=generator) * 0.1, bits)
    groups = 96 // group_size
    if bits == 8 and group_size != 96:  # a scale per group, as GGUF's Q8_0 blocks (Q6_K's of 16) have
        quantized.scales = quantized.scales.repeat(1, groups) * torch.rand(72, groups, generator=generator) + 0.01
        quantized.group_size = group_size
    if bits == 8 and offsets:  # and an offset per group, as Q5_K's d * q - m
        quantized.zeros = torch.randn(72, groups, generator=generator) * 0.1
    kernel = cpu.int4_linear if bits == 4 else cpu.int8_linear
    for rows in range(1, cpu.MAX_INT8_TOKENS + 1):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        want = quant.quantized_linear(x.float(), quantized)
        out = kernel(x, quantized.qweight, quantized.scales, quantized.zeros, quantized.group_size)
        assert out.dtype == dtype
        tolerance = 1e-6 if dtype == torch.float32 else 2**-8  # bf16: the output rounded once
        torch.testing.assert_close(out.float(), want, atol=tolerance * float(want.abs().max()), rtol=tolerance)


def layout(bits: int, group_size: int, zeros: bool, outputs: int, inputs: int, seed: int) -> quant.QuantizedWeight:
    """A random weight in one of the layouts: int4 in groups, int8 per row or per group, with or without offsets."""
    generator = torch.Generator().manual_seed(seed)
    quantized = quant.quantize(torch.randn(outputs, inputs, generator=generator) * 0.1, bits, group_size)
    if bits == 8 and group_size != inputs:  # a scale (and an offset) per group, as GGUF's Q8_0, Q6_K and Q5_K have
        groups = inputs // group_size
        quantized.scales = torch.rand(outputs, groups, generator=generator) * 1e-3 + 1e-4
        quantized.zeros = torch.randn(outputs, groups, generator=generator) * 0.05 if zeros else None
        quantized.group_size = group_size
    return quantized


@pytest.mark.parametrize(
    ("bits", "group_size", "zeros"),
    [(4, 32, True), (8, 96, False), (8, 32, False), (8, 16, False), (8, 32, True)],
    ids=["int4_g32", "int8_per_row", "int8_g32", "int8_g16", "int8_g32_zeros"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_panel_kernel_matches_the_reference(dtype: torch.dtype, bits: int, group_size: int, zeros: bool) -> None:
    """Row counts on both sides of the crossover (and blocks of 4 rows with 1-3 left), panels of 32 columns with
    blocks of 3 and 1 or 2 left over (97 outputs), with a bias."""
    quantized = layout(bits, group_size, zeros, 97, 96, bits + group_size)
    generator = torch.Generator().manual_seed(group_size)
    bias = torch.randn(97, generator=generator)
    for rows in (1, 3, 8, 9, 14, 64, 130):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        want = quant.quantized_linear(x.float(), quantized, bias)
        out = cpu.quant_gemm(x, quantized.qweight, quantized.scales, quantized.zeros, group_size, bias)
        assert out.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # bf16, fp16: the output rounded once
        torch.testing.assert_close(out.float(), want, atol=tolerance * float(want.abs().max()), rtol=tolerance)


@pytest.mark.parametrize(
    ("bits", "group_size", "zeros"),
    [(4, 32, True), (4, 64, True), (8, 192, False), (8, 32, False), (8, 16, False), (8, 16, True), (6, 16, False)]
    + [(6, 32, False), (6, 32, True)],
    ids=[
        *("int4_g32", "int4_g64", "int8_per_row", "int8_g32", "int8_g16", "int8_g16_zeros", "six_g16", "six_g32"),
        "six_g32_zeros",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("half_scales", [False, True], ids=["f32_scales", "f16_scales"])
def test_a8_kernel_matches_the_reference(
    dtype: torch.dtype, bits: int, group_size: int, zeros: bool, half_scales: bool
) -> None:
    """Blocks of tokens (4 a pass; without VNNI, 8 for int4 and for int8 in groups of 32 or more) and their
    remainders, panels of 8 rows with 1 left over (97 outputs), activation blocks of very different magnitudes (as
    outlier channels make them), more tokens than one panel of 64. ``bits`` 6: int8 values in -32..31 (GGUF's
    Q6_K; with offsets, as Q5_K's 0..31), which pack in 6 bits. Results also go into a column slice of a wider
    output, and a call of many tokens gives each row bit for bit what a call of that row alone does. Scales and
    offsets that float16 holds exactly (``half_scales``, as GGUF's Q4_0, Q4_1 and Q8_0 store them) are packed in
    float16."""
    if not cpu.a8_linear_supported():
        pytest.skip("a8_linear needs AVX2")
    quantized = layout(8 if bits == 6 else bits, group_size, zeros, 97, 192, bits + group_size)
    if bits == 6:
        quantized.qweight = torch.randint(-32, 32, quantized.qweight.shape, dtype=torch.int8)
    if half_scales:  # the kernel's int4 offset is zeros - 8 x scales: that is what float16 must hold
        quantized.scales = quantized.scales.half().float()
        if quantized.zeros is not None:
            shift = 8 * quantized.scales if bits == 4 else 0
            quantized.zeros = (quantized.zeros - shift).half().float() + shift
    packed = cpu.a8_pack(quantized.qweight, quantized.scales, quantized.zeros, group_size)
    assert packed[1].dtype == (torch.float16 if half_scales else torch.float32)
    assert packed[2] is None or packed[2].dtype == packed[1].dtype
    stored_bits = packed[0].numel() * 8 / (104 * 192)  # 13 panels of 8 rows
    assert stored_bits == bits, stored_bits
    generator = torch.Generator().manual_seed(group_size)
    magnitudes = torch.tensor([0.01, 1.0, 30.0, 0.5, 2.0, 0.0]).repeat_interleave(quant.A8_BLOCK)
    for rows in (1, 3, 4, 9, 15, 70):
        x = (torch.randn(rows, 192, generator=generator) * magnitudes).to(dtype)
        want = quant.a8_linear(x.float(), quantized)
        out = cpu.a8_linear(x, *packed, group_size, 97)
        wide = torch.full((rows, 105), -1.0, dtype=dtype)
        cpu.a8_linear(x, *packed, group_size, 97, wide[:, 3:100])
        assert out.dtype == dtype and out.shape == (rows, 97)
        assert torch.equal(wide[:, 3:100], out) and (wide[:, :3] == -1).all() and (wide[:, 100:] == -1).all()
        tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: the output rounded once
        torch.testing.assert_close(out.float(), want, atol=tolerance * float(want.abs().max()), rtol=tolerance)
        if rows >= 8:  # on AVX-512 VNNI, two panels a pass from 8 tokens: each row as the one-token path gives it
            alone = torch.cat([cpu.a8_linear(x[i : i + 1], *packed, group_size, 97) for i in range(rows)])
            assert torch.equal(out, alone)


def test_a8_kernel_refuses_what_it_cannot_run() -> None:
    if not cpu.a8_linear_supported():
        pytest.skip("a8_linear needs AVX2")
    int4 = quant.quantize(torch.randn(16, 64), 4)
    with pytest.raises(RuntimeError, match="an int4 weight needs its offsets"):
        cpu.a8_pack(int4.qweight, int4.scales, None, 32)
    with pytest.raises(RuntimeError, match="a multiple of 32 that divides in_features"):
        cpu.a8_pack(int4.qweight, torch.zeros(16, 4), torch.zeros(16, 4), 16)
    with pytest.raises(RuntimeError, match="in_features must be a multiple of 32"):
        cpu.a8_pack(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 3), None, 16)
    packed = cpu.a8_pack(int4.qweight, int4.scales, int4.zeros, 32)
    with pytest.raises(RuntimeError, match="packed must be a8_pack's tensor"):
        cpu.a8_linear(torch.randn(2, 96), *packed, 32, 16)
    with pytest.raises(RuntimeError, match="scales must be a8_pack's"):
        cpu.a8_linear(torch.randn(2, 64), packed[0], torch.ones(3), packed[2], None, 32, 16)


def test_panel_kernel_refuses_what_it_cannot_run() -> None:
    quantized = quant.quantize(torch.randn(16, 96), 4)
    x = torch.randn(2, 96)
    with pytest.raises(RuntimeError, match="int4 weights need their zeros"):
        cpu.quant_gemm(x, quantized.qweight, quantized.scales, None, 32, None)
    with pytest.raises(RuntimeError, match="group_size must be a multiple of 16"):
        cpu.quant_gemm(x, quantized.qweight, torch.zeros(16, 12), torch.zeros(16, 12), 8, None)
    with pytest.raises(RuntimeError, match=r"x must be \[tokens, 96\]"):
        cpu.quant_gemm(torch.randn(2, 64), quantized.qweight, quantized.scales, quantized.zeros, 32, None)


@pytest.mark.parametrize(
    ("bits", "group_size", "zeros"), [(4, 32, True), (8, 64, False), (8, 16, True)], ids=["int4", "int8", "int8_g16"]
)
def test_an_embedding_lookup_from_quantized_rows_equals_the_dequantized_tables(
    bits: int, group_size: int, zeros: bool
) -> None:
    """The C++ lookup and the eager one (torch's ops on the gathered rows); a row out of range is refused."""
    quantized = layout(bits, group_size, zeros, 50, 64, bits)
    ids = torch.tensor([3, 0, 49, 3, 17])
    for dtype in (torch.float32, torch.bfloat16):
        want = F.embedding(ids, quant.dequantize(quantized, dtype))
        assert torch.equal(quantized_embedding(ids, quantized, dtype), want)
        with eager():
            assert torch.equal(quantized_embedding(ids, quantized, dtype), want)
    with pytest.raises(RuntimeError, match="row 50 out of range for 50 rows"):
        quantized_embedding(torch.tensor([1, 50]), quantized, torch.float32)


def projection_case(
    bits: int, dtype: torch.dtype
) -> tuple[torch.Generator, torch.Tensor, torch.Tensor, quant.QuantizedWeight]:
    """A random 96x128 weight in ``dtype``, its bias and its ``bits`` quantized form, and the generator for inputs."""
    generator = torch.Generator().manual_seed(bits)
    weight = (torch.randn(96, 128, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    return generator, weight, bias, quant.quantize(weight, bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_projection_runs_the_weight_only_kernel_up_to_the_crossover_then_the_panel_kernel(
    bits: int, dtype: torch.dtype
) -> None:
    """Within weight_only: the activations stay float (their default, int8 activations, is tested below)."""
    generator, weight, bias, quantized = projection_case(bits, dtype)
    with weight_only():
        projection = Projection(weight, bias, quantized)
    assert projection.w8a8 is None and not projection.a8
    limit = min(MAX_QUANTIZED_TOKENS[dtype, bits], cpu.MAX_INT8_TOKENS)

    for rows in sorted({1, limit, limit + 1, 40} - {0}):
        x = torch.randn(rows, 128, generator=generator).to(dtype)
        out = projection(x)
        assert out.shape == (rows, 96) and out.dtype == dtype
        assert projection.runs_weight_only(rows) == (rows <= limit)
        want = quant.quantized_linear(x.float(), quantized, bias.float())
        # fp32: summation order only. bf16: the output rounded once, and the int4 offsets in bf16 too.
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want, atol=tolerance * float(want.abs().max()), rtol=tolerance)
    assert projection.dense is None and projection.tiled is None and projection.packed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_projection_quantizes_its_activations_by_default(bits: int, dtype: torch.dtype) -> None:
    """int8 per row runs W8A8 where the CPU has AVX-512 VNNI, every quantized layout ``a8_linear`` where it has
    AVX2, at every batch size; the result is the reference of the kernel that ran."""
    generator, weight, bias, quantized = projection_case(bits, dtype)
    projection = Projection(weight, bias, quantized)
    w8a8 = bits == 8 and cpu.w8a8_supported()
    assert (projection.w8a8 is not None) == w8a8
    assert projection.a8 == (not w8a8 and cpu.a8_linear_supported())
    if projection.w8a8 is None and not projection.a8:
        pytest.skip("this CPU has neither AVX2 nor AVX-512 VNNI")
    reference = quant.w8a8_linear if w8a8 else quant.a8_linear
    for rows in (1, 9, 40):
        x = torch.randn(rows, 128, generator=generator).to(dtype)
        out = projection(x)
        assert out.shape == (rows, 96) and out.dtype == dtype and not projection.runs_weight_only(rows)
        want = reference(x.float(), quantized, bias.float())
        # fp32: summation order, and an activation at a rounding tie, one level either way. bf16: the output
        # rounded once (W8A8: its scales and the int4 offsets in bf16 too; measured worst 0.4% of the range).
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want, atol=tolerance * float(want.abs().max()), rtol=tolerance)


@pytest.mark.parametrize("eager_mode", [False, True], ids=["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_projection_holds_no_dense_weight(bits: int, dtype: torch.dtype, eager_mode: bool) -> None:
    """No attribute (nor list or tuple of them, nor quantized form's) holds a float tensor of the weight's size."""
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(bits)).to(dtype)
    with eager(eager_mode):
        projection = Projection(weight, None, quant.quantize(weight.float(), bits))

    def held(value: object) -> list[object]:
        if isinstance(value, (list, tuple)):
            return [v for item in value for v in held(item)]
        return held(list(vars(value).values())) if isinstance(value, quant.QuantizedWeight) else [value]

    tensors = [t for t in held(list(vars(projection).values())) if isinstance(t, torch.Tensor)]
    assert any(t.dtype in (torch.int8, torch.uint8) for t in tensors)  # the walk reaches the quantized form
    assert not [t.shape for t in tensors if t.is_floating_point() and t.numel() >= weight.numel()]


def test_w8a8_takes_only_what_its_kernel_runs() -> None:
    """Shapes the kernel cannot tile and GGUF's Q8_0 groups take ``a8_linear`` (int8 activations too), and with float
    activations asked for, the weight-only kernel and the panel kernel."""
    if not cpu.w8a8_supported():
        pytest.skip("the W8A8 kernel needs AVX-512 VNNI")
    with pytest.raises(RuntimeError, match="out % 16 == 0 and in % 64 == 0"):
        cpu.int8_pack(torch.zeros(48, 96, dtype=torch.int8))
    generator = torch.Generator().manual_seed(0)
    for outputs, inputs, group_size in [(40, 128, 128), (48, 96, 96), (48, 128, 32)]:
        weight = torch.randn(outputs, inputs, generator=generator).to(torch.bfloat16)
        quantized = quant.quantize(weight.float(), 8)
        if group_size != inputs:  # a scale per 32 inputs, as GGUF's Q8_0 blocks have
            quantized.scales, quantized.group_size = quantized.scales.repeat(1, inputs // group_size), group_size
        projection = Projection(weight, None, quantized)
        assert projection.w8a8 is None and projection.a8
        with weight_only():
            projection = Projection(weight, None, quantized)
        assert projection.w8a8 is None and projection.runs_weight_only(1) and not projection.runs_weight_only(40)
    assert Projection(weight, None, quant.quantize(weight.float(), 4)).w8a8 is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("outputs", [96, 80, 16])  # tiles of 48 columns: two whole; one and 32; 16 alone
def test_w8a8_kernel_matches_the_reference(outputs: int, dtype: torch.dtype) -> None:
    """Every block of rows (1-8 and a remainder, past one 256-row panel), every tile width, with a bias."""
    if not cpu.w8a8_supported():
        pytest.skip("the W8A8 kernel needs AVX-512 VNNI")
    generator = torch.Generator().manual_seed(outputs)
    inputs = 3 * quant.ACTIVATION_GROUP_SIZE
    quantized = quant.quantize(torch.randn(outputs, inputs, generator=generator) * 0.1, 8)
    bias = torch.randn(outputs, generator=generator)
    tiles, sums = cpu.int8_pack(quantized.qweight)
    scales = quantized.scales.reshape(-1).contiguous()
    for rows in (*range(1, 10), 300):
        # Groups of very different magnitudes, as activations with outlier channels have.
        x = torch.randn(rows, inputs, generator=generator) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(
            inputs // 3
        )
        x = x.to(dtype)

        out = cpu.w8a8_linear(x, tiles, sums, scales, bias)

        want = quant.w8a8_linear(x.float(), quantized, bias)
        assert out.dtype == dtype and out.shape == (rows, outputs)
        tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # bf16: the output rounded once
        torch.testing.assert_close(out.float(), want, atol=tolerance * float(want.abs().max()), rtol=tolerance)


def test_attend_under_torch_compile_matches_eager() -> None:
    """A compiled caller (the custom op, fullgraph) gets the same output and cache writes as an eager one."""
    meta = AttentionMetadata.from_lists([1, 3], [5, 3], [[0], [1]], block_size=16)
    query, key, value = torch.randn(3, 4, 4, HEAD_SIZE).unbind(0)
    key, value = key[:, :NUM_KV_HEADS], value[:, :NUM_KV_HEADS]
    caches = torch.randn(2, 2, 16, NUM_KV_HEADS, HEAD_SIZE)

    def layer(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return attend(query, key, value, k_cache, v_cache, HEAD_SIZE**-0.5) * 2

    eager_caches = caches.clone()
    with attention_metadata(meta):
        expected = layer(query, *eager_caches.unbind(0))
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(query, *caches.unbind(0))

    torch.testing.assert_close(got, expected)
    assert torch.equal(caches, eager_caches)
