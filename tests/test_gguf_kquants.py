"""GGUF K-quant and 5-bit blocks kept as they are: decoded exactly, stacked, and served against transformers.

The ``gguf`` package has no Python quantizer for the K-quants, so the blocks are random valid ones
(:func:`random_blocks`): random bytes with the fp16 fields set to finite values of a chosen size. What they stand for
is what ``gguf``'s dequantization (and so transformers' GGUF reader) says.
"""

import json
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_COMMON, TINY_VARIANTS
from test_gguf_families import tokens_of_both, write_gguf

from spindle.backend import parallel
from spindle.backend.models import gguf_blocks, load_model
from spindle.backend.models.llama import EMBEDDING_TABLE
from spindle.backend.models.loader import MIXED, QUANTIZATION_FILE, quantized_weights, resolve_quantization
from spindle.backend.parallel import TensorParallel
from spindle.kernels import cpu, quant
from spindle.kernels.linear import Projection
from spindle.kernels.quant import cat_rows, dequantize

FP16_FIELDS = {
    "Q4_0": ((0, 1.0),),
    "Q4_1": ((0, 1.0), (2, -7.5)),
    "Q5_0": ((0, 1.0),),
    "Q5_1": ((0, 1.0), (2, -15.5)),
    "Q8_0": ((0, 1.0),),
    "Q4_K": ((0, 1.0), (2, 7.5)),
    "Q5_K": ((0, 1.0), (2, 15.5)),
    "Q6_K": ((208, 1.0),),
    "Q3_K": ((108, 1.0),),
}
"""Each type's fp16 fields in a block: ``(byte offset, size against d)``. The minimums are sized to centre the
values near 0, as a quantizer's would be (random bytes there could be inf or NaN)."""

LAYOUTS = {
    "Q4_0": (4, 32, True),
    "Q4_1": (4, 32, True),
    "Q4_K": (4, 32, True),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True),
    "Q5_K": (8, 32, True),
    "Q6_K": (8, 16, False),
    "Q8_0": (8, 32, False),
}
"""Each kept type's layout: ``(bits, group size, with offsets)``."""


