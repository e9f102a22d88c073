"""Embeddings (``LLM.embed``, the ``Embed`` RPC) against transformers' final hidden states pooled the same way."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from test_grpc import ServerThread, assert_invalid, backend, refusal, settled_info  # noqa: F401 - backend: a fixture

from spindle import LLM, PoolingParams, SamplingParams
from spindle.shared.errors import InvalidRequestError

# Different lengths: one token, under a block, chunked prefills (the LLM below runs 32 tokens a step).
PROMPTS = [[5], [3 + (7 * i) % 250 for i in range(11)], [9 + (13 * i) % 240 for i in range(45)]]
LONG_PROMPT = [4 + (11 * i) % 250 for i in range(100)]
TEXT = "The quick brown fox jumps over the lazy dog."
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POOLINGS = [
    PoolingParams(pooling="last"),
    PoolingParams(pooling="mean"),
    PoolingParams(pooling="cls"),
    PoolingParams(pooling="mean", normalize=False),
    PoolingParams(pooling="last", normalize=False, dimensions=24),
    PoolingParams(dimensions=16),  # the model's default pooling: last
]
POOLING_IDS = ["last", "mean", "cls", "mean-raw", "last-raw-24", "default-16"]


def pooled(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Hidden states ``[T, hidden]`` pooled as ``params`` say, written out on transformers' side."""
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[params.pooling or "last"]
    vector = vector[: params.dimensions]
    return F.normalize(vector, dim=0) if params.normalize else vector


def assert_matches(embedding: list[float], hidden: torch.Tensor, params: PoolingParams) -> None:
    got, expected = torch.tensor(embedding), pooled(hidden, params)
    assert got.shape == expected.shape
    assert F.cosine_similarity(got, expected, dim=0) >= 0.999
    assert got.norm() == pytest.approx(expected.norm().item(), rel=1e-3)


def assert_all_blocks_free(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests() and core.block_manager.num_free_blocks == core.num_blocks


@pytest.fixture(scope="module")
def llm(tiny_llm_dir: Path) -> LLM:
    return LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def hf_model(tiny_llm_dir: Path) -> transformers.LlamaModel:
    """transformers' decoder of the same checkpoint: its ``last_hidden_state`` is after the final norm."""
    return transformers.LlamaForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).model.eval()


def hidden_states(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids])).last_hidden_state[0]


@pytest.mark.parametrize("params", POOLINGS, ids=POOLING_IDS)
def test_embed_equals_transformers_pooled_the_same_way(llm, hf_model, params):
    inputs = [{"prompt_token_ids": ids} for ids in [*PROMPTS, LONG_PROMPT]] + [TEXT]
    outputs = llm.embed(inputs, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs[:-1]] == [*PROMPTS, LONG_PROMPT]
    assert outputs[-1].prompt == TEXT and outputs[-1].prompt_token_ids == llm.get_tokenizer().encode(TEXT)
    for output in outputs:
        assert output.finished
        assert_matches(output.outputs.embedding, hidden_states(hf_model, output.prompt_token_ids), params)
    assert_all_blocks_free(llm)


