"""The decode step's layers in one C++ call (``DecodeStack``) against the Python layers: the same tokens, the same
log-probabilities, bit for bit."""

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import _with_byte_tokenizer
from test_gguf_families import write_gguf
from test_gguf_kquants import kquant_checkpoint, random_blocks_of  # noqa: F401 - the fixture

from spindle import LLM, SamplingParams
from spindle.backend.models.llama import LlamaForCausalLM
from spindle.kernels import cpu, linear

PROMPTS = [[3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate([5, 17, 40])]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)


def tiny_llm(model: Path, quantization: str, dtype: str = "float32") -> LLM:
    """An ``LLM`` of a tiny checkpoint or GGUF file, without the prefix cache (a second run computes what the first
    did, not from its cached blocks)."""
    return LLM(str(model), dtype=dtype, quantization=quantization, kv_cache_memory="4MiB", enable_prefix_caching=False)


def generate(llm: LLM) -> list[list[tuple[int, dict[int, float]]]]:
    """Each prompt's tokens, each with its top log-probabilities."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        [(t, {k: lp.logprob for k, lp in top.items()}) for t, top in zip(c.token_ids, c.logprobs, strict=True)]
        for c in (o.outputs[0] for o in outputs)
    ]


def q4_k_m_file(checkpoint: Path, directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """test_gguf_kquants' tiny Llama as a GGUF of llama.cpp's Q4_K_M types (layer 0's v rows Q6_K beside Q4_K q and
    k rows)."""
    cpu.cpu_ops()  # the C++ kernels from the usual cache, not built again into the file's
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(directory / "cache"))
    return write_gguf(checkpoint, "llama", directory / "Q4_K_M.gguf", random_blocks_of("Q4_K_M"))


CASES = {
    "llama": ("int4", "float32"),
    "qwen2": ("int4", "float32"),
    "mistral_window": ("int4", "float32"),
    "mixtral": ("int4", "float32"),
    "q4_k_m_file": ("auto", "float32"),
    "llama_bf16": ("none", "bfloat16"),
    "mixtral_bf16": ("none", "bfloat16"),
    "llama_fp32": ("none", "float32"),
    "mixtral_fp32": ("none", "float32"),
    "llama_fp32_unpacked": ("none", "float32"),
}
"""Each case's model, quantization and dtype: int4 runs ``a8_linear`` on every AVX2 CPU (Mixtral's experts too, through
``fused_moe_a8``), bf16 ``bf16_linear``'s tiles
(and the fused experts' tiles) on AVX-512 bf16, float32 oneDNN's packed weights (and the experts' float tiles), or
ATen's linear over the plain weights where oneDNN does not run them (the ``_unpacked`` case)."""


@pytest.mark.parametrize("case", list(CASES))
def test_the_decode_stack_gives_the_python_layers_results(
    case: str,
    make_tiny_model: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """A batch of three sequences: int4 weights, with a qkv bias (Qwen2), decoding past a 24-token window (Mistral),
    int4 experts (Mixtral), a K-quant file whose fused qkv has parts of two layouts; bf16 and float32 weights, dense
    and a mixture of experts."""
    quantization, dtype = CASES[case]
    runs = cpu.a8_linear_supported() if quantization != "none" else dtype == "float32" or cpu.bf16_linear_supported()
    if not runs:
        pytest.skip(f"{case}'s kernels do not run on this CPU")
    if case == "q4_k_m_file":
        model_path = q4_k_m_file(request.getfixturevalue("kquant_checkpoint"), tmp_path, monkeypatch)
    else:
        model_path = _with_byte_tokenizer(make_tiny_model(case.split("_fp32")[0].removesuffix("_bf16")), tmp_path)
    if case.endswith("_unpacked"):
        monkeypatch.setattr(linear, "can_pack", lambda weight: False)
    llm = tiny_llm(model_path, quantization, dtype)
    model = llm.llm_engine.engine_core.runner.model
    if quantization != "none":
        parts = len(model.layers[0].self_attn.prepared["qkv_proj"].a8_parts)
        assert parts == (2 if case == "q4_k_m_file" else 1)
        experts = getattr(model.layers[0], "experts", None)
        assert experts is None or experts.activations_quantized
    if case.endswith("_unpacked"):
        assert model.layers[0].self_attn.prepared["qkv_proj"].dense is not None
    stacked = generate(llm)
    assert model._stack is not None  # the decode steps ran it

    monkeypatch.setattr(LlamaForCausalLM, "_decode_stack", lambda self, kv_caches: None)
    assert generate(llm) == stacked


def test_a_family_with_layers_of_its_own_runs_its_python_layers(
    make_tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen3's per-head q/k norms are not the stack's maths: its layers run themselves."""
    llm = tiny_llm(_with_byte_tokenizer(make_tiny_model("qwen3"), tmp_path), "int4")
    generate(llm)
    assert llm.llm_engine.engine_core.runner.model._stack is None
