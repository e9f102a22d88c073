"""Qwen3, Phi-3/4-mini and the rope scalings against transformers: cos/sin tables, configs, greedy tokens, LoRA.

The logits of each family over the paged cache (every schedule, kernels and eager) and its quantized projections are
checked by tests/test_model_parity.py, parametrized over these families' tiny checkpoints too.
"""

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_COMMON, TINY_VARIANTS, _with_byte_tokenizer, compute_as_served, quantized_expert_stacks
from test_lora import ALL_TARGETS, MAX_TOKENS, generate, peft_greedy, peft_model, save_random_adapter, tiny_core
from tokenizers import Tokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from spindle.backend.engine_core import EngineCore
from spindle.backend.models import CheckpointConfig, load_model
from spindle.backend.models.loader import quantized_weights
from spindle.kernels import build_cos_sin_cache, force_triton
from spindle.kernels.linear import MAX_QUANTIZED_TOKENS
from spindle.shared import SamplingParams
from spindle.shared.outputs import TokenLogprobs
from spindle.shared.protocol import EngineRequest
from spindle.shared.sampling_params import StructuredOutput

FAMILIES = ["llama", "mistral_window", "qwen3", "phi3", "phi4_mini", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
"""A tiny checkpoint of every family served (Mistral's with a 24-token window, which the prompts pass)."""

# Each rope type with the parameters of a model that uses it, on the tiny model's shape (head size 16, 512 positions).
ROPE_CASES = {
    "linear": ("LlamaConfig", {"rope_type": "linear", "factor": 4.0}),
    "dynamic": ("LlamaConfig", {"rope_type": "dynamic", "factor": 2.0}),
    "llama3": TINY_VARIANTS["llama3_tied"],
    "yarn": TINY_VARIANTS["llama_yarn"],
    # DeepSeek's attention factor from mscale / mscale_all_dim, other ramp bounds, no truncation.
    "yarn_mscale": (
        "LlamaConfig",
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.9,
            "mscale_all_dim": 0.7,
            "truncate": False,
        },
    ),
    "longrope": TINY_VARIANTS["phi3"],
    "longrope_partial": TINY_VARIANTS["phi4_mini"],
}
POSITIONS = (0, 1, 7, 23, 24, 25, 31, 32, 63, 64, 100, 511)  # both sides of every original length above


def _hf_config(case: str) -> transformers.PreTrainedConfig:
    config_class, extra = ROPE_CASES[case]
    if "rope_parameters" not in extra:  # a bare scaling: on the Llama variant's base
        extra = {"rope_parameters": {"rope_theta": 10000.0, **extra}}
    config = getattr(transformers, config_class)(**{**TINY_COMMON, **extra})
    config.architectures = [config_class.removesuffix("Config") + "ForCausalLM"]
    return config


@pytest.mark.parametrize("case", ROPE_CASES)
def test_cos_sin_cache_matches_transformers(case: str) -> None:
    """Our table, built from the config as Spindle reads it, holds at each position transformers' cos and sin.

    Those are ``ROPE_INIT_FUNCTIONS``' frequencies and attention factor for a sequence that ends at that position:
    what transformers rotates a token by as it decodes it (longrope's short factors, then its long ones).
    """
    hf_config = _hf_config(case)
    config = CheckpointConfig.from_dict(hf_config.to_dict())
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    cache = build_cos_sin_cache(rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
    init = ROPE_INIT_FUNCTIONS[hf_config.rope_parameters["rope_type"]]
    assert cache.shape == (config.max_position_embeddings, rotary_dim)
    factors = set()
    for position in POSITIONS:
        inv_freq, attention_factor = init(hf_config, "cpu", seq_len=position + 1)
        angles = position * inv_freq
        torch.testing.assert_close(cache[position], torch.cat((angles.cos(), angles.sin())) * attention_factor)
        factors.add(attention_factor)
    assert (factors != {1.0}) == (case.startswith(("yarn", "longrope")))


def test_phi3_configs_read_in_both_transformers_layouts(make_tiny_model: Callable[[str], Path]) -> None:
    """Phi-3's published configs (v4): ``rope_scaling`` with ``type``, ``original_max_position_embeddings`` and
    ``partial_rotary_factor`` at the top level; transformers v5 saves them inside ``rope_parameters``."""
    v5 = json.loads((make_tiny_model("phi4_mini") / "config.json").read_text())
    rope = v5["rope_parameters"]
    v4 = {key: value for key, value in v5.items() if key != "rope_parameters"}
    v4 |= {
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "original_max_position_embeddings": rope["original_max_position_embeddings"],
        "rope_scaling": {"type": "longrope", "long_factor": rope["long_factor"], "short_factor": rope["short_factor"]},
    }
    assert CheckpointConfig.from_dict(v4) == CheckpointConfig.from_dict(v5)
    config = CheckpointConfig.from_dict(v4)
    assert (config.partial_rotary_factor, config.rope_scaling["original_max_position_embeddings"]) == (0.75, 32)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Random prompts of 22, 5, 17 and 9 tokens; the longer two are prefilled over two 16-token steps.

    With their completions they stay within the Phi-3 variants' original 32 positions: past them transformers
    recomputes the whole sequence with LongRoPE's long factors, which a paged cache does not (see the models page).
    """
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (22, 5, 17, 9)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], **load: object) -> list[list[int]]:
    """transformers' greedy :data:`~test_lora.MAX_TOKENS` tokens after each prompt, run alone (``load``: more
    ``from_pretrained`` arguments)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).eval()
    kwargs = dict(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), **kwargs)[0, len(ids) :].tolist() for ids in prompts]


