"""End to end on the embedded SmolLM2-135M-Instruct (fp32): greedy parity with transformers and the text-level
sampling parameters (stop strings, special tokens, eos handling, logprobs).

The parity engines run their quantized projections weight-only (float activations, as transformers' forward on the
file's dequantized weights); the default, int8 activations, is held to transformers' log-probabilities within a
measured bound (its quality: ``python -m bench.quality``)."""

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from spindle import LLM, SamplingParams
from spindle.backend.models.loader import resolve_model
from spindle.kernels import cpu
from spindle.kernels.linear import weight_only

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers.",
    "Explain recursion to a child in two sentences.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about " * 3,
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def parity_llm(**engine_args: object) -> LLM:
    """A float32 engine on the embedded model whose projections keep float activations; it verifies every draft."""
    with weight_only():
        return LLM(dtype="float32", **{"max_model_len": 2048, "adaptive_drafts": False, **engine_args})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return parity_llm(kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def hf_model() -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    processor = llm.llm_engine.input_processor
    chats = [processor.process_chat([{"role": "user", "content": c}], GREEDY).prompt_token_ids for c in CHATS]
    return chats + [llm.get_tokenizer().encode(p) for p in RAW]


@pytest.fixture(scope="module")
def expected(hf_model, prompt_ids) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            tokens = hf_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
            out.append(tokens[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize(
    "engine_args",
    [dict(), dict(max_num_batched_tokens=16), dict(kv_cache_memory="12MiB", max_model_len=256)],
    ids=["one_batch", "chunked_prefill", "preemption"],
)
@pytest.mark.parametrize("speculative", [0, 4], ids=["plain", "ngram4"])
def test_greedy_matches_transformers(engine_args, speculative, llm, prompt_ids, expected):
    """Also with n-gram speculation, whose drafts the repetitive prompts accept: the same tokens."""
    engine = llm if not engine_args else parity_llm(**engine_args)
    core = engine.llm_engine.engine_core
    accepted_before = core.stats().num_accepted_draft_tokens
    params = msgspec.structs.replace(GREEDY, num_speculative_tokens=speculative)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert (core.scheduler.num_preemptions > 0) == ("kv_cache_memory" in engine_args)
    assert (core.stats().num_accepted_draft_tokens > accepted_before) == bool(speculative)
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_text_prompts_and_chat_give_the_same_completion(llm, prompt_ids, expected):
    tokenizer = llm.get_tokenizer()
    by_chat = llm.chat([{"role": "user", "content": CHATS[0]}], GREEDY, use_tqdm=False)[0]
    by_text = llm.generate(RAW[1], GREEDY, use_tqdm=False)[0]
    assert by_chat.outputs[0].token_ids == expected[0]
    assert by_chat.outputs[0].text == tokenizer.decode(expected[0])
    assert by_text.prompt == RAW[1] and by_text.outputs[0].token_ids == expected[len(CHATS) + 1]


def test_stop_strings_cut_the_text_and_free_the_sequence(llm, expected):
    full = llm.get_tokenizer().decode(expected[0])  # "The capital of France is Paris."
    stop = full.split()[3]
    cut = llm.chat([{"role": "user", "content": CHATS[0]}], SamplingParams(temperature=0, stop=[stop]), use_tqdm=False)
    kept = llm.chat(
        [{"role": "user", "content": CHATS[0]}],
        SamplingParams(temperature=0, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert cut[0].outputs[0].text == full[: full.index(stop)]
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]
    assert cut[0].outputs[0].finish_reason == "stop" and cut[0].outputs[0].stop_reason == stop
    core = llm.llm_engine.engine_core
    assert core.block_manager.num_free_blocks == core.num_blocks and not core.has_unfinished_requests()


def test_stop_token_ids_eos_and_lengths(llm, prompt_ids, expected):
    ids = {"prompt_token_ids": prompt_ids[0]}
    eos = expected[0][-1]
    assert eos == 2  # the chat reply ends with <|im_end|>
    stop_at = expected[0][3]
    by_id = llm.generate(ids, SamplingParams(temperature=0, stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == expected[0][:4] and by_id.stop_reason == stop_at and by_id.finish_reason == "stop"
    short = llm.generate(ids, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert short.token_ids == expected[0][:3] and short.finish_reason == "length"
    n = len(expected[0])
    past_eos = SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True, skip_special_tokens=False)
    ignored = llm.generate(ids, past_eos, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids[:n] == expected[0] and len(ignored.token_ids) == n + 5
    assert "<|im_end|>" in ignored.text and ignored.finish_reason == "length"
    held = llm.generate(ids, SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n + 2), use_tqdm=False)
    assert len(held[0].outputs[0].token_ids) >= n + 2 and eos not in held[0].outputs[0].token_ids[: n + 1]


def test_special_token_flags_change_the_text(llm, prompt_ids, expected):
    ids = {"prompt_token_ids": prompt_ids[0]}
    n = len(expected[0])

    def text(**kwargs) -> str:
        params = SamplingParams(temperature=0, max_tokens=n + 2, ignore_eos=True, **kwargs)
        return llm.generate(ids, params, use_tqdm=False)[0].outputs[0].text

    skipped = text()
    spaced = text(skip_special_tokens=False)
    tight = text(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "<|im_end|>" not in skipped
    assert "<|im_end|>" in tight and " <|im_end|>" in spaced and spaced != tight
    assert tight.replace("<|im_end|>", "").replace("\n", "") in skipped.replace("\n", "") or skipped in tight


def test_logprobs_match_transformers(llm, hf_model, prompt_ids, expected):
    ids = prompt_ids[4]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids + tokens])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs, strict=True)):
        row = reference[len(ids) - 1 + step]
        top = row.topk(3).indices.tolist()
        assert set(entry) == {token, *top}
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert entry[token].rank == 1 and entry[token].decoded_token == llm.get_tokenizer().id_to_text(token)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(reference[len(ids) - 1 + i, t].item() for i, t in enumerate(tokens)), abs=1e-2
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        target = ids[position]
        assert entry[target].logprob == pytest.approx(reference[position - 1, target].item(), abs=1e-3)
        assert set(reference[position - 1].topk(2).indices.tolist()) <= set(entry)


def test_default_int8_activations_stay_close_to_transformers(hf_model, prompt_ids):
    """The default engine quantizes its activations (``a8_linear`` on AVX2): each prompt token's log-probability
    within 0.15 of transformers' (mean |difference| measured 0.06 on a Zen 3), the same greedy first token."""
    if not cpu.a8_linear_supported():
        pytest.skip("int8 activations are the default on AVX2 CPUs")
    engine = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    differences, agreeing = [], 0
    for ids, out in zip(prompt_ids, outputs, strict=True):
        with torch.inference_mode():
            reference = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        agreeing += out.outputs[0].token_ids == [int(reference[-1].argmax())]
        differences += [
            abs(entry[ids[position]].logprob - reference[position - 1, ids[position]].item())
            for position, entry in enumerate(out.prompt_logprobs[1:], start=1)
        ]
    print(f"mean |logprob difference| {sum(differences) / len(differences):.4f}, largest {max(differences):.4f}")
    print(f"greedy first tokens agreeing {agreeing} of {len(prompt_ids)}")
    assert sum(differences) / len(differences) < 0.15
    assert agreeing >= len(prompt_ids) - 2
