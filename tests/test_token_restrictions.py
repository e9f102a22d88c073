"""``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` end to end.

The tiny random Llama (byte-level tokenizer: a token per character) against transformers' constrained greedy search
and against the engine's own runs, then once through the gRPC server (``spindle.v1`` and vLLM's protocol) and the
OpenAI API's request bodies.
"""

import grpc
import pytest
import torch
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc
from test_grpc import assert_invalid, backend, client, collect, refusal, server  # noqa: F401 - fixtures
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from spindle import LLM, SamplingParams
from spindle.frontend.grpc.mapping import sampling_params_from_proto
from spindle.frontend.http.protocol import sampling_message
from spindle.shared.errors import InvalidRequestError
from spindle.shared.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_LENGTH, MAX_BAD_WORDS

PROMPT = "the cat sat on the mat:"  # its last token is in no bad word: transformers also matches words across it
LETTERS = "abcdefghijklmnopqrstuvwxyz "
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(tiny_llm_dir) -> LLM:
    return LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", adaptive_drafts=False)


@pytest.fixture(scope="module")
def hf_model(tiny_llm_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llm_dir) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_llm_dir)


@pytest.fixture(scope="module")
def letters(hf_tokenizer) -> list[int]:
    """The ids of the lowercase letters and the space: without eos, so every run has all its tokens."""
    return hf_tokenizer.encode(LETTERS, add_special_tokens=False)


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **fields)


def hf_greedy(
    hf_model: torch.nn.Module, prompt_ids: list[int], allowed: list[int], bad_words_ids: list[list[int]] | None = None
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens restricted to ``allowed`` (and without ``bad_words_ids``), with their logprobs."""
    generated = hf_model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        prefix_allowed_tokens_fn=lambda batch_id, input_ids: allowed,
        bad_words_ids=bad_words_ids,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = generated.sequences[0, len(prompt_ids) :].tolist()
    # The scores are the logits with the tokens outside ``allowed`` masked: their log-softmax is the restricted one.
    logprobs = [scores[0].log_softmax(-1)[token].item() for scores, token in zip(generated.scores, tokens, strict=True)]
    return tokens, logprobs


def test_greedy_with_allowed_token_ids_is_transformers_constrained_greedy(llm, hf_model, hf_tokenizer, letters):
    output = llm.generate(PROMPT, greedy(allowed_token_ids=letters, logprobs=0), use_tqdm=False)[0].outputs[0]
    expected, logprobs = hf_greedy(hf_model, hf_tokenizer.encode(PROMPT), letters)

    assert output.token_ids == expected and set(expected) <= set(letters)
    chosen = [position[token].logprob for token, position in zip(output.token_ids, output.logprobs, strict=True)]
    assert chosen == pytest.approx(logprobs, abs=1e-4)
    free = llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert not set(free) <= set(letters)  # unrestricted, the model says something else


@pytest.mark.parametrize("speculative", [0, 4], ids=["plain", "ngram4"])
@pytest.mark.parametrize("span", [(0, 1), (1, 4)], ids=["one-token", "three-tokens"])
def test_a_bad_word_greedy_decoding_would_say_is_never_completed(
    llm, hf_model, hf_tokenizer, letters, span, speculative
):
    """Also under n-gram speculation, whose draft rows count the drafts before them as output."""
    base = llm.generate(PROMPT, greedy(allowed_token_ids=letters), use_tqdm=False)[0].outputs[0]
    start, end = span
    word = base.text[start:end]
    assert word.strip() == word and hf_tokenizer.encode(PROMPT)[-1] not in letters

    params = greedy(allowed_token_ids=letters, bad_words=[word], num_speculative_tokens=speculative)
    output = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert word not in output.text and (output.num_draft_tokens > 0) == bool(speculative)
    # The same output until the word's last token, which is masked there.
    assert (
        output.token_ids[: end - 1] == base.token_ids[: end - 1]
        and output.token_ids[end - 1] != base.token_ids[end - 1]
    )
    bad_words_ids = [hf_tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
    expected, _ = hf_greedy(hf_model, hf_tokenizer.encode(PROMPT), letters, bad_words_ids)
    assert output.token_ids == expected


@pytest.mark.parametrize("keep", [1, 9])
@pytest.mark.parametrize("form", ["text", "token_ids"])
def test_truncation_equals_sending_the_last_tokens(llm, hf_tokenizer, keep, form):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    inputs = PROMPT if form == "text" else {"prompt_token_ids": prompt_ids}
    truncated = llm.generate(inputs, greedy(truncate_prompt_tokens=keep), use_tqdm=False)[0]
    direct = llm.generate({"prompt_token_ids": prompt_ids[-keep:]}, greedy(), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == prompt_ids[-keep:]
    assert truncated.outputs[0].token_ids == direct.outputs[0].token_ids


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"allowed_token_ids": [5, 256]}, "allowed_token_ids"),  # the vocabulary has 256 tokens
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [3] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids"),
        ({"bad_words": ["ok", " "]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
        ({"bad_words": ["w" * (MAX_BAD_WORD_LENGTH + 1)]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_invalid_values_are_refused_naming_the_field(llm, fields, field):
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("bad", PROMPT, greedy(**fields))
    assert error.value.fields == (f"sampling_params.{field}",)
    assert not engine.has_unfinished_requests()


def test_grpc_round_trip(client, llm, letters):  # noqa: F811 - the imported fixture
    fields = {"allowed_token_ids": letters, "truncate_prompt_tokens": 12}
    word = llm.generate(PROMPT, greedy(**fields), use_tqdm=False)[0].outputs[0].text[:2]
    fields["bad_words"] = [word]
    expected = llm.generate(PROMPT, greedy(**fields), use_tqdm=False)[0]
    assert word not in expected.outputs[0].text and len(expected.prompt_token_ids) == 12

    choices, messages = collect(client.generate(PROMPT, temperature=0, max_tokens=MAX_TOKENS, **fields))
    assert choices[0]["token_ids"] == expected.outputs[0].token_ids and messages[-1].usage.prompt_tokens == 12
    error = refusal(lambda: client.generate(PROMPT, allowed_token_ids=[3, 300]))
    assert_invalid(error, ["sampling_params.allowed_token_ids"], "token ids [300] outside the vocabulary")


def test_vllm_protocol_truncates_the_prompt(server, llm, hf_tokenizer):  # noqa: F811 - the imported fixture
    prompt_ids = hf_tokenizer.encode(PROMPT)
    request = vllm_pb.GenerateRequest(
        tokenized=vllm_pb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=vllm_pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, truncate_prompt_tokens=5),
    )
    with grpc.insecure_channel(server.address) as channel:
        [response] = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=60)
    expected = llm.generate({"prompt_token_ids": prompt_ids[-5:]}, greedy(), use_tqdm=False)[0].outputs[0]
    assert list(response.complete.output_ids) == expected.token_ids and response.complete.prompt_tokens == 5


def test_openai_bodies_carry_the_fields():
    body = {"allowed_token_ids": [3, 7], "bad_words": ["no", "never"], "truncate_prompt_tokens": -1}
    assert sampling_params_from_proto(sampling_message(body)) == SamplingParams(**body)


@pytest.mark.parametrize(
    "body", [{"allowed_token_ids": ["3"]}, {"bad_words": "no"}, {"bad_words": [1]}, {"truncate_prompt_tokens": 2.5}]
)
def test_openai_bodies_of_the_wrong_kind_are_refused(body):
    with pytest.raises(InvalidRequestError) as error:
        sampling_message(body)
    assert error.value.fields == tuple(body)
