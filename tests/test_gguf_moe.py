"""GGUF mixture-of-experts files (Mixtral as llama.cpp writes it, Qwen3-MoE) served with their experts' blocks kept.

Each test writes a tiny random MoE checkpoint as a GGUF file the way llama.cpp's converter lays it out (a Mixtral is
architecture ``llama`` with expert counts; every layer's experts are ``[experts, out, in]`` stacks), in float32, in
Q8_0 blocks (``gguf``'s quantizer) or in random K-quant blocks, then serves it with ``--quantization auto``.

transformers' GGUF reader maps a Qwen3-MoE file but not its experts' intermediate size (``moe_intermediate_size``
stays at its default) nor its rope scaling, and reads a Mixtral file as a dense Llama without experts; so the
reference of a Qwen3-MoE file is transformers' reader given those, and of a Mixtral file transformers' Mixtral
holding the values the file holds (``gguf``'s dequantization of what was written).
"""

import copy
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_COMMON
from test_gguf_families import Encoder, tokens_of_both, write_gguf
from test_gguf_kquants import LAYOUTS, random_blocks
from test_moe import A8_TOLERANCES, TOLERANCES

from spindle.backend import parallel
from spindle.backend.models import gguf_blocks, load_model, resolve_model
from spindle.backend.models.checkpoint_config import CheckpointConfig
from spindle.backend.models.loader import (
    _runs_as_experts,
    _stacked,
    gguf_read_once,
    quantized_weights,
    resolve_quantization,
)
from spindle.backend.models.mixtral import MixtralDecoderLayer
from spindle.backend.parallel import TensorParallel
from spindle.kernels import force_triton
from spindle.kernels.moe import Experts, fused_moe_reference, route
from spindle.kernels.quant import QuantizedWeight, dequantize

MOE_COMMON = {**TINY_COMMON, "hidden_size": 256, "tie_word_embeddings": False, "num_experts_per_tok": 2}
"""Matrices of whole K-quant super-blocks (256 inputs), 4 heads of 64, untied."""

QWEN3_MOE_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
"""The tiny Qwen3-MoE's rope: YaRN past a 16-token training length, as a long-context Qwen3-MoE file holds it (which
transformers' reader drops: its reference is given it)."""