@pytest.mark.parametrize("variant", [*FAMILIES, "llama_yarn"])
def test_greedy_tokens_match_transformers_in_one_batch_with_chunked_prefill(
    variant: str, make_tiny_model: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """All prompts queued at once, 16-token steps: prefill chunks and decodes share steps. Run again, the prompts'
    full blocks come from the prefix cache."""
    model_dir = make_tiny_model(variant)
    core = tiny_core(model_dir, max_num_batched_tokens=16)
    jobs = [(ids, None) for ids in prompts]

    got, _ = generate(core, jobs)
    again, cached = generate(core, jobs)

    assert got == again == hf_greedy(model_dir, prompts)
    assert [n > 0 for n in cached] == [len(ids) > core.config.cache.block_size for ids in prompts]


@pytest.mark.parametrize(
    ("variant", "targets"),
    # Phi-3's checkpoints fuse q/k/v and gate/up: one A for each fused module, its B's rows cut into the parts.
    # Mixtral's experts are no projections of ours: adapters of its attention only.
    [
        ("qwen3", ALL_TARGETS),
        ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("mixtral", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("gemma2", ALL_TARGETS),
        ("gemma3", ALL_TARGETS),
    ],
)
def test_lora_matches_peft(
    variant: str, targets: list[str], make_tiny_model: Callable[[str], Path], prompts: list[list[int]], tmp_path: Path
) -> None:
    """A random adapter on the family's projections, beside the base model in one batch."""
    model_dir = make_tiny_model(variant)
    adapter = save_random_adapter(model_dir, tmp_path / "a", 8, 16, targets, seed=0, std=0.1)
    reference = peft_model(model_dir, {"a": adapter})
    jobs = [(ids, name) for ids in prompts for name in ("a", None)]
    expected = [peft_greedy(reference, ids, name) for ids, name in jobs]
    core = tiny_core(model_dir, lora_modules={"a": str(adapter)}, max_num_batched_tokens=16)

    got, _ = generate(core, jobs)

    assert got == expected
    assert got[0] != got[1]  # the adapter changes the continuation: a path that ignored it could not pass


@pytest.mark.parametrize("variant", ["qwen3", "phi4_mini", "gemma2", "gemma3"])
def test_tensor_parallel_tokens_match_transformers(
    variant: str, make_tiny_model: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """TP=2: each rank holds 2 query heads, 1 KV head (Qwen3's norms whole; Phi-3's fused tensors split per rank)."""
    model_dir = make_tiny_model(variant)
    core = tiny_core(model_dir, tensor_parallel_size=2, max_num_batched_tokens=16)
    assert core.workers is not None and core.runner.model.shard.num_heads == 2
    try:
        got, _ = generate(core, [(ids, None) for ids in prompts])
    finally:
        core.close()

    assert got == hf_greedy(model_dir, prompts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the Triton kernels are the serving path")
@pytest.mark.parametrize("variant", ["qwen3", "phi4_mini", "gemma2", "gemma3"])
def test_triton_path_matches_transformers(
    variant: str, make_tiny_model: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """The engine on the Triton kernels (interpreted on the CPU): Qwen3's head norms, Phi-4-mini's 24-wide rotation
    of 32-wide heads (the rotary kernel on a slice of each head, then the cache write and attention on whole ones)."""
    model_dir = make_tiny_model(variant)
    core = tiny_core(model_dir, max_num_batched_tokens=16)

    with force_triton():
        got, _ = generate(core, [(ids, None) for ids in prompts[:2]])

    assert got == hf_greedy(model_dir, prompts[:2])


@pytest.mark.parametrize("variant", FAMILIES)
def test_ngram_speculation_keeps_transformers_tokens(
    variant: str, make_tiny_model: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """Decodes verify 4 n-gram drafts a step (several tokens of a sequence in one query) beside prefill chunks."""
    model_dir = make_tiny_model(variant)
    core = tiny_core(model_dir, max_num_batched_tokens=16, adaptive_drafts=False)

    got, _ = generate(core, [(ids, None) for ids in prompts], num_speculative_tokens=4)

    assert got == hf_greedy(model_dir, prompts)
    assert core.drafter.num_draft_tokens > 0  # steps verified drafts


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("variant", FAMILIES)
def test_json_schema_output(
    variant: str, make_tiny_model: Callable[[str], Path], prompts: list[list[int]], tmp_path: Path
) -> None:
    """Greedy outputs constrained to a JSON schema, in one batch with chunked prefill: every one an instance."""
    model_dir = _with_byte_tokenizer(make_tiny_model(variant), tmp_path)
    core = tiny_core(model_dir, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(json_schema=ANSWER_SCHEMA))
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"json-{i}", ids, params, arrival_time=0.0))
    tokens: dict[str, list[int]] = {f"json-{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for ids in tokens.values():
        assert ids[-1] == TINY_COMMON["eos_token_id"]  # the grammar ended, then allowed only the end of sequence
        answer = json.loads(tokenizer.decode(ids[:-1]))
        assert set(answer) == {"colour", "ok"} and answer["colour"] in {"red", "green", "blue"}
        assert isinstance(answer["ok"], bool)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("variant", FAMILIES)
def test_quantized_tokens_are_those_of_the_dequantized_weights(
    variant: str,
    bits: int,
    make_tiny_model: Callable[[str], Path],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--quantization int8`` / ``int4`` serve the greedy tokens of their dequantized weights run dense.

    Every step runs the quantized kernels (no dense copy at any batch size) with their default int8 activations
    where the CPU has them, which the reference quantizes too (:func:`~conftest.compute_as_served`); the two may
    part only at a near tie (:func:`assert_same_greedy_tokens`).
    """
    for key in MAX_QUANTIZED_TOKENS:
        monkeypatch.setitem(MAX_QUANTIZED_TOKENS, key, 10**9)
    model_dir = make_tiny_model(variant)
    quantized = tiny_core(model_dir, quantization=f"int{bits}", max_num_batched_tokens=16)
    dense = tiny_core(model_dir, max_num_batched_tokens=16)
    reference = dense.runner.model
    # Unprepared, the reference runs torch's F.linear on the weights compute_as_served gives it.
    for module in reference.modules():
        getattr(module, "prepared", {}).clear()
    weights = quantized_weights(load_model(model_dir, torch.float32, torch.device("cpu")), model_dir, bits)
    compute_as_served(reference, quantized.runner.model, weights | quantized_expert_stacks(model_dir, bits))

    assert_same_greedy_tokens(quantized, dense, prompts)


REQUEST_IDS = itertools.count()


def greedy_with_logprobs(core: EngineCore, prompts: list[list[int]]) -> list[list[TokenLogprobs]]:
    """Each prompt's greedy tokens (``MAX_TOKENS``), all queued at once, each with the two most likely beside it."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=2)
    ids = [f"logprobs-{next(REQUEST_IDS)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        core.add_request(EngineRequest(request_id, prompt, params, arrival_time=0.0))
    steps: dict[str, list[TokenLogprobs]] = {request_id: [] for request_id in ids}
    while core.has_unfinished_requests():
        for delta in core.step():
            steps[delta.request_id] += delta.new_logprobs or []
    return [steps[request_id] for request_id in ids]


def assert_same_greedy_tokens(served: EngineCore, reference: EngineCore, prompts: list[list[int]]) -> None:
    """``served`` generates ``reference``'s greedy tokens, or parts from them only at a near tie.

    Where a continuation first differs, the reference's most likely token and the served one's must lie within
    :data:`NEAR_TIE` of each other in the reference's log-probabilities (both engines pick the top token, so the
    reference ranks the served one second at least as close); from there on the contexts differ and are not compared.
    """
    for got, want in zip(greedy_with_logprobs(served, prompts), greedy_with_logprobs(reference, prompts), strict=True):
        for position, (mine, theirs) in enumerate(zip(got, want, strict=True)):
            if mine.token_ids[0] != theirs.token_ids[0]:
                ranked = dict(zip(theirs.token_ids[1:], theirs.logprobs[1:], strict=True))
                token = mine.token_ids[0]
                assert token in ranked and theirs.logprobs[0] - ranked[token] <= NEAR_TIE, (position, theirs)
                break


NEAR_TIE = 0.01
"""How far (nats) apart two tokens may be in the reference's log-probabilities where a quantized engine's greedy
continuation parts from it: float32 summation order moves an int8 activation a level at a rounding boundary."""
