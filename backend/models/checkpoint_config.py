"""The model hyper-parameters Spindle needs, read from a Hugging Face ``config.json``."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spindle.shared.model_registry import BUILTIN_MODELS, ModelRegistry

SUPPORTED_ARCHITECTURES = tuple(
    name for name, target in BUILTIN_MODELS.items() if target.startswith("spindle.backend.models.llama:")
)
"""The built-in architectures of the Llama family (the Llama class runs them). The other built-in families have
classes of their own (:data:`~spindle.shared.model_registry.BUILTIN_MODELS`); ``loader.GGUF_ARCHITECTURES`` names
those a GGUF file is converted for (not LLaVA, which GGUF files do not carry)."""

TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""The decoders a ``text_config`` (LLaVA's) may describe, by its ``model_type``: the Llama family."""

# What transformers' config class of each decoder assumes for a field that a text_config omits: real LLaVA
# checkpoints (llava-hf/llava-1.5-7b-hf) write only the fields that differ from these.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 32768,
    },
}

# Families whose configs opt in to their window with use_sliding_window (absent: off), and from which layer on
# (max_window_layers, absent: transformers' default of 28).
_OPT_IN_WINDOWS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Families that slide on all but every n-th layer (sliding_window_pattern) when the config lists no layer_types.
_WINDOW_PATTERNS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "Gemma3ForConditionalGeneration": 6}