FAMILIES = {
    "mixtral": (
        "llama",
        transformers.MixtralConfig,
        {
            "intermediate_size": 256,
            "num_local_experts": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "qwen3_moe": (
        "qwen3moe",
        transformers.Qwen3MoeConfig,
        {
            "head_dim": 64,
            "num_experts": 4,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "rope_parameters": QWEN3_MOE_ROPE,
        },
    ),
}
"""Our tiny family -> its llama.cpp architecture, transformers config class and fields. llama.cpp's Qwen3-MoE
renormalises the top-k weights (transformers' reader says ``norm_topk_prob``) and has experts in every layer."""

FILE_TYPES = {
    "F32": {},
    "Q8_0": {"": "Q8_0"},
    "Q4_K_M": {"": "Q4_K", "blk.0.ffn_down_exps": "Q6_K", "output": "Q6_K"},
    "Q5_K_M": {"": "Q5_K", "blk.0.ffn_down_exps": "Q6_K", "blk.1.ffn_up_exps": "Q6_K", "output": "Q6_K"},
    "Q5_1": {"": "Q5_1"},
}
"""Each file's types: of every matrix (``""``), and of those whose GGUF name is another key; none: float32. A
Q4_K_M's and a Q5_K_M's first layer's down experts are Q6_K (int8 per 16 inputs) beside int4, resp. int8 with offsets
(Q5_K, Q5_1); the Q5_K_M's second layer has Q6_K up experts beside Q5_K gate ones, which its ``w13`` stack holds
widened to int8 with offsets per 16 inputs."""

ROLES = {"ffn_gate_exps": ("w13", 0), "ffn_up_exps": ("w13", 1), "ffn_down_exps": ("w2", 0)}
"""A GGUF expert stack -> the Spindle stack it goes into and its part there (gate rows, then up rows)."""


def gguf_type(file_type: str, name: str) -> str | None:
    """The GGUF type of the matrix ``name`` (``blk.0.ffn_down_exps``, ``output``) in a file of ``file_type``."""
    types = FILE_TYPES[file_type]
    return types.get(name, types.get(""))


def encoder(file_type: str) -> Encoder:
    """Each matrix in its type's blocks: Q8_0 by ``gguf``'s quantizer, K-quants random ones, float32 as it is."""

    def encode(name: str, data: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        kind = gguf_type(file_type, name.removesuffix(".weight"))
        if kind is None:
            return data, gguf.GGMLQuantizationType.F32
        if kind == "Q8_0":
            return gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        rows = data.reshape(-1, data.shape[-1])
        blocks = random_blocks(kind, *rows.shape, seed=zlib.crc32(name.encode()))
        return blocks.reshape(*data.shape[:-1], -1), gguf.GGMLQuantizationType[kind]

    return encode


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's tiny random checkpoint, saved with transformers v5's fused expert stacks."""
    saved = {}
    for family, (_, config_class, fields) in FAMILIES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            config_class(**copy.deepcopy({**MOE_COMMON, **fields})), dtype=torch.float32
        )
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
        saved[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(saved[family], save_original_format=False)
    return saved


def reference_of(
    family: str, checkpoint: Path, file: Path, held: dict[str, torch.Tensor]
) -> transformers.PreTrainedModel:
    """transformers' model of the file: its GGUF reader's (Qwen3-MoE, given the experts' size and the rope its reader
    does not map), else its Mixtral holding the file's values."""
    if family == "qwen3_moe":
        with gguf_read_once(file):
            config = transformers.AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
            config.moe_intermediate_size = FAMILIES[family][2]["moe_intermediate_size"]
            config.rope_parameters = copy.deepcopy(QWEN3_MOE_ROPE)
            return transformers.AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, config=config, dtype=torch.float32
            ).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.load_state_dict(held)
    return model


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_moe_serves_its_experts_blocks(
    family: str, file_type: str, moe_checkpoint: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file converts to its MoE family and gives transformers' greedy tokens; under ``--quantization auto``
    each layer's experts are the file's blocks, stacked, every kept type's as it is stored (the CPU's fused MoE op
    runs them all), and the prepared model holds no dense copy of them. A tensor-parallel rank keeps its share of
    every expert's intermediate dimension from the same blocks."""
    held: dict[str, torch.Tensor] = {}
    architecture = FAMILIES[family][0]
    file = write_gguf(moe_checkpoint[family], architecture, tmp_path / f"{family}.gguf", encoder(file_type), held)

    expected, got, dense, model_dir = tokens_of_both(
        file, monkeypatch, reference_of(family, moe_checkpoint[family], file, held)
    )

    assert got == expected
    config = CheckpointConfig.from_dir(model_dir)
    assert config.architecture == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    served = resolve_quantization("auto", model_dir)
    if served is None:
        assert file_type == "F32"
        return
    kept = quantized_weights(dense, model_dir, served)
    from_file = set()
    for tensor in gguf.GGUFReader(file).tensors:
        role = ROLES.get(tensor.name.split(".")[-2])
        if role is None:
            continue
        name, part = f"layers.{tensor.name.split('.')[1]}.{role[0]}", role[1]
        from_file.add(name)
        file_values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        rows = file_values.shape[1]
        ours = experts_values(kept[name])[:, part * rows : (part + 1) * rows]
        torch.testing.assert_close(ours, file_values, rtol=0, atol=1e-6)
    # Rank 1 of 2: every expert's gate and up rows 128-255 and down columns 128-255 of the same blocks.
    assert from_file == {f"layers.{i}.{stack}" for i in range(len(dense.layers)) for stack in ("w13", "w2")}
    parallel.set_current(TensorParallel(rank=1, size=2, local_rank=1, local_size=2))
    try:
        ours = quantized_weights(load_model(model_dir, torch.float32, torch.device("cpu")), model_dir, served)
    finally:
        parallel.destroy_group()
    half = torch.arange(128, 256)
    for name in from_file:
        dim, index = (2, half) if name.endswith("w2") else (1, torch.cat([half, half + 256]))
        assert torch.equal(experts_values(ours[name]), experts_values(kept[name]).index_select(dim, index)), name
    # The prepared model runs the stacks alone, copied into one block on huge pages (spindle.kernels.huge_pages).
    dense.prepare_weights(kept)
    blocks = set()
    for i, layer in enumerate(dense.layers):
        assert isinstance(layer, MixtralDecoderLayer)
        assert layer.w13.numel() == 0 and layer.w2.numel() == 0
        # What the op reads (the stacks, or a8_pack's layout of them) is what the file's blocks give.
        given = Experts(kept[f"layers.{i}.w13"], kept[f"layers.{i}.w2"])
        pairs = zip(layer.experts.kernel_tensors(), given.kernel_tensors(), strict=True)
        assert layer.experts.kernel_tensors() and all(torch.equal(mine, theirs) for mine, theirs in pairs)
        blocks |= {tensor.untyped_storage().data_ptr() for tensor in layer.experts.kernel_tensors()}
    assert len(blocks) == 1


def experts_values(stack: QuantizedWeight) -> torch.Tensor:
    """The float ``[experts, out, in]`` values of a quantized stack of experts."""
    return torch.stack([dequantize(stack.select(e)) for e in range(stack.qweight.shape[0])])


def test_a_file_that_says_it_has_experts_but_stacks_none_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``llama`` file with ``expert_count`` whose layers hold dense MLPs (or experts one by one, as llama.cpp's
    early Mixtral files) fails its conversion, naming what is missing, instead of converting into a broken entry."""
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.LlamaConfig(**TINY_COMMON, num_local_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    file = write_gguf(tmp_path / "llama", "llama", tmp_path / "llama.gguf", encoder("F32"))

    with pytest.raises(ValueError, match=r"layer 0 lacks stacked ones: \['blk.0.ffn_gate_inp.weight'"):
        resolve_model(file)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("gguf_type", list(LAYOUTS))
def test_the_fused_moe_op_runs_the_stacks_the_loader_keeps(gguf_type: str, path: str) -> None:
    """Every kept type's expert stacks are served as they are to the fused MoE op of either device, which runs them
    (the C++ op on the CPU, the Triton grouped GEMM, interpreted here, on CUDA) as the per-expert torch loop does."""
    experts, hidden, intermediate = 4, 256, 256
    w13, w2 = (
        _stacked(
            gguf_blocks.decode(gguf_type, torch.from_numpy(random_blocks(gguf_type, experts * rows, inputs, seed))),
            experts,
        )
        for rows, inputs, seed in ((2 * intermediate, hidden, 1), (hidden, intermediate, 2))
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, hidden, generator=generator)
    topk_weights, topk_ids = route(torch.randn(7, experts, generator=generator), 2)
    device = torch.device("cuda" if path == "triton" else "cpu")
    assert _runs_as_experts(w13, device) and _runs_as_experts(w2, device)
    with force_triton(path == "triton"):
        experts = Experts(w13, w2)
        out = experts(x, topk_weights, topk_ids)
    quantized = experts.activations_quantized  # int8 activations on the CPU, as the reference then quantizes them
    expected = fused_moe_reference(x, w13, w2, topk_weights, topk_ids, quantize_activations=quantized)
    torch.testing.assert_close(out, expected, **(A8_TOLERANCES if quantized else TOLERANCES)[torch.float32])
