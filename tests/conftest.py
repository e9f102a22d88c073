"""Shared fixtures: tiny random Hugging Face checkpoints saved to disk, to check our model against transformers.

``make_tiny_model(variant)`` saves (once per session) a 2-layer model with random weights and returns its
directory; ``tiny_llama_dir`` is the plain Llama one. The variants cover what the model code branches on:

- ``"llama"``: GQA (4 query heads, 2 KV heads, head size 16), untied LM head.
- ``"llama3_tied"``: Llama 3 rope scaling with ``original_max_position_embeddings=64``, so all three frequency bands
  (kept, interpolated, slowed) occur in a head of 16; tied embeddings.
- ``"qwen2"``: q/k/v biases.
- ``"llama_yarn"``: YaRN rope scaling (factor 4 over an original 64 positions).
- ``"qwen3"``: per-head q/k norms, head size 32 from the config (not hidden / heads = 16).
- ``"phi3"``, ``"phi4_mini"``: fused qkv and gate/up, LongRoPE over an original 32 positions; ``"phi4_mini"`` with
  Phi-4-mini's partial rotary factor 0.75 (head size 32, 24 rotated) and tied embeddings.
- ``"mixtral"``: 8 experts of 32 intermediate features, top-2 routing.
- ``"gemma2"``, ``"gemma3"``: a sliding layer then a global one (window 8), soft-caps, Gemma 3's two rope tables.
- ``"mixtral"``, ``"qwen3_moe"``: 8 experts, top-2; Qwen3-MoE with a dense middle layer and unnormalised weights.
- ``"llama_tp"``: 8 query heads and 2 KV heads (head size 16) and a vocabulary of 254, for tensor parallelism:
  TP=4 replicates the KV heads and pads the vocabulary.
- ``"llama_h128_g4"``, ``"llama_h128_g8"``: head size 128 with one KV head for 4 or 8 query heads, a 4,096-token
  context (the GPU tests' long contexts and big heads).

``tiny_llava_dir`` is a tiny random LLaVA (CLIP vision tower, GELU projector, the tiny Llama as its decoder) with the
byte-level tokenizer, an ``<image>`` token, a chat template that renders image parts, and a CLIP image processor.

Weights are drawn wider than transformers' init (std 0.1, norm weights in [0.5, 1.5], random biases) so that
attention is far from uniform and a wrong norm, bias or rotation changes the logits visibly.
"""

import functools
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn

from spindle.backend.models import load_model
from spindle.backend.models.mixtral import MixtralDecoderLayer
from spindle.kernels import eager, quant
from spindle.kernels.linear import weight_only
from spindle.kernels.moe import Experts, expert_matrix, fused_moe_reference

# Modules are byte-compiled as they are first imported (the venvs are installed with pip's --no-compile), also where
# PYTHONDONTWRITEBYTECODE is set, as on our 2-core test machine: without that, every process the suite starts
# (backends, servers, tensor-parallel workers, the packaging venvs' checks) compiled torch's and transformers' sources
# again, ~3 s a process there. The processes the tests start inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Triton decides once, when it is first imported (transformers imports it early), whether its kernels run compiled
# or in its interpreter; without a GPU the kernel tests run them interpreted on CPU tensors. torch asks the driver
# (importing torch does not import Triton); a binary on PATH, such as nvidia-smi, may be missing where CUDA works.
TEST_DEVICE = os.environ.get("SPINDLE_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
"""The device of the device-side tests (tests/gpu, test_kernels_triton.py): ``SPINDLE_TEST_DEVICE``, else ``cuda``
where there is one. ``cpu`` runs their device side on CPU tensors through Triton's interpreter, even beside a GPU."""
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests import Spindle as installed, as users do (see `make test`). With the repository root on sys.path, as
# `python -m pytest` puts it, transformers' probe for Hugging Face's `kernels` package imports our kernels/ a second
# time, as a top-level `kernels`, and that copy's registration of the spindle::attend op replaces the first one:
# attend() under torch.compile then reads the copy's attention metadata, which nothing sets.
REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO]

