"""Mixture-of-experts: routing, the fused MoE paths (C++, Triton) against a per-expert torch loop, and Mixtral
against transformers' own implementation."""

from pathlib import Path

import pytest
import torch
import transformers
from conftest import _with_byte_tokenizer
from test_model_parity import SCHEDULES, hf_logits, run_schedule

from spindle import LLM, SamplingParams
from spindle.backend.models import load_model
from spindle.kernels import eager, force_triton
from spindle.kernels.moe import Experts, fused_moe_reference, route

# (tokens, experts, top_k, hidden, intermediate, the experts the tokens may route to: None for all).
CASES = {
    "top2_of_8": (37, 8, 2, 64, 48, None),
    "top1_of_8": (29, 8, 1, 32, 80, None),
    "one_token": (1, 8, 2, 64, 32, None),
    "few_experts_many_empty": (50, 8, 2, 48, 32, [1, 6]),
    "odd_shapes": (19, 6, 3, 80, 112, None),
}
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


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


def test_route_renormalises_over_the_top_k_as_mixtral_and_keeps_probabilities_without() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0], [0.0, 3.0, 3.0, -2.0]])
    weights, ids = route(logits, 2)
    assert ids.tolist() == [[0, 3], [1, 2]]
    top = logits.gather(1, ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))
    raw, _ = route(logits, 2, renormalize=False)  # Qwen3-MoE without norm_topk_prob
    torch.testing.assert_close(raw, torch.softmax(logits, dim=-1).gather(1, ids))


@pytest.mark.parametrize(
    ("path", "dtype"),
    [("cpu", torch.float32), ("cpu", torch.bfloat16), ("triton", torch.float32), ("triton", torch.bfloat16)],
    ids=["cpu-fp32", "cpu-bf16", "triton-fp32", "triton-bf16"],
)
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_a_per_expert_loop(case: str, path: str, dtype: torch.dtype) -> None:
    """The C++ op (bf16: ``bf16_linear``'s tiles where the CPU has them) and the Triton grouped GEMM (interpreted)."""
    x, w13, w2, topk_weights, topk_ids = random_moe(case, dtype)
    expected = fused_moe_reference(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    with force_triton(path == "triton"):
        experts = Experts(w13, w2)
        out = experts(x, topk_weights, topk_ids)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mixtral (2 layers, hidden 64, 8 experts of 32, top-2) with the byte-level tokenizer."""
    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # Wider than transformers' init, as the Llama fixtures are: the router's choices and the experts' outputs
        # then differ visibly between tokens, so a wrong expert or weight changes the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("tiny-mixtral")
    model.save_pretrained(path)
    return _with_byte_tokenizer(path, path)


@pytest.mark.parametrize("path", ["kernels", "eager"])
@pytest.mark.parametrize("schedule", ["one_batch", "two_chunks", "decode"])
def test_mixtral_logits_match_transformers(schedule: str, path: str, tiny_mixtral_dir: Path) -> None:
    """On the C++ kernels (the fused MoE op) and on the torch references (the per-expert loop)."""
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (13, 21, 6)]
    with eager(path == "eager"):
        model = load_model(tiny_mixtral_dir, torch.float32, torch.device("cpu"))
        model.prepare_weights()
        logits = run_schedule(model, prompts, SCHEDULES[schedule])
    for ours, theirs in zip(logits, hf_logits(tiny_mixtral_dir, prompts), strict=True):
        torch.testing.assert_close(ours, theirs, atol=5e-5, rtol=1e-4)


def test_mixtral_greedy_tokens_match_transformers_with_chunked_prefill(tiny_mixtral_dir: Path) -> None:
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 33)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_mixtral_dir, dtype=torch.float32).eval()
    expected = [
        reference.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p) :]
        for p in prompts
    ]
    llm = LLM(str(tiny_mixtral_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16)
    greedy = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e.tolist() for e in expected]