def random_blocks(gguf_type: str, rows: int, inputs: int, seed: int, std: float = 0.05) -> np.ndarray:
    """Random valid ``gguf_type`` blocks of a ``[rows, inputs]`` matrix (uint8 ``[rows, bytes]``) whose values have
    a standard deviation of about ``std``."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[gguf_type]
    block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, inputs // block_inputs, block_bytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.0, (rows, inputs // block_inputs, 1)).astype(np.float32)

    def set_fields(scale: float) -> np.ndarray:
        for offset, size in FP16_FIELDS[gguf_type]:
            blocks[..., offset : offset + 2] = (d * size * scale).astype(np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)

    measured = float(gguf.quants.dequantize(set_fields(1.0), kind).std())
    return set_fields(std / measured)


@pytest.mark.parametrize("gguf_type", list(LAYOUTS))
def test_blocks_decode_as_gguf_does(gguf_type: str) -> None:
    """Every kept type lands in its layout and dequantizes to ``gguf``'s values, to float32 rounding."""
    blocks = random_blocks(gguf_type, 24, 512, seed=3)

    weight = gguf_blocks.decode(gguf_type, torch.from_numpy(blocks))

    assert (weight.bits, weight.group_size, weight.zeros is not None) == LAYOUTS[gguf_type]
    assert weight.shape == (24, 512)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[gguf_type]))
    scale = float(reference.abs().max())
    torch.testing.assert_close(dequantize(weight), reference, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize(
    ("gguf_type", "raw", "message"),
    [
        ("Q3_K", torch.zeros(2, 110, dtype=torch.uint8), "not kept"),
        ("Q4_K", torch.zeros(2, 145, dtype=torch.uint8), "blocks x 144"),
        ("Q6_K", torch.zeros(2, 210, dtype=torch.int8), "must be uint8"),
    ],
    ids=["unkept_type", "partial_block", "not_bytes"],
)
def test_decode_rejects_what_it_cannot_keep(gguf_type: str, raw: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gguf_blocks.decode(gguf_type, raw)


@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_projections_keep_compact_scales(gguf_type: str) -> None:
    """A K-quant matrix carries its super-block factors, and the default CPU projection keeps its scales as the
    file's integers (int8 sub-scales, uint8 sub-minimums): the same products as the reference, 2 bytes a group and
    row. Factors that do not give the scales as integer multiples are refused."""
    if not cpu.a8_linear_supported():
        pytest.skip("a8_linear needs AVX2")
    weight = gguf_blocks.decode(gguf_type, torch.from_numpy(random_blocks(gguf_type, 36, 512, seed=5)))
    assert weight.super_scales is not None and weight.super_scales.shape == (36, 2, 2)
    projection = Projection(torch.empty(0), None, weight)
    [((packed, scales, offsets, supers), _, _)] = projection._a8_parts
    assert supers is not None and scales.dtype == torch.int8
    assert (offsets is None) == (weight.zeros is None) and (offsets is None or offsets.dtype == torch.uint8)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(0))
    want = quant.a8_linear(x, weight)
    torch.testing.assert_close(projection(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    wrong = weight.super_scales.clone()
    wrong[3, 1, 0] *= 1.5
    with pytest.raises(RuntimeError, match="row 3.s scales and offsets as integer multiples of float16"):
        cpu.a8_pack(weight.qweight, weight.scales, weight.zeros, weight.group_size, wrong)


def test_parts_of_different_layouts_stack_exactly() -> None:
    """A fused projection whose parts differ (Q4_K q beside Q6_K v, a Q5_K part with offsets) is widened to int8 at
    the finest group without changing a value, and keeps its parts, which the default CPU projection lays out each
    as it is (Q6_K and the 5-bit types in 6 bits, Q4_K in 4, Q8_0 in 8): the reference's products. Parts of one
    layout stack as they are."""
    parts = [gguf_blocks.decode(t, torch.from_numpy(random_blocks(t, 8, 256, seed=i))) for i, t in enumerate(LAYOUTS)]

    mixed = cat_rows(parts)

    assert (mixed.bits, mixed.group_size, mixed.zeros is not None) == (8, 16, True)
    torch.testing.assert_close(dequantize(mixed), torch.cat([dequantize(p) for p in parts]), rtol=0, atol=1e-6)
    # Q4_0 and Q4_1 (int4 per 32 with offsets, no super-block factors) stack into one part; Q4_K has factors.
    assert mixed.parts is not None and len(mixed.parts) == len(parts) - 1
    torch.testing.assert_close(torch.cat([dequantize(p) for p in mixed.parts]), dequantize(mixed), rtol=0, atol=0)
    same = cat_rows(parts[:3])  # Q4_0, Q4_1, Q4_K: int4 in groups of 32
    assert (same.bits, same.group_size, same.parts) == (4, 32, None)
    assert torch.equal(same.qweight, torch.cat([p.qweight for p in parts[:3]]))
    if cpu.a8_linear_supported():
        projection = Projection(torch.empty(0), None, mixed)
        six_bits = [p.bits == 8 and -32 <= p.qweight.min() and p.qweight.max() < 32 for p in parts]
        stored_bits = [8 * packed[0].numel() / (rows * 256) for packed, rows, _ in projection._a8_parts]
        want = [4 if p.bits == 4 else 6 if six else 8 for p, six in zip(parts, six_bits, strict=True)]
        assert stored_bits == want[1:], stored_bits  # Q4_0 and Q4_1 in one part
        assert any(six_bits)
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
        want = quant.a8_linear(x, mixed)
        torch.testing.assert_close(projection(x), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


KQUANT_CONFIG = {**TINY_COMMON, **TINY_VARIANTS["llama"][1], "hidden_size": 256, "intermediate_size": 512}
KQUANT_CONFIG["tie_word_embeddings"] = False
"""A tiny Llama whose matrices hold whole K-quant super-blocks of 256 inputs (64 per head, as llama.cpp's own)."""

FILE_TYPES: dict[str, tuple[str, dict[str, str]]] = {
    "Q4_K_M": ("Q4_K", {"blk.0.attn_v": "Q6_K", "blk.0.ffn_down": "Q6_K", "output": "Q6_K"}),
    "Q5_K": ("Q5_K", {"output": "Q6_K"}),
    "Q3_K_M": ("Q3_K", {"blk.0.attn_v": "Q5_K", "blk.1.attn_v": "Q4_K", "ffn_down": "Q4_K", "output": "Q6_K"}),
}
"""Files typed as llama.cpp's presets do: the default type, and the types of the matrices whose GGUF name is a key
(``blk.0.attn_v``, ``output``) or ends in one (``ffn_down``: every layer's)."""

PARTS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",)}
PARTS |= {"gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}
"""Spindle's projection -> the GGUF matrices it stacks."""


def gguf_type_of(file_type: str, name: str) -> str:
    """The type of the GGUF matrix ``name`` (``blk.0.attn_v``, ``output``, ``token_embd``) in a file of
    ``file_type``."""
    default, overrides = FILE_TYPES[file_type]
    return next((t for key, t in overrides.items() if key in (name, name.split(".")[-1])), default)


def served_types(file_type: str, projection: str) -> list[str]:
    """The GGUF types of the matrices a Spindle projection (``layers.0.self_attn.qkv_proj``, ``lm_head``) stacks."""
    if projection == "lm_head":
        return [gguf_type_of(file_type, "output")]
    layer, name = projection.split(".")[1], projection.split(".")[-1]
    return [gguf_type_of(file_type, f"blk.{layer}.{part}") for part in PARTS[name]]


@pytest.fixture(scope="module")
def kquant_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint of :data:`KQUANT_CONFIG` (only its shapes and norms reach the GGUF files)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**KQUANT_CONFIG))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("kquant")
    model.save_pretrained(path)
    return path


def random_blocks_of(file_type: str) -> Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """A :func:`~test_gguf_families.write_gguf` encoder: random blocks of each matrix's type in a ``file_type``."""

    def encode(name: str, data: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        gguf_type = gguf_type_of(file_type, name.removesuffix(".weight"))
        blocks = random_blocks(gguf_type, *data.shape, seed=zlib.crc32(name.encode()))
        return blocks, gguf.GGMLQuantizationType[gguf_type]

    return encode


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_kquant_files_serve_their_own_blocks(
    file_type: str, kquant_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quantization auto`` on a K-quant file gives transformers' greedy tokens, each projection served from the
    file's blocks at their own width (a fused one whose parts differ widened to int8, exactly), those of a type not
    kept (Q3_K) quantized to int8 at load; a tensor-parallel rank keeps its slice of the same blocks."""
    file = write_gguf(kquant_checkpoint, "llama", tmp_path / f"{file_type}.gguf", random_blocks_of(file_type))

    expected, got, dense, model_dir = tokens_of_both(file, monkeypatch)

    assert got == expected
    layer_types = Counter(gguf_type_of(file_type, f"blk.{i}.{p}") for i in (0, 1) for ps in PARTS.values() for p in ps)
    recorded = json.loads((model_dir / QUANTIZATION_FILE).read_text())
    if len(layer_types) == 1:
        assert recorded == {"gguf_type": file_type, "bits": gguf_blocks.BITS[file_type]}
    else:
        assert recorded == {"gguf_type": MIXED, "bits": MIXED, "types": dict(sorted(layer_types.items()))}
    served = resolve_quantization("auto", model_dir)
    kept = quantized_weights(dense, model_dir, served)
    int4 = quantized_weights(dense, model_dir, 4)
    for name, (module, attr) in dense.projections().items():
        types, reference = served_types(file_type, name), getattr(module, attr)
        weight = kept[name]
        if any(t not in gguf_blocks.BITS for t in types):
            assert (weight.bits, weight.group_size) == (8, reference.shape[1]), name  # int8 per row, at load
            continue
        # The file's values (transformers' dequantized copy): no quantization again at load.
        torch.testing.assert_close(dequantize(weight), reference, rtol=0, atol=1e-6)
        one_type = len(set(types)) == 1
        assert weight.bits == (gguf_blocks.BITS[types[0]] if one_type and name != "lm_head" else 8), name
        # --quantization int4 keeps its meaning: the file's int4 blocks where they are, the rest quantized to int4.
        assert int4[name].bits == (8 if name == "lm_head" else 4), name
        if one_type and gguf_blocks.BITS[types[0]] == 4 and name != "lm_head":
            assert torch.equal(int4[name].qweight, weight.qweight), name
    # Rank 1 of 2 keeps its slice of the same blocks (Q6_K's groups of 16 too): query heads 2-3, KV head 1, MLP
    # columns 256-511 of 512 and vocabulary rows 128-255; o and down take the matching input columns.
    parallel.set_current(TensorParallel(rank=1, size=2, local_rank=1, local_size=2))
    try:
        ours = quantized_weights(load_model(model_dir, torch.float32, torch.device("cpu")), model_dir, served)
    finally:
        parallel.destroy_group()
    q, kv, mlp = list(range(128, 256)), [*range(256 + 64, 256 + 128), *range(384 + 64, 384 + 128)], range(256, 512)
    cuts = {"self_attn.qkv_proj": (0, q + kv), "self_attn.o_proj": (1, q), "down_proj": (1, list(mlp))}
    cuts |= {"gate_up_proj": (0, [*mlp, *(i + 512 for i in mlp)])}
    for name, (dim, index) in ((f"layers.{i}.{n}", cut) for i in (0, 1) for n, cut in cuts.items()):
        if all(t in gguf_blocks.BITS for t in served_types(file_type, name)):
            want = dequantize(kept[name]).index_select(dim, torch.tensor(index))
            assert torch.equal(dequantize(ours[name]), want), name
    assert torch.equal(dequantize(ours["lm_head"]), dequantize(kept["lm_head"])[128:])
    # The untied embedding table is the file's blocks too where its type is kept (the rank's vocabulary rows),
    # looked up from them: the prepared model then holds no dense table.
    if gguf_type_of(file_type, "token_embd") not in gguf_blocks.BITS:
        assert EMBEDDING_TABLE not in kept
        return
    torch.testing.assert_close(dequantize(kept[EMBEDDING_TABLE]), dense.embed_tokens, rtol=0, atol=1e-6)
    assert torch.equal(dequantize(ours[EMBEDDING_TABLE]), dequantize(kept[EMBEDDING_TABLE])[128:])
    dense.prepare_weights(kept)
    assert dense.embed_tokens.numel() == 0 and dense.embed_quantized is kept[EMBEDDING_TABLE]
