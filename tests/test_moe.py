"""Mixture-of-experts: routing, the fused MoE paths (C++, Triton) against a per-expert torch loop, and Mixtral and
Qwen3-MoE against transformers' own implementations (one rank and two)."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from test_lora import MAX_TOKENS, generate, tiny_core
from test_model_families import hf_greedy
from test_model_parity import SCHEDULES, hf_logits, run_schedule

from spindle.backend.models import load_model
from spindle.backend.models.loader import _stacked, quantized_weights
from spindle.backend.models.mixtral import MixtralDecoderLayer
from spindle.backend.models.qwen3_moe import is_sparse_layer
from spindle.kernels import cpu, eager, force_triton
from spindle.kernels.linear import weight_only
from spindle.kernels.moe import Experts, fused_moe_reference, quantize_experts, route, route_tokens
from spindle.kernels.quant import QuantizedWeight, quantize, widen

# (tokens, experts, top_k, hidden, intermediate, the experts the tokens may route to: None for all).
CASES = {
    "top2_of_8": (37, 8, 2, 64, 96, None),
    "top1_of_8": (29, 8, 1, 32, 64, None),
    "one_token": (1, 8, 2, 64, 32, None),
    "few_experts_many_empty": (50, 8, 2, 64, 32, [1, 6]),
    "odd_shapes": (19, 6, 3, 80, 112, None),
    # ~150 rows an expert, several work items each: the C++ op on AMX (hidden and intermediate multiples of 32).
    "many_rows": (300, 4, 2, 64, 96, None),
    # Over 256 inputs a projection: the float32 tiles' work items run their inputs in parts of 256 (the last shorter).
    "deep_inputs": (23, 4, 2, 288, 320, None),
}
QUANTIZED_CASES = [case for case in CASES if case not in ("odd_shapes", "deep_inputs")]
"""int4 quantizes groups of 32 inputs, which odd_shapes' sizes are not; deep_inputs is for the float32 tiles, and would
only slow the interpreted Triton runs of the quantized ones."""
QUANTIZED_LAYOUTS = {
    "int8": (8, None),
    "int4": (4, None),
    "int8_offsets": (4, 32),
    "int8_g16": (8, 16),
    "int8_offsets_g16": (4, 16),
}
"""Each quantized layout of experts: the bits they are quantized to (int8 per row, int4 per 32 inputs), and the group
size they are then widened to exactly, as int8 (int4's offsets kept), or None. int8 with offsets per 32 inputs is
GGUF's Q5_1 and Q5_K decoded, per 16 without them Q6_K, per 16 with them a Q4_K_M's Q4_K gate beside its Q6_K up."""
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
A8_TOLERANCES = {torch.float32: {"atol": 5e-3, "rtol": 1e-3}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
"""Experts with int8 activations against the reference that quantizes them too: float32 summation order may move an
activation of the down projection's input a level at a rounding boundary (the float reference is ~3e-2 away)."""


def random_moe(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(x, w13, w2, topk_weights, topk_ids)`` of a case, the outputs O(1)."""
    tokens, experts, top_k, hidden, intermediate, allowed = CASES[case]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=generator) / intermediate**0.5
    logits = torch.randn(tokens, experts, generator=generator)
    if allowed is not None:
        logits[:, [e for e in range(experts) if e not in allowed]] = -torch.inf
    topk_weights, topk_ids = route(logits, top_k)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), topk_weights, topk_ids


def quantized_experts(weights: torch.Tensor, layout: str) -> QuantizedWeight:
    """A float ``[experts, out, in]`` stack in one of :data:`QUANTIZED_LAYOUTS`."""
    bits, group_size = QUANTIZED_LAYOUTS[layout]
    if group_size is None:
        return quantize_experts(weights, bits)
    experts, outputs, inputs = weights.shape
    return _stacked(widen(quantize(weights.reshape(experts * outputs, inputs), bits), group_size), experts)


def test_route_renormalises_over_the_top_k_as_mixtral_and_keeps_probabilities_without() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [0.0, 3.0, 3.0, -2.0]])
    weights, ids = route(logits, 2)
    assert ids.tolist() == [[0, 3], [1, 2]]
    top = logits.gather(1, ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))
    raw, _ = route(logits, 2, renormalize=False)  # Qwen3-MoE without norm_topk_prob
    torch.testing.assert_close(raw, torch.softmax(logits, dim=-1).gather(1, ids))


@pytest.mark.parametrize(
    ("top_k", "renormalize"),
    [(2, True), (4, True), (2, False), (4, False)],
    ids=["mixtral-top2", "qwen3_moe-norm_topk_prob-top4", "qwen3_moe-top2", "qwen3_moe-top4"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_route_matches_transformers_routing(top_k: int, renormalize: bool, dtype: torch.dtype) -> None:
    """As transformers' Mixtral and Qwen3-MoE blocks route: a float32 softmax over all the experts, its top-k, and
    those divided by their sum where the family (or ``norm_topk_prob``) renormalises."""
    logits = torch.randn(67, 16, generator=torch.Generator().manual_seed(top_k)).to(dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    expected, expected_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    weights, ids = route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize(("top_k", "renormalize"), [(2, True), (3, False)], ids=["top2-renormalized", "top3-softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_route_tokens_op_routes_as_the_router_linear_then_route(
    top_k: int, renormalize: bool, dtype: torch.dtype
) -> None:
    """The CPU routing op (logits rounded to the dtype, top-k, softmax) picks the experts ``route`` picks from
    ``F.linear``'s logits, in the same order, with the same weights, over a prefill's worth of tokens (its threaded
    path) and one. Quarters from -1 to 1 make every dot product exact in float32 whatever the order of its sum, and
    make equal logits common: the op orders them as torch.topk does."""
    generator = torch.Generator().manual_seed(top_k)
    router = (torch.randint(-4, 5, (8, 96), generator=generator) / 4).to(dtype)
    for tokens in (300, 1):
        hidden = (torch.randint(-4, 5, (tokens, 96), generator=generator) / 4).to(dtype)
        weights, ids = route_tokens(hidden, router, top_k, renormalize)
        expected, expected_ids = route(torch.nn.functional.linear(hidden, router), top_k, renormalize)
        assert weights.dtype == torch.float32 and torch.equal(ids, expected_ids)
        torch.testing.assert_close(weights, expected)
        with eager():
            assert torch.equal(route_tokens(hidden, router, top_k, renormalize)[1], expected_ids)


PATHS = [("cpu", torch.float32), ("cpu", torch.bfloat16), ("triton", torch.float32), ("triton", torch.bfloat16)]
PATH_IDS = ["cpu-fp32", "cpu-bf16", "triton-fp32", "triton-bf16"]
LAYOUT_CASES = [(case, None) for case in CASES] + [
    (case, layout) for layout in QUANTIZED_LAYOUTS for case in QUANTIZED_CASES
]
LAYOUT_IDS = [*CASES, *(f"{case}-{layout}" for layout in QUANTIZED_LAYOUTS for case in QUANTIZED_CASES)]


@pytest.mark.parametrize(("path", "dtype"), PATHS, ids=PATH_IDS)
@pytest.mark.parametrize(("case", "layout"), LAYOUT_CASES, ids=LAYOUT_IDS)
def test_fused_moe_matches_a_per_expert_loop(case: str, layout: str | None, path: str, dtype: torch.dtype) -> None:
    """The C++ op (bf16: ``bf16_linear``'s tiles where the CPU has them; quantized experts: ``a8_linear``'s kernel,
    int8 activations, where the CPU has AVX2) and the Triton grouped GEMM (interpreted), dense or on quantized
    experts of every layout, each run as it is stored, against the torch loop over the same weights (quantized ones
    dequantized, their activations quantized as the op's are). The cases include experts that get no token and one
    that gets one."""
    experts = assert_matches_the_loop(case, layout, path, dtype)
    # Dense float32 experts run the op's float tiles on any CPU (every case's outputs are multiples of 16).
    assert experts.tiled == (
        path == "cpu" and layout is None and (dtype == torch.float32 or cpu.bf16_linear_supported())
    )
    assert experts.activations_quantized == (path == "cpu" and layout is not None and cpu.a8_linear_supported())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("case", "layout"), LAYOUT_CASES[len(CASES) :], ids=LAYOUT_IDS[len(CASES) :])
def test_quantized_experts_with_float_activations_match_a_per_expert_loop(
    case: str, layout: str, dtype: torch.dtype
) -> None:
    """Within ``weight_only`` the C++ op keeps quantized experts' activations float, dequantizing the weights in
    registers (``quant_rows.h``'s micro-kernels), as the Triton kernel does."""
    with weight_only():
        experts = assert_matches_the_loop(case, layout, "cpu", dtype)
    assert experts.quantized and not experts.activations_quantized


def assert_matches_the_loop(case: str, layout: str | None, path: str, dtype: torch.dtype) -> Experts:
    """Run a case's experts (``layout``: quantized as :data:`QUANTIZED_LAYOUTS` says, or dense) on ``path`` and
    check them against :func:`fused_moe_reference`; returns the :class:`Experts` that ran."""
    x, w13, w2, topk_weights, topk_ids = random_moe(case, dtype)
    if layout is not None:
        w13, w2 = quantized_experts(w13, layout), quantized_experts(w2, layout)
    with force_triton(path == "triton"):
        experts = Experts(w13, w2)
        out = experts(x, topk_weights, topk_ids)
    if experts.activations_quantized:  # quantized in x's dtype, as the op does
        expected = fused_moe_reference(x, w13, w2, topk_weights, topk_ids, quantize_activations=True).float()
    elif layout is not None:
        expected = fused_moe_reference(x.float(), w13, w2, topk_weights, topk_ids)
    else:
        expected = fused_moe_reference(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert out.dtype == dtype and out.shape == x.shape
    tolerances = A8_TOLERANCES if experts.activations_quantized else TOLERANCES
    torch.testing.assert_close(out.float(), expected, **tolerances[dtype])
    return experts


@pytest.mark.parametrize("float_activations", [False, True], ids=["a8", "weight_only"])
@pytest.mark.parametrize("layout", ["int8", "int4"])
def test_quantized_experts_run_float16_activations_as_float32(layout: str, float_activations: bool) -> None:
    """The C++ ops take float32 or bf16 activations: float16 ones run as float32 (exact) and are rounded back, so a
    float16 model with quantized experts serves (before, its first forward failed in the op's dtype check)."""
    x, w13, w2, topk_weights, topk_ids = random_moe("top2_of_8", torch.float32)
    with weight_only(float_activations):
        experts = Experts(quantized_experts(w13, layout), quantized_experts(w2, layout))
    assert experts.activations_quantized != float_activations
    half = x.half()
    out = experts(half, topk_weights, topk_ids)
    assert out.dtype == torch.float16
    assert torch.equal(out, experts(half.float(), topk_weights, topk_ids).half())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_float16_model_with_quantized_experts_serves(
    quantization: str, make_tiny_model: Callable[[str], Path], moe_prompts: list[list[int]]
) -> None:
    core = tiny_core(make_tiny_model("mixtral"), dtype="float16", quantization=quantization)
    assert core.runner.model.layers[0].experts.quantized
    got, _ = generate(core, [(ids, None) for ids in moe_prompts])
    assert [len(tokens) for tokens in got] == [MAX_TOKENS] * len(moe_prompts)


def test_quantized_experts_on_the_cpu_need_groups_their_micro_kernels_step_through() -> None:
    """int8 experts quantize at any size, but the C++ op's micro-kernels read 16 inputs under one scale (int4: 32): a
    clear error from :class:`Experts`, and from the op itself for a layout it does not read."""
    generator = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(2, 64, 72, generator=generator), torch.randn(2, 72, 32, generator=generator)
    with pytest.raises(ValueError, match="not int8 in groups of 72 and int8 in groups of 32"):
        Experts(quantize_experts(w13, 8), quantize_experts(w2, 8))
    with pytest.raises(ValueError, match="both be quantized or both dense"):
        Experts(quantize_experts(w13, 8), w2)
    x, w13, w2, topk_weights, topk_ids = random_moe("one_token", torch.float32)
    int4 = quantize_experts(w13, 4)
    halves = QuantizedWeight(int4.qweight, *(t.repeat_interleave(2, dim=-1) for t in (int4.scales, int4.zeros)), 16)
    with pytest.raises(RuntimeError, match="group_size 16 of int4 experts must be a multiple of 32 that divides 64"):
        cpu.fused_moe_quantized(x, halves, quantize_experts(w2, 4), topk_weights, topk_ids)


@pytest.mark.parametrize("layout", [None, "int4"], ids=["dense", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_does_not_depend_on_the_thread_count(dtype: torch.dtype, layout: str | None) -> None:
    """The C++ op's work items are shared out by thread count; each output value still has one fixed summation
    order (quantized experts: ``a8_linear``'s panels, where the CPU runs them, split over the threads per expert)."""
    x, w13, w2, topk_weights, topk_ids = random_moe("many_rows", dtype)
    if layout is not None:
        w13, w2 = quantized_experts(w13, layout), quantized_experts(w2, layout)
    experts = Experts(w13, w2)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append(experts(x, topk_weights, topk_ids))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


MOE_FAMILIES = ["mixtral", "qwen3_moe"]
"""tests/conftest.py's tiny MoE checkpoints: Mixtral, and Qwen3-MoE with a dense middle layer and no renormalisation."""
LOGIT_PROMPTS = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (13, 21, 6)]
"""The three prompts of test_model_parity.SCHEDULES."""


@pytest.fixture(scope="module")
def moe_prompts() -> list[list[int]]:
    """Four prompts of 5-33 tokens: with 16-token steps, prefill chunks and decodes share steps."""
    return [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 33, 9)]


@pytest.mark.parametrize("path", ["kernels", "eager"])
@pytest.mark.parametrize("schedule", ["one_batch", "two_chunks", "decode"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_logits_match_transformers(
    family: str, schedule: str, path: str, make_tiny_model: Callable[[str], Path]
) -> None:
    """On the C++ kernels (the fused MoE op) and on the torch references (the per-expert loop)."""
    model_dir = make_tiny_model(family)
    with eager(path == "eager"):
        model = load_model(model_dir, torch.float32, torch.device("cpu"))
        model.prepare_weights()
        logits = run_schedule(model, LOGIT_PROMPTS, SCHEDULES[schedule])
    for ours, theirs in zip(logits, hf_logits(model_dir, LOGIT_PROMPTS), strict=True):
        torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_loads_transformers_v5_fused_expert_tensors(
    family: str, make_tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """``save_original_format=False``: each layer's ``mlp.experts.gate_up_proj`` / ``down_proj`` and ``mlp.gate``."""
    model_dir = make_tiny_model(family)
    transformers.AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(tmp_path, save_original_format=False)
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    model.prepare_weights()
    logits = run_schedule(model, LOGIT_PROMPTS, SCHEDULES["one_batch"])
    for ours, theirs in zip(logits, hf_logits(model_dir, LOGIT_PROMPTS), strict=True):
        torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_greedy_tokens_match_transformers_with_chunked_prefill(
    family: str, make_tiny_model: Callable[[str], Path], moe_prompts: list[list[int]]
) -> None:
    model_dir = make_tiny_model(family)
    got, _ = generate(tiny_core(model_dir, max_num_batched_tokens=16), [(ids, None) for ids in moe_prompts])
    assert got == hf_greedy(model_dir, moe_prompts)


@pytest.mark.parametrize("layout", ["original", "v5_fused"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_tensor_parallel_tokens_match_transformers(
    family: str, layout: str, make_tiny_model: Callable[[str], Path], moe_prompts: list[list[int]], tmp_path: Path
) -> None:
    """TP=2: each rank holds half of every expert's intermediate dimension (and 2 query heads, 1 KV head), from
    per-expert tensors or from transformers v5's fused ones."""
    model_dir = make_tiny_model(family)
    served = model_dir
    if layout == "v5_fused":
        transformers.AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(
            tmp_path, save_original_format=False
        )
        served = tmp_path
    core = tiny_core(served, tensor_parallel_size=2, max_num_batched_tokens=16)
    assert (
        core.workers is not None
        and core.runner.model.layers[0].intermediate == {"mixtral": 64, "qwen3_moe": 16}[family]
    )
    try:
        got, _ = generate(core, [(ids, None) for ids in moe_prompts])
    finally:
        core.close()
    assert got == hf_greedy(model_dir, moe_prompts)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_quantized_experts_hold_no_dense_copy(family: str, bits: int, make_tiny_model: Callable[[str], Path]) -> None:
    """``--quantization int8`` / ``int4`` quantize the experts too, at the projections' bits, and drop the dense
    stacks. (That they serve the tokens of their dequantized weights run dense is test_model_families'
    ``test_quantized_tokens_are_those_of_the_dequantized_weights``, whose reference runs the dequantized experts.)"""
    model_dir = make_tiny_model(family)
    model = load_model(model_dir, torch.float32, torch.device("cpu"))
    model.prepare_weights(quantized_weights(model, model_dir, bits))
    moe_layers = [layer for layer in model.layers if isinstance(layer, MixtralDecoderLayer)]
    assert moe_layers
    for layer in moe_layers:
        assert layer.w13.numel() == 0 and layer.w2.numel() == 0
        experts = layer.experts
        assert experts.quantized and not experts.keeps_dense
        if experts.activations_quantized:  # a8_pack's panels stand in for the stacks: int8, or 4 bits two a byte
            values = experts.num_experts * 2 * experts.intermediate * experts.hidden  # w13's; w2 holds half as many
            for packed, count in zip((stack[0] for stack in experts.a8), (values, values // 2), strict=True):
                assert packed.dtype == (torch.int8 if bits == 8 else torch.uint8)
                assert packed.numel() == count * bits // 8
            continue
        for stack in (experts.w13, experts.w2):
            assert isinstance(stack, QuantizedWeight) and stack.bits == bits
            assert stack.qweight.dtype == (torch.int8 if bits == 8 else torch.uint8)


def test_qwen3_moe_dense_layers_follow_decoder_sparse_step_and_mlp_only_layers() -> None:
    config = {"num_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert [is_sparse_layer(config, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not any(is_sparse_layer({**config, "num_experts": 0}, i) for i in range(6))