# Every test module's tier, a marker for `pytest -m TIER` (the markers in pyproject.toml say what each holds; see
# docs/quickstart.rst, "The tests"), by the heaviest thing one of its tests does. A new module goes in here, or
# the collection fails.
TIERS = {
    "test_block_manager": "unit",
    "test_detokenizer": "unit",
    "test_gc_heap": "unit",
    "test_huge_pages": "unit",
    "test_grammar_closer": "unit",
    "test_image_processor": "unit",
    "test_input_processor": "unit",
    "test_kernels_cpu": "unit",
    "test_sampler": "unit",
    "test_scheduler": "unit",
    "test_shared": "unit",
    "test_tokenizer": "unit",
    "test_random_llama": "unit",  # bench/random_llama.py's tokenizer, read as llama.cpp's convert script reads it
    "test_decode_stack": "engine",
    "test_engine": "engine",
    "test_gemma": "engine",
    "test_gpu_engine": "engine",
    "test_gpu_memory": "engine",
    "test_kernels_triton": "engine",  # one test steps an EngineCore through the decode graphs
    "test_llava_model": "engine",
    "test_lora": "engine",
    "test_lora_staging": "engine",
    "test_memory": "engine",
    "test_model_families": "engine",
    "test_gguf_families": "engine",
    "test_gguf_kquants": "engine",
    "test_gguf_moe": "engine",
    "test_model_parity": "engine",
    "test_moe": "engine",
    "test_priority": "engine",
    "test_sliding_window": "engine",  # kernels, then a Mistral engine against transformers
    "test_smollm2": "engine",
    "test_speculative": "engine",
    "test_prompt_embeds": "process",  # the engine, then one gRPC round trip
    "test_logits_processors": "process",  # the engine against transformers, then one gRPC round trip
    "test_reasoning": "process",  # the parsers, then an engine and a gRPC server with one
    "test_beam_search": "process",  # LLM.beam_search against transformers' num_beams; then over gRPC and the CLI
    "test_transfers": "engine",
    "test_warm_up": "engine",
    "test_data_parallel": "process",
    "test_embeddings": "process",
    "test_grpc": "process",
    "test_vllm_grpc": "process",
    "test_kv_events": "process",
    "test_openai_http": "process",
    "test_server_limits": "process",
    "test_serving_options": "process",  # served names, chat template and generation-config defaults, over servers
    "test_hostile_requests": "process",
    "test_lora_api": "process",
    "test_gateway_metrics": "process",
    "test_gateway": "process",  # spindle serve workers behind the real smg gateway
    "test_model_registry": "process",
    "test_multimodal": "process",
    "test_observability": "process",
    "test_process_split": "process",
    "test_recovery": "process",
    "test_resume": "process",
    "test_structured_output": "process",
    "test_token_restrictions": "process",  # the engine against transformers, then one round trip through the server
    "test_caches": "process",
    "test_cli": "process",  # spindle --help for every command; the client commands against a server
    "test_tensor_parallel": "process",
    "test_tools": "process",  # the parser and schema checks are unit tests; the end-to-end ones start a backend
    "test_device_run": "process",  # runs bench/device_run.py's CPU rehearsal, which starts pytest and an engine
    "test_compose": "deploy",
    "test_deploy": "deploy",
    "test_docs": "deploy",
    "test_packaging": "deploy",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unknown = sorted({item.path.name for item in items if item.path.stem not in TIERS})
    if unknown:
        raise pytest.UsageError(f"{', '.join(unknown)}: no tier; add the module to TIERS in {Path(__file__).name}")
    for item in items:
        item.add_marker(TIERS[item.path.stem])


def _run_line(config: pytest.Config) -> str:
    """The order's seed and the machine's state: what a failed CI run needs to be replayed and read.

    pytest-randomly prints its seed in the header, which -q (``make test``) leaves out; a run cut short by CI's time
    limit prints no summary, so the line goes out at the start too.
    """
    seed = config.getoption("randomly_seed", None)
    order = "file order" if seed is None else f"shuffled with --randomly-seed={seed} (-p no:randomly: file order)"
    disk = shutil.disk_usage(os.environ.get("TMPDIR", "/tmp")).free / 2**30
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    memory = int(meminfo["MemAvailable"].split()[0]) / 2**20
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return f"Tests {order}; {os.cpu_count()} CPUs, load {load}, {memory:.1f} GiB memory and {disk:.1f} GiB disk free."


def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(_run_line(session.config))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    terminalreporter.write_line(_run_line(config))


@pytest.fixture(autouse=True, scope="session")
def cpu_side_without_cpp_kernels() -> Iterator[None]:
    """With ``SPINDLE_TEST_CPU_EAGER=1``, run the CPU side of every test on torch's own ops (``enforce_eager``).

    bench/device_run.py sets it on a machine without ``g++`` or Python's headers, where our C++ kernels cannot
    build: the CPU engines and references then run as ``--enforce-eager`` serves, and the device side is unchanged.
    """
    if os.environ.get("SPINDLE_TEST_CPU_EAGER") != "1":
        yield
        return
    from unittest import mock

    from spindle.kernels import eager
    from spindle.shared.config import EngineConfig

    of = EngineConfig.of.__func__

    def eager_on_cpu(cls: type[EngineConfig], **settings: object) -> EngineConfig:
        return of(cls, **(settings | {"enforce_eager": True} if settings.get("device") == "cpu" else settings))

    with eager(), mock.patch.object(EngineConfig, "of", classmethod(eager_on_cpu)):
        yield


def compute_as_served(reference: nn.Module, served: nn.Module, weights: dict[str, quant.QuantizedWeight]) -> None:
    """Make the unprepared ``reference`` compute, in torch, what ``served``'s quantized projections compute.

    Each projection's weight (a tied lm head's: the embedding table) becomes its dequantized ``weights[name]``; where
    ``served`` quantizes its activations (W8A8: int8 per row on a CPU with VNNI; ``a8_linear`` on AVX2), the reference
    quantizes that projection's activations too (``quant.w8a8_linear``, ``quant.a8_linear``). Quantized experts become
    their dequantized stacks.
    """
    served_projections = served.projections()
    for name, (module, attr) in reference.projections().items():
        key = name.rsplit(".", 1)[-1]  # the lm head's module is the decoder model, which keeps it as "lm_head"
        # A tied lm head's table too: the served embedding looks its rows up in the quantized form.
        getattr(module, attr).data = quant.dequantize(weights[name])
        projection = served_projections[name][0].prepared[key]
        if projection.w8a8 is not None or projection.a8:
            bias = getattr(module, "qkv_bias", None) if attr == "qkv_proj" else None
            reference_linear = quant.w8a8_linear if projection.w8a8 is not None else quant.a8_linear
            module.prepared[key] = functools.partial(reference_linear, weight=weights[name], bias=bias)
    # Quantized experts (Mixtral, Qwen3-MoE): the reference's run their dequantized stacks through the dense op, or,
    # where the served ones quantize their activations (a8_linear's kernel, which keeps its own layout and not the
    # stacks: those come from ``weights``, as layers.N.w13 / .w2), the same stacks one expert at a time in torch.
    layers = zip(getattr(served, "layers", []), getattr(reference, "layers", []), strict=True)
    for i, (served_layer, layer) in enumerate(layers):
        experts = getattr(served_layer, "experts", None)
        if experts is None or not experts.quantized:
            continue
        if experts.activations_quantized:
            with eager():
                layer.experts = QuantizedActivationExperts(weights[f"layers.{i}.w13"], weights[f"layers.{i}.w2"])
            continue
        layer.experts = Experts(
            *(
                torch.stack([expert_matrix(stack, e, torch.float32) for e in range(experts.num_experts)])
                for stack in (experts.w13, experts.w2)
            )
        )


class QuantizedActivationExperts(Experts):
    """Quantized experts run in torch (built within ``eager``) with their activations quantized to int8 as the C++
    op's ``a8_linear`` kernel quantizes them: the reference of experts whose ``activations_quantized``."""

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """:func:`~spindle.kernels.moe.fused_moe_reference` with ``quantize_activations``."""
        return fused_moe_reference(x, self.w13, self.w2, topk_weights, topk_ids, quantize_activations=True)


def quantized_expert_stacks(model_dir: Path, bits: int) -> dict[str, quant.QuantizedWeight]:
    """The expert stacks ``--quantization int{bits}`` serves for a MoE checkpoint, as ``layers.N.w13`` / ``.w2``: each
    layer's own ``MixtralDecoderLayer.prepare_experts``, with float activations so that the stacks are kept as such."""
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    stacks = {}
    for i, layer in enumerate(model.layers):
        if isinstance(layer, MixtralDecoderLayer):
            with weight_only():
                layer.prepare_experts(bits)
            stacks[f"layers.{i}.w13"], stacks[f"layers.{i}.w2"] = layer.experts.w13, layer.experts.w2
    return stacks


TINY_COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_VARIANTS = {
    "llama": ("LlamaConfig", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "llama3_tied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "mistral_window": (
        "MistralConfig",
        {"sliding_window": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
    "llama_tp": (
        "LlamaConfig",
        {
            "hidden_size": 128,
            "num_attention_heads": 8,
            "vocab_size": 254,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "llama_yarn": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # LongRoPE: short factors over the original 32 positions, long ones past them (tests/test_model_families.py).
    "phi3": (
        "Phi3Config",
        {
            "original_max_position_embeddings": 32,
            "sliding_window": None,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
            },
        },
    ),
    # Phi-4-mini's shape: a quarter of each head unrotated (partial_rotary_factor 0.75), tied embeddings.
    "phi4_mini": (
        "Phi3Config",
        {
            "hidden_size": 128,
            "num_attention_heads": 4,
            "tie_word_embeddings": True,
            "original_max_position_embeddings": 32,
            "sliding_window": None,
            "pad_token_id": 0,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + i / 8 for i in range(12)],
                "long_factor": [1.0 + i for i in range(12)],
            },
        },
    ),
    # Mixture-of-experts (tests/test_moe.py): 8 experts, top-2. Qwen3-MoE: a dense middle layer (mlp_only_layers),
    # the top-2 weights not renormalised.
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    # Gemma 2 and 3 (tests/test_gemma.py): a sliding layer then a global one, an 8-token window, an attention scale
    # other than head_dim's, and soft-caps small enough to bite on random weights (Gemma 3: two rope tables).
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 1.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        },
    ),
    **{
        f"llama_h128_g{group}": (
            "LlamaConfig",
            {
                "hidden_size": 128 * group,
                "num_attention_heads": group,
                "num_key_value_heads": 1,
                "max_position_embeddings": 4096,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
        for group in (4, 8)
    },
}


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Return ``save(variant) -> directory`` of a tiny random checkpoint (``config.json`` + safetensors), memoised."""
    saved: dict[str, Path] = {}

    def save(variant: str) -> Path:
        if variant not in saved:
            # Imported here so that test modules that never use these fixtures do not pay for transformers.
            import torch
            import transformers

            config_class, extra = TINY_VARIANTS[variant]
            config = getattr(transformers, config_class)(**{**TINY_COMMON, **extra})
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.uniform_(0.5, 1.5)
                    elif name.endswith("bias"):
                        param.normal_(0.0, 0.1)
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            model.save_pretrained(path)
            saved[variant] = path
        return saved[variant]

    return save


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_model: Callable[[str], Path]) -> Path:
    """Directory of the tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256, fp32)."""
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_llm_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama plus a byte-level tokenizer over its 256-token vocabulary, so text round-trips."""
    return _with_byte_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("tiny-llm"))