def test_embeddings_share_steps_with_generation_which_is_unchanged(llm, hf_model, monkeypatch):
    engine, runner = llm.llm_engine, llm.llm_engine.engine_core.runner
    gen_prompt = [7 + (5 * i) % 200 for i in range(20)]
    solo = llm.generate({"prompt_token_ids": gen_prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    steps: list[tuple[bool, bool]] = []  # per step: a generation token, an embedding chunk
    execute = runner.execute

    def spy(scheduled):
        execute(scheduled)
        pooled = [runner.states[seq_id].pooling is not None for seq_id in scheduled.num_scheduled_tokens]
        steps.append((not all(pooled), any(pooled)))

    monkeypatch.setattr(runner, "execute", spy)
    params = PoolingParams(pooling="mean")
    engine.add_request("gen", {"prompt_token_ids": gen_prompt}, GREEDY)
    for i, ids in enumerate([*PROMPTS, LONG_PROMPT]):
        engine.add_request(f"emb{i}", {"prompt_token_ids": ids}, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["gen"].outputs[0].token_ids == solo
    for i, ids in enumerate([*PROMPTS, LONG_PROMPT]):
        assert_matches(finished[f"emb{i}"].outputs.embedding, hidden_states(hf_model, ids), params)
    assert (True, True) in steps[1:]  # past the first step too: decodes beside embedding chunks
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_only_last_pooling_reads_the_prefix_cache(llm, pooling):
    prompt = [{"last": 40, "mean": 41, "cls": 42}[pooling] + i for i in range(100)]  # a prompt of its own
    params = PoolingParams(pooling=pooling)
    first, second = (llm.embed({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] for _ in range(2))
    # 6 full blocks of 16 are cached after the first; mean and cls need every position's hidden state.
    assert [first.num_cached_tokens, second.num_cached_tokens] == [0, 96 if pooling == "last" else 0]
    assert torch.allclose(torch.tensor(first.outputs.embedding), torch.tensor(second.outputs.embedding), atol=1e-5)
    assert_all_blocks_free(llm)


def test_a_preempted_embedding_is_pooled_from_the_start_again(tiny_llm_dir, hf_model):
    # 24 blocks of 16 tokens: the generation (200 + 100 tokens) and the embedding (300) cannot both fit.
    llm = LLM(
        str(tiny_llm_dir), dtype="float32", kv_cache_memory=24 * 8192, max_model_len=320, max_num_batched_tokens=32
    )
    gen_prompt = [6 + (3 * i) % 240 for i in range(200)]
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    solo = llm.generate({"prompt_token_ids": gen_prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    embed_prompt = [8 + (17 * i) % 240 for i in range(300)]
    engine, params = llm.llm_engine, PoolingParams(pooling="mean")
    engine.add_request("gen", {"prompt_token_ids": gen_prompt}, greedy)
    engine.add_request("emb", {"prompt_token_ids": embed_prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert finished["gen"].outputs[0].token_ids == solo
    assert_matches(finished["emb"].outputs.embedding, hidden_states(hf_model, embed_prompt), params)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "inputs,params,field",
    [
        ({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=65), "pooling_params.dimensions"),
        ({"prompt_token_ids": list(range(3, 200)) * 3}, PoolingParams(), "prompt"),  # 591 > max_model_len=512
        ({"prompt_token_ids": [1, 256]}, PoolingParams(), "prompt.token_ids[1]"),
    ],
    ids=["dimensions-above-hidden-size", "longer-than-the-context", "token-id"],
)
def test_bad_embedding_requests_are_refused(llm, inputs, params, field):
    with pytest.raises(InvalidRequestError) as error:
        llm.embed(inputs, params, use_tqdm=False)
    assert error.value.field == field
    assert_all_blocks_free(llm)


def test_a_prompt_may_fill_the_context(llm, hf_model):
    prompt = [3 + (19 * i) % 250 for i in range(llm.llm_engine.max_model_len)]
    output = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)[0]
    assert_matches(output.outputs.embedding, hidden_states(hf_model, prompt), PoolingParams())


@pytest.fixture(scope="module")
def embedding_model_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved as transformers' ``LlamaModel``: no LM head, weights named without ``model.``."""
    path = tmp_path_factory.mktemp("tiny-llama-model")
    transformers.LlamaModel.from_pretrained(tiny_llm_dir, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llm_dir / name, path)
    return path


def test_a_llama_model_directory_serves_embeddings_only(embedding_model_dir):
    with safe_open(embedding_model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "norm.weight" in names and not any(n.startswith(("model.", "lm_head")) for n in names)
    llm = LLM(str(embedding_model_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=32)
    reference = transformers.LlamaModel.from_pretrained(embedding_model_dir, dtype=torch.float32).eval()
    params = PoolingParams(pooling="mean")
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], params, use_tqdm=False)
    for ids, output in zip(PROMPTS, outputs, strict=True):
        assert_matches(output.outputs.embedding, hidden_states(reference, ids), params)
    with pytest.raises(InvalidRequestError, match="embedding model") as error:
        llm.generate("hello", GREEDY, use_tqdm=False)
    assert error.value.field == "sampling_params"
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def client(backend):  # noqa: F811 - the fixture imported above
    server = ServerThread(backend)
    with server.client(timeout=60) as client:
        yield client
    server.close()


def test_embed_rpc_equals_transformers_in_input_order(client, hf_model):
    inputs = [TEXT, *PROMPTS]
    response = client.embed(inputs, "batch", pooling="mean", dimensions=32)
    assert response.request_id == "batch" and len(response.embeddings) == len(inputs)
    token_ids = [client.tokenize(TEXT), *PROMPTS]
    params = PoolingParams(pooling="mean", dimensions=32)
    for ids, embedding in zip(token_ids, response.embeddings, strict=True):
        assert embedding.prompt_tokens == len(ids)
        assert_matches(list(embedding.values), hidden_states(hf_model, ids), params)
    assert response.usage.prompt_tokens == sum(map(len, token_ids)) and response.usage.completion_tokens == 0
    default = client.embed(PROMPTS[1]).embeddings[0].values  # one input, pooled as the model's default
    assert_matches(list(default), hidden_states(hf_model, PROMPTS[1]), PoolingParams())


@pytest.mark.parametrize(
    "call,fields,message",
    [
        (lambda c: c.embed([]), ["inputs"], "no inputs"),
        (lambda c: c.embed(["fine", ""]), ["inputs[1]"], "empty"),
        (lambda c: c.embed([[1, 2], [3, 999]]), ["inputs[1].token_ids[1]"], "outside the vocabulary"),
        (lambda c: c.embed(["a", "b"], dimensions=65), ["pooling_params.dimensions"], "hidden size of 64"),
        (lambda c: c.embed("a", dimensions=0), ["pooling_params.dimensions"], ">= 1"),
    ],
    ids=["no-inputs", "empty-input", "token-id", "dimensions-above-hidden-size", "dimensions-zero"],
)
def test_bad_embed_calls_are_invalid_argument_with_the_field(client, call, fields, message):
    error = refusal(lambda: call(client))
    assert_invalid(error, fields, message)
    info = settled_info(client)
    assert info.num_free_kv_blocks == info.num_total_kv_blocks


SMOLLM2_TEXTS = [
    "Hello.",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away, there lived a dragon who loved to read books about " * 4,
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[LLM, transformers.PreTrainedModel]:
    """The embedded SmolLM2 in fp32, chunked at 64 tokens a step, and transformers' decoder of the same weights."""
    from spindle.backend.models.loader import resolve_model

    llm = LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=2048, max_num_batched_tokens=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32).model.eval()
    return llm, hf


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_smollm2_embeddings_equal_transformers(smollm2, pooling):
    llm, hf = smollm2
    params = PoolingParams(pooling=pooling)
    outputs = llm.embed(SMOLLM2_TEXTS, params, use_tqdm=False)
    assert len(outputs[-1].prompt_token_ids) > 64  # chunked
    for output in outputs:
        assert_matches(output.outputs.embedding, hidden_states(hf, output.prompt_token_ids), params)
    assert_all_blocks_free(llm)
