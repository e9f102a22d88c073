"""Prompts given as embeddings: the same tokens as the prompt they embed, mixed in a batch, cached by content."""

import numpy as np
import pytest
import torch
from test_grpc import assert_invalid, collect, refusal, served
from transformers import AutoModelForCausalLM

from spindle import LLM, SamplingParams
from spindle.shared.errors import InvalidRequestError
from spindle.v1 import spindle_pb2

PROMPTS = [[5, 77, 140, 9, 33, 5, 77, 12, 99, 14, 3, 8, 201, 4, 4, 60, 61, 62], [200, 13], [44, 45, 46, 47, 48]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)


@pytest.fixture(scope="module")
def embeddings(tiny_llm_dir) -> list[np.ndarray]:
    """Each prompt's token embeddings, from transformers' model: what a caller who embeds its prompt would send."""
    table = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).get_input_embeddings()
    with torch.no_grad():
        return [table(torch.tensor(ids)).numpy() for ids in PROMPTS]


@pytest.fixture(scope="module")
def llm(tiny_llm_dir):
    # 8-token steps: the first prompt's embeddings go in three chunks.
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", block_size=8, max_num_batched_tokens=8)
    yield llm
    llm.shutdown()


def test_embeddings_give_the_tokens_of_the_prompt_they_embed_in_one_batch_with_token_prompts(llm, embeddings):
    tokens = [{"prompt_token_ids": ids} for ids in PROMPTS]
    expected = [out.outputs[0].token_ids for out in llm.generate(tokens, GREEDY, use_tqdm=False)]
    mixed = [tokens[0], {"prompt_embeds": embeddings[1]}, {"prompt_embeds": torch.from_numpy(embeddings[2])[None]}]
    mixed.append({"prompt_embeds": embeddings[0]})
    outputs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == [expected[0], expected[1], expected[2], expected[0]]
    assert outputs[3].prompt is None and outputs[3].prompt_token_ids == [0] * len(PROMPTS[0])  # placeholders


def test_the_prefix_cache_shares_only_the_same_embeddings(llm, embeddings):
    """Full blocks of embeddings are found again by their content; the placeholder ids alone match nothing."""
    first = {"prompt_embeds": embeddings[0] * 0.5}
    llm.generate(first, GREEDY, use_tqdm=False)
    again = llm.generate(first, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 16  # two full blocks of 8
    other = llm.generate({"prompt_embeds": embeddings[0] * 0.25}, GREEDY, use_tqdm=False)[0]
    placeholders = llm.generate({"prompt_token_ids": [0] * len(PROMPTS[0])}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == placeholders.num_cached_tokens == 0


@pytest.mark.parametrize(
    ("make", "field", "message"),
    [
        (lambda e: e[:, :10], "prompt.prompt_embeds", "have shape [18, 10]; this prompt needs [18, 64]"),
        (lambda e: np.full_like(e, np.nan), "prompt.prompt_embeds", "not finite"),
        (lambda e: e[0], "prompt.prompt_embeds", "[tokens, hidden_size], not float32 of shape [64]"),
        (lambda e: e.astype(np.int32), "prompt.prompt_embeds", "not int32 of shape"),
    ],
)
def test_bad_embeddings_are_refused(llm, embeddings, make, field, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[")) as refused:
        llm.generate({"prompt_embeds": make(embeddings[0])}, GREEDY, use_tqdm=False)
    assert refused.value.fields == (field,)
    assert not llm.llm_engine.has_unfinished_requests()


def test_grpc_takes_embeddings_as_little_endian_floats_with_a_shape(llm, embeddings, tiny_llm_dir):
    expected = llm.generate({"prompt_embeds": embeddings[1]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    params = spindle_pb2.SamplingParams(temperature=0, max_tokens=10, min_tokens=10)

    def request(data: bytes, shape: list[int]) -> spindle_pb2.GenerateRequest:
        embeds = spindle_pb2.PromptEmbeds(data=data, shape=shape)
        return spindle_pb2.GenerateRequest(prompt=spindle_pb2.Prompt(embeds=embeds), sampling_params=params)

    data = embeddings[1].astype("<f4").tobytes()
    with served(tiny_llm_dir) as server, server.client(timeout=60) as client:
        choices, _ = collect(client.stub.Generate(request(data, [2, 64]), timeout=60))
        error = refusal(lambda: client.stub.Generate(request(data, [2, 63]), timeout=60))
    assert choices[0]["token_ids"] == expected
    assert_invalid(error, ["prompt.embeds"], "prompt.embeds has shape [2, 63] and 512 bytes")