# Every architecture's config.json must have these: the KV cache, the sampler and the Llama layers are sized by them.
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class CheckpointConfig:
    """Hyper-parameters of a decoder: a built-in Llama-family one (Llama, Mistral, Qwen2) or a registered one.

    A registered architecture's ``config.json`` needs the standard fields read here (``num_hidden_layers``,
    ``num_attention_heads``, ...): the runner sizes the KV cache from them. Its own fields are in ``hf_config``.

    A vision-language config (LLaVA's) nests its decoder in ``text_config``: the fields here are the decoder's,
    read from there (see :meth:`from_dict`), while ``architecture`` and ``hf_config`` stay those of the whole model.

    Attributes:
        architecture: the Hugging Face class name: a built-in one (:data:`SUPPORTED_ARCHITECTURES`) or one
            registered with :class:`~spindle.shared.model_registry.ModelRegistry`.
        vocab_size: rows of the embedding and the LM head.
        hidden_size: width of the residual stream.
        intermediate_size: width of the MLP.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (``num_heads`` is a multiple of it).
        head_dim: size of one head.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: None for plain RoPE, else a dict with ``rope_type`` and that type's parameters.
        max_position_embeddings: longest context the model was built for.
        tie_word_embeddings: whether the LM head reuses the embedding matrix.
        qkv_bias: whether the q/k/v projections have biases (Qwen2, ``attention_bias``).
        eos_token_ids: every token id that ends generation (config and generation config together).
        bos_token_id: the beginning-of-sequence token, if any.
        dtype: the dtype the checkpoint declares (``"bfloat16"``, ...), if any.
        layer_windows: each layer's attention window (a token attends to that many positions, its own included),
            None for a layer that attends to the whole context.
        hf_config: the whole parsed ``config.json``, for a model class that reads fields of its own (not compared).
        partial_rotary_factor: the share of each head that RoPE rotates (its first ``int(head_dim * factor)``
            dimensions; Phi-4-mini's 0.75); 1 for the whole head.

    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str | None
    layer_windows: list[int | None]
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_dir(cls, path: str | Path) -> "CheckpointConfig":
        """Read ``config.json`` (and ``generation_config.json``, when present, for more eos tokens) from a directory.

        Raises:
            FileNotFoundError: when the directory has no ``config.json``.
            ValueError: when the architecture is neither built in nor registered, or a field the engine needs is
                missing.

        """
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} holds no config.json, so it is not a Hugging Face model directory")
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        return cls.from_dict(json.loads(config_file.read_text()), generation)

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "CheckpointConfig":
        """Build from the parsed ``config.json`` (transformers v4 or v5 layout) and ``generation_config.json``.

        A config with a ``text_config`` (LLaVA's) describes its decoder there: each decoder field comes from the
        ``text_config``, else from the top level (LLaVA writes ``tie_word_embeddings`` there), else from the default
        of the decoder's transformers config class (``model_type``, Llama when absent), as transformers reads it.
        The checkpoint's ``dtype`` is the top level's.

        Raises:
            ValueError: when the architecture is neither built in nor registered, or a field the engine needs is
                missing.

        """
        architectures = config.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(f"unsupported architecture {architectures}: config.json must name exactly one")
        ModelRegistry.get_model_cls_target(architectures[0])  # raises for an unknown one, listing the known ones
        text, text_architecture = _text_part(config, architectures[0])
        missing = [key for key in _REQUIRED_FIELDS if key not in text]
        if missing:
            raise ValueError(f"the config.json of a {architectures[0]} lacks {', '.join(missing)}, which Spindle needs")
        num_heads = text["num_attention_heads"]
        rope_theta, rope_scaling, partial_rotary_factor = _rope(text)
        eos_token_ids: list[int] = []
        for source in (text, generation_config or {}):
            for token in _as_list(source.get("eos_token_id")):
                if token not in eos_token_ids:
                    eos_token_ids.append(token)
        return cls(
            architecture=architectures[0],
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_layers=text["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads") or num_heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=text.get("max_position_embeddings", 2048),
            tie_word_embeddings=text.get("tie_word_embeddings", False),
            qkv_bias=text_architecture == "Qwen2ForCausalLM" or text.get("attention_bias", False),
            eos_token_ids=eos_token_ids,
            bos_token_id=text.get("bos_token_id"),
            dtype=config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype"),
            layer_windows=_layer_windows(text, text_architecture),
            hf_config=config,
            partial_rotary_factor=partial_rotary_factor,
        )


def _text_part(config: dict[str, Any], architecture: str) -> tuple[dict[str, Any], str]:
    """The decoder's fields and architecture name: the config itself, or its ``text_config`` merged as transformers.

    For a nested ``text_config`` a field comes from it, else from the top level, else from
    :data:`_TEXT_DEFAULTS` of its ``model_type`` (``"llama"`` when absent, LLaVA's default). The architecture is
    the text config's own ``architectures`` entry, else the Llama-family class of its ``model_type``.
    """
    text_config = config.get("text_config")
    if text_config is None:
        return config, architecture
    model_type = text_config.get("model_type", "llama")
    top_level = {key: value for key, value in config.items() if key not in ("text_config", "vision_config")}
    text = {**_TEXT_DEFAULTS.get(model_type, {}), **top_level, **text_config}
    text_architectures = text_config.get("architectures") or [TEXT_ARCHITECTURES.get(model_type, model_type)]
    return text, text_architectures[0]


def _layer_windows(config: dict[str, Any], architecture: str) -> list[int | None]:
    """Each layer's window as transformers reads the config: ``layer_types`` when listed, else the family's rule.

    Mistral, Mixtral and Phi-3 slide on every layer when ``sliding_window`` is set; Qwen2/3 only with
    ``use_sliding_window``, from layer ``max_window_layers`` on; Gemma 2/3 on all but every
    ``sliding_window_pattern``-th layer (2, 6).
    """
    window, num_layers = config.get("sliding_window"), config["num_hidden_layers"]
    if window is None or not config.get("use_sliding_window", architecture not in _OPT_IN_WINDOWS):
        return [None] * num_layers
    if config.get("layer_types"):
        return [window if kind == "sliding_attention" else None for kind in config["layer_types"]]
    if architecture in _WINDOW_PATTERNS:
        pattern = config.get("sliding_window_pattern", _WINDOW_PATTERNS[architecture])
        return [window if (i + 1) % pattern else None for i in range(num_layers)]
    first = config.get("max_window_layers", 28) if architecture in _OPT_IN_WINDOWS else 0
    return [window if i >= first else None for i in range(num_layers)]


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """RoPE base, scaling and partial rotary factor from the v5 ``rope_parameters`` or the v4 top-level fields.

    As transformers does, a top-level ``original_max_position_embeddings`` (Phi-3's) wins over the scaling's own,
    and a scaling that needs one and has none gets ``max_position_embeddings``.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    # Gemma 3 in v5 keeps one rope per layer type: the global layers' is the model's (the sliding layers' table is
    # built by its class, spindle.backend.models.gemma).
    params = dict(params.get("full_attention", params))
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    partial = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if rope_type in ("llama3", "yarn", "longrope"):
        original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or config.get("max_position_embeddings", 2048)
    return float(theta), None if rope_type == "default" else {"rope_type": rope_type, **params}, float(partial)


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


@dataclass(frozen=True)
class Shard:
    """The part of a Llama-family model one rank holds.

    Attributes:
        num_heads: its query heads (``num_heads / size``, consecutive from ``rank * num_heads``).
        num_kv_heads: its KV heads: ``num_kv_heads / size`` when they divide, else the one KV head its query heads
            read (``rank * num_kv_heads // size``), replicated on ``size / num_kv_heads`` ranks.
        first_kv_head: the first of its KV heads.
        intermediate_size: its MLP columns (``intermediate_size / size``).
        vocab_size: its rows of the embedding and the LM head: the vocabulary padded to a multiple of ``size``,
            divided by ``size``; the padding rows are zero and their logits are dropped.

    """

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    first_kv_head: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: CheckpointConfig, rank: int, size: int) -> "Shard":
        """Rank ``rank``'s part of a model of ``config`` over ``size`` ranks.

        Raises:
            ValueError: when ``size`` does not split the model: query heads or the intermediate size not divisible
                by it, or KV heads neither divisible by it nor dividing it.

        """
        problems = []
        if config.num_heads % size:
            problems.append(f"its {config.num_heads} query heads are not divisible by {size}")
        if config.num_kv_heads % size and size % config.num_kv_heads:
            problems.append(f"its {config.num_kv_heads} KV heads neither divide by {size} nor divide it")
        if config.intermediate_size % size:
            problems.append(f"its intermediate size {config.intermediate_size} is not divisible by {size}")
        if problems:
            raise ValueError(f"tensor_parallel_size={size} does not fit the model: {'; '.join(problems)}")
        num_kv_heads = max(1, config.num_kv_heads // size)
        return cls(
            rank=rank,
            size=size,
            num_heads=config.num_heads // size,
            num_kv_heads=num_kv_heads,
            first_kv_head=rank * config.num_kv_heads // size if num_kv_heads == 1 else rank * num_kv_heads,
            intermediate_size=config.intermediate_size // size,
            vocab_size=-(-config.vocab_size // size),
        )