@pytest.fixture(scope="session")
def tiny_tp_llm_dir(make_tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``"llama_tp"`` variant (8 query heads, 2 KV heads, vocabulary 254) with the byte-level tokenizer."""
    return _with_byte_tokenizer(make_tiny_model("llama_tp"), tmp_path_factory.mktemp("tiny-tp-llm"))


LLAVA_IMAGE_SIZE = 28
LLAVA_PATCH_SIZE = 7
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2
"""Placeholder tokens per image of the tiny LLaVA: one per patch (the ``default`` strategy drops the CLS token)."""

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random ``LlavaForConditionalGeneration``: CLIP tower (3 layers, hidden 32, 28x28 images of 7x7
    patches, so :data:`LLAVA_IMAGE_TOKENS` tokens an image), GELU projector, the tiny Llama decoder over 257 tokens
    (the byte-level ones and ``<image>``, id 256), with its tokenizer, chat template and CLIP image processor."""
    import transformers

    text = transformers.LlamaConfig(**{**TINY_COMMON, "vocab_size": 257})
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=LLAVA_IMAGE_SIZE,
        patch_size=LLAVA_PATCH_SIZE,
        hidden_act="quick_gelu",
    )
    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=256,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            else:  # wider than the init, biases and layer-norm shifts included, so that every term shows
                param.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("tiny-llava")
    model.save_pretrained(path)
    _with_byte_tokenizer(path, path, extra_tokens=["<image>"], chat_template=LLAVA_CHAT_TEMPLATE)
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": LLAVA_IMAGE_SIZE}, crop_size={"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE}
    )
    processor.save_pretrained(path)
    return path


def _with_byte_tokenizer(
    model_dir: Path, path: Path, extra_tokens: list[str] | None = None, chat_template: str | None = None
) -> Path:
    """Copy ``model_dir`` into ``path`` with a byte-level tokenizer of 256 tokens (eos: the third); returns ``path``.

    ``extra_tokens`` become special tokens numbered from 256 on; ``chat_template`` goes into the tokenizer config.
    """
    if model_dir != path:
        for file in model_dir.iterdir():
            shutil.copy(file, path)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(extra_tokens or [])
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"eos_token": alphabet[2]} | ({"chat_template": chat_template} if chat_template else {})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
