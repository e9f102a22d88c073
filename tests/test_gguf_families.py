"""GGUF files of the families past Llama (Qwen2, Qwen3, Phi-3), loaded by Spindle and by transformers' GGUF reader.

Each test writes a tiny random checkpoint as a GGUF file the way llama.cpp's converter names it (the ``gguf``
package's writer and block quantizers), then serves it: greedy tokens equal transformers' on the same file, with the
file's Q8_0 / Q4_0 blocks kept as they are (the fused Phi-3 ones cut into their parts' rows).
"""

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from conftest import TINY_COMMON, TINY_VARIANTS
from test_lora import MAX_TOKENS, generate, tiny_core
from tokenizers import pre_tokenizers

from spindle.backend.models import load_model, resolve_model
from spindle.backend.models.gguf_blocks import BITS
from spindle.backend.models.interface import CausalLM
from spindle.backend.models.loader import gguf_read_once, quantized_weights
from spindle.kernels import cpu
from spindle.kernels.linear import weight_only
from spindle.kernels.quant import dequantize

GGUF_ARCHITECTURES = {
    "qwen2": ("qwen2", "Qwen2Config"),
    "qwen3": ("qwen3", "Qwen3Config"),
    "phi3": ("phi3", "Phi3Config"),
    "phi4_mini": ("phi3", "Phi3Config"),
    "gemma2": ("gemma2", "Gemma2Config"),
    "gemma3": ("gemma3", "Gemma3TextConfig"),
}
"""Our tiny family -> its llama.cpp architecture and transformers config class (none of them permutes q/k rows)."""

CHECKPOINTS = {
    "phi3": {"pad_token_id": 0},
    "phi4_mini": {"hidden_size": 128, "sliding_window": None, "pad_token_id": 0, "tie_word_embeddings": True},
    "gemma2": {"head_dim": 16, "sliding_window": 8, "tie_word_embeddings": True},
    "gemma3": {"head_dim": 16, "sliding_window": 8, "tie_word_embeddings": True, "num_hidden_layers": 6},
}
"""The checkpoints' fields past ``TINY_COMMON`` (untied embeddings unless given) that a file carries through
transformers' reader: Gemma files have no output matrix, and Gemma 3's six layers are five sliding then a global
one, the pattern its files imply."""

FILE_FIELDS = {
    "qwen2": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "qwen3": {"head_dim": 32, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    "phi3": {"sliding_window": 8},
    "phi4_mini": {  # conftest's Phi-4-mini rope, its original length at the top level too, where Phi-3's wins
        "original_max_position_embeddings": 32,
        "rope_parameters": {**TINY_VARIANTS["phi4_mini"][1]["rope_parameters"], "original_max_position_embeddings": 32},
    },
    "gemma2": {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 1.5},
    "gemma3": {
        "query_pre_attn_scalar": 16,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    },
}
"""The checkpoints' fields that a file holds (or, for ``query_pre_attn_scalar``, implies as llama.cpp reads it) and
transformers' reader leaves at its defaults: a YaRN (Qwen2) or linear (Qwen3) rope scaling, Qwen3's head size (its
default is 128), Phi-3's sliding window,
Phi-4-mini's rotary share and LongRoPE factors, Gemma 2's soft-caps (small enough to bite on random weights) and
Gemma 3's rope scaling. The conversion reads them from the file; transformers is given them to compare with."""


GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
"""llama.cpp's Gemma architectures: their norms are stored as the ``1 + w`` they multiply by (transformers' reader
subtracts the 1), with the head size, window and (Gemma 2) soft-caps in the metadata."""


Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType]]
"""A GGUF matrix's name and float32 values -> its raw blocks and their type, as :func:`write_gguf` stores it."""


def quantized_as(qtype: gguf.GGMLQuantizationType) -> Encoder:
    """The checkpoint's projections quantized in ``qtype`` blocks, the embedding and output matrices in Q8_0 (as
    published files keep them at 6 bits or more), by the ``gguf`` package's block quantizers."""

    def encode(name: str, data: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        kind = qtype if name.startswith("blk.") else gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(data, kind), kind

    return encode


def write_gguf(
    model_dir: Path, architecture: str, path: Path, encode: Encoder, held: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write the checkpoint in ``model_dir`` as a GGUF of ``architecture``: its matrices as ``encode`` gives them
    (by their GGUF names), the norms and MoE routers in float32, and a byte-level vocabulary of its 256 tokens.

    As llama.cpp's converter does, a ``llama`` file's q and k rows are permuted for its rotary, a mixture of experts
    says its expert counts, and transformers v5's fused ``gate_up_proj`` experts (``save_original_format=False``)
    are written as the ``ffn_gate_exps`` and ``ffn_up_exps`` stacks. ``held``, when given, receives the values the
    file holds by the checkpoint's names (``gguf``'s dequantization of what was written, in the checkpoint's order).
    """
    config = transformers.AutoConfig.from_pretrained(model_dir)
    tensors = safetensors.torch.load_file(model_dir / "model.safetensors")
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Gemma 3's rope is per layer type: the file holds the global layers' (the local base is llama.cpp's 10,000).
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_dimension_count(int(head_size * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope["rope_type"] == "llama3":  # a divisor of each frequency, as llama.cpp's converter writes it
        writer.add_tensor("rope_freqs.weight", llama3_divisors(head_size, rope))
    if rope["rope_type"] == "longrope":  # Phi-3's factors as tensors, as llama.cpp's converter writes them
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    if getattr(config, "head_dim", None):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    gemma = architecture in GEMMA_ARCHITECTURES
    if (gemma or architecture == "phi3") and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
        if architecture == "gemma2":
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()))
    writer.add_token_types([gguf.TokenType.NORMAL] * config.vocab_size)
    writer.add_token_scores([0.0] * config.vocab_size)  # no merges: transformers derives none from single bytes
    writer.add_bos_token_id(TINY_COMMON["bos_token_id"])
    writer.add_eos_token_id(TINY_COMMON["eos_token_id"])
    writer.add_pad_token_id(0)  # else Phi-3's config default, 32000, past the vocabulary
    arch = next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in tensors.items():
        parts = [(hf_name, tensor.float())]
        if hf_name.endswith(".gate_up_proj"):
            gate, up = tensor.float().chunk(2, dim=1)
            parts = [
                (hf_name.replace("gate_up_proj", "gate_proj"), gate),
                (hf_name.replace("gate_up_proj", "up_proj"), up),
            ]
        values = []
        for part_name, part in parts:
            name = names.get_name(part_name, try_suffixes=(".weight", ".bias"))
            assert name is not None, part_name
            name = name if name.endswith((".weight", ".bias")) else f"{name}.weight"
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
                name.split(".")[-2]
            )
            data = part.numpy()
            if heads is not None and architecture == "llama":
                data = rotary_permuted(data, heads)
            if data.ndim >= 2 and "ffn_gate_inp" not in name:
                blocks, kind = encode(name, data)
                writer.add_tensor(name, blocks, raw_dtype=kind)
                data = gguf.quants.dequantize(blocks, kind)
            elif gemma and name.endswith("norm.weight"):
                writer.add_tensor(name, data + 1)  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
            else:
                writer.add_tensor(name, data)
            if heads is not None and architecture == "llama":
                data = rotary_permuted(data, heads, inverse=True)
            values.append(torch.from_numpy(data.copy()))
        if held is not None:
            held[hf_name] = torch.cat(values, dim=1) if len(values) > 1 else values[0]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_divisors(head_size: int, rope: dict) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a ``llama3`` rope scaling: by what each rotary frequency is divided."""
    frequencies = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    wavelengths = 2 * math.pi / frequencies
    original, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (original / wavelengths - low) / (high - low)
    divisors = torch.where(wavelengths > original / low, rope["factor"], 1 / ((1 - smooth) / rope["factor"] + smooth))
    return torch.where(wavelengths < original / high, 1.0, divisors).numpy().astype(np.float32)


def rotary_permuted(rows: np.ndarray, heads: int, inverse: bool = False) -> np.ndarray:
    """q or k rows in llama.cpp's order for its rotary (each head's two halves interleaved), or back (``inverse``)."""
    split = (heads, 2, rows.shape[0] // heads // 2) if not inverse else (heads, rows.shape[0] // heads // 2, 2)
    return rows.reshape(*split, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.fixture(scope="module")
def gguf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``save(family) -> directory`` of a tiny random checkpoint of the family that a GGUF file can describe."""
    saved: dict[str, Path] = {}

    def save(family: str) -> Path:
        if family not in saved:
            config_class = GGUF_ARCHITECTURES[family][1]
            # Copies: transformers' configs rewrite the rope dicts they are given.
            extra = copy.deepcopy(
                {"tie_word_embeddings": False, **CHECKPOINTS.get(family, {}), **FILE_FIELDS.get(family, {})}
            )
            config = getattr(transformers, config_class)(**{**TINY_COMMON, **extra})
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.uniform_(0.5, 1.5)
            path = tmp_path_factory.mktemp(f"gguf-{family}")
            model.save_pretrained(path)
            saved[family] = path
        return saved[family]

    return save


def tokens_of_both(
    file: Path,
    monkeypatch: pytest.MonkeyPatch,
    reference: transformers.PreTrainedModel | None = None,
    read_as: dict[str, object] | None = None,
) -> tuple[list[list[int]], list[list[int]], CausalLM, Path]:
    """transformers' greedy tokens on ``file`` and Spindle's (``--quantization auto``) on three random prompts, then
    Spindle's dense model and the directory it converted the file into, under a cache beside the file.

    transformers' model is its GGUF reader's (with the config fields ``read_as`` where its reader drops what the
    file holds), unless a ``reference`` model is given. Spindle's projections run
    weight-only, their activations float as transformers' are: the default, int8 activations, is checked against
    its own reference (test_model_families' quantized tokens).
    """
    cpu.cpu_ops()  # the C++ kernels from the usual cache, not built again (minutes) into the file's
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(file.parent / "cache"))
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (22, 5, 17)]
    read_as = copy.deepcopy(read_as or {})  # transformers' configs rewrite the rope dicts they are given
    if reference is None:
        with gguf_read_once(file):
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, dtype=torch.float32, **read_as
            ).eval()
    kwargs = dict(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    with torch.inference_mode():
        expected = [reference.generate(torch.tensor([ids]), **kwargs)[0, len(ids) :].tolist() for ids in prompts]

    model_dir = resolve_model(file)
    dense = load_model(model_dir, torch.float32, torch.device("cpu"))
    with weight_only():
        core = tiny_core(model_dir, quantization="auto", max_num_batched_tokens=16)
    got, _ = generate(core, [(ids, None) for ids in prompts])
    return expected, got, dense, model_dir


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("family", GGUF_ARCHITECTURES)
def test_gguf_tokens_match_transformers_reader(
    family: str,
    qtype: str,
    gguf_checkpoint: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The file's blocks served as they are (``--quantization auto`` reads their bits from the conversion) give
    transformers' greedy tokens on the same file."""
    file = write_gguf(
        gguf_checkpoint(family),
        GGUF_ARCHITECTURES[family][0],
        tmp_path / f"{family}.gguf",
        quantized_as(gguf.GGMLQuantizationType[qtype]),
    )
    expected, got, dense, model_dir = tokens_of_both(file, monkeypatch, read_as=FILE_FIELDS.get(family))
    kept = quantized_weights(dense, model_dir, BITS[qtype])

    assert got == expected
    # What the file holds and transformers' reader drops is in the conversion.
    converted = json.loads((model_dir / "config.json").read_text())
    written = FILE_FIELDS.get(family, {})
    assert {key: converted[key] for key in written} == written
    # Every projection is the file's blocks (transformers' dequantized copy, to rounding), the fused Phi-3 ones and
    # the Q8_0 lm head included: none was quantized again at load.
    for name, (module, attr) in dense.projections().items():
        torch.testing.assert_close(dequantize(kept[name]), getattr(module, attr), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("family", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_gemma_file_of_the_27b_depth_scales_attention_as_llama_cpp(
    family: str, layers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Gemma file as deep as the 27B model (llama.cpp's sign of it) converts with ``query_pre_attn_scalar`` =
    hidden / heads, as llama.cpp scales its scores; a shallower one with the head size."""
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    scalars = {}
    for depth in (layers, 2):
        config = getattr(transformers, GGUF_ARCHITECTURES[family][1])(
            **{**TINY_COMMON, "num_hidden_layers": depth, "head_dim": 32, "tie_word_embeddings": True}
        )
        model_dir = tmp_path / f"{family}-{depth}"
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        file = write_gguf(model_dir, family, model_dir / "model.gguf", quantized_as(gguf.GGMLQuantizationType.Q8_0))
        scalars[depth] = json.loads((resolve_model(file) / "config.json").read_text())["query_pre_attn_scalar"]

    assert scalars == {layers: TINY_COMMON["hidden_size"] // TINY_COMMON["num_attention_heads"], 2: 32}


def test_llama3_rope_scaling_from_the_files_frequency_divisors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama 3.1+ file holds its ``llama3`` rope scaling only as ``rope_freqs`` (a divisor of each frequency),
    which transformers' reader drops: Spindle serves those frequencies, and its greedy tokens are transformers' given
    the checkpoint's own scaling (short, middle and long wavelengths all present at a head size of 16)."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = transformers.LlamaConfig(**TINY_COMMON, rope_parameters=copy.deepcopy(rope))
    torch.manual_seed(0)
    model_dir = tmp_path / "llama31"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    file = write_gguf(model_dir, "llama", tmp_path / "llama31.gguf", quantized_as(gguf.GGMLQuantizationType.Q8_0))

    expected, got, _, model_dir = tokens_of_both(file, monkeypatch, read_as={"rope_parameters": rope})

    assert got == expected
    converted = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
    divisors = llama3_divisors(16, rope).tolist()
    assert (converted["rope_type"], converted["short_factor"], converted["long_factor"]) == (
        "longrope",
        divisors,
        divisors,
    )
