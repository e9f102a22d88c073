"""Logits processors: Spindle's no_repeat_ngram against transformers', a configured class, refusals, failures."""

import re

import pytest
import torch
from test_grpc import assert_invalid, refusal, served
from transformers import AutoModelForCausalLM

from spindle import LLM, SamplingParams, cli
from spindle.backend.logits_processors import LogitsProcessors
from spindle.shared.config import EngineConfig
from spindle.shared.errors import InvalidRequestError
from spindle.shared.sampling_params import LogitsProcessorSpec
from spindle.v1 import spindle_pb2

PROMPTS = [[5, 77, 140, 9, 33, 5, 77], [200, 13, 200, 13, 200]]
MAX_TOKENS = 24


class BanTokens:
    """A processor a test registers by ``module:Class``: the tokens it is given are never sampled."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.token_ids] = float("-inf")
        return logits


class Broken:
    """A processor that fails at every step (a bug in the server's own code)."""

    def __call__(self, prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("broken on purpose")


@pytest.fixture(scope="module")
def llm(tiny_llm_dir):
    configured = {"ban": f"{__name__}:BanTokens", "broken": f"{__name__}:Broken"}
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", logits_processors=configured)
    yield llm
    llm.shutdown()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, **kwargs)


def no_repeat(size: int) -> list[LogitsProcessorSpec]:
    return [LogitsProcessorSpec(name="no_repeat_ngram", args={"ngram_size": size})]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_repeat_ngram_matches_transformers(llm, tiny_llm_dir, size):
    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(logits_processors=no_repeat(size)))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            no_repeat_ngram_size=size,
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected
        tokens = prompt + expected
        for end in range(len(prompt), len(tokens)):  # no generated token completes an n-gram seen before it
            earlier = {tuple(tokens[i : i + size]) for i in range(end - size + 1)}
            assert tuple(tokens[end - size + 1 : end + 1]) not in earlier


def test_a_configured_class_runs_with_its_arguments(llm):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    free = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
    banned = sorted(set(free[:4]))
    spec = LogitsProcessorSpec(name="ban", args={"token_ids": banned})
    held = llm.generate(prompt, greedy(logits_processors=[spec]), use_tqdm=False)[0].outputs[0].token_ids
    assert not set(held) & set(banned) and held != free


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (LogitsProcessorSpec(name="nope"), "no logits processor is registered as 'nope' (known: ban, broken,"),
        (LogitsProcessorSpec(name="no_repeat_ngram", args={"ngram_size": 0}), "ngram_size must be an integer >= 1"),
        (LogitsProcessorSpec(name="ban", args={"tokens": [1]}), "refused its arguments {'tokens': [1]}"),
    ],
)
def test_bad_selections_are_refused_and_queue_nothing(llm, spec, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as refused:
        llm.generate("hi", greedy(logits_processors=[spec]), use_tqdm=False)
    assert refused.value.fields == ("sampling_params.logits_processors[0]",)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_processor_that_fails_leaves_its_row_unprocessed_and_the_batch_alone(llm):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    alone = llm.generate(prompts, greedy(), use_tqdm=False)
    params = [greedy(logits_processors=[LogitsProcessorSpec(name="broken")]), greedy(logits_processors=no_repeat(2))]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    expected_second = llm.generate(prompts[1], params[1], use_tqdm=False)[0]
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == expected_second.outputs[0].token_ids


def test_a_failing_class_is_logged_once_however_many_requests_use_it(caplog):
    registry = LogitsProcessors({"broken": f"{__name__}:Broken"})
    logits = torch.zeros(8)
    for _ in range(3):  # three requests, each with its own instance, over two steps
        [processor] = registry.build([LogitsProcessorSpec(name="broken")])
        for _ in range(2):
            assert registry.apply([processor], [1], [2], logits) is logits
    assert [r.getMessage() for r in caplog.records] == ["Logits processor Broken failed: the row is left unprocessed"]


def test_grpc_and_the_cli_select_processors_by_name_with_json_arguments(llm, tiny_llm_dir, capsys):
    expected = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(logits_processors=no_repeat(2)), use_tqdm=False)
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logits_processors=no_repeat(2))  # as the CLI asks
    text = llm.generate("so so so so", plain, use_tqdm=False)[0].outputs[0].text
    selection = [spindle_pb2.LogitsProcessor(name="no_repeat_ngram", args_json='{"ngram_size": 2}')]
    fields = {"temperature": 0, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS}
    with served(tiny_llm_dir) as server:
        with server.client(timeout=60) as client:
            tokens = [
                t
                for m in client.generate(PROMPTS[1], logits_processors=selection, **fields)
                for c in m.choices
                for t in c.token_ids
            ]
            bad_json = [spindle_pb2.LogitsProcessor(name="no_repeat_ngram", args_json="[2]")]
            error = refusal(lambda: client.generate("hi", logits_processors=bad_json, **fields))
        argv = ["generate", "so so so so", "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
        code = cli.main([*argv, "--logits-processor", 'no_repeat_ngram={"ngram_size": 2}', "--address", server.address])
        printed = capsys.readouterr().out
    assert tokens == expected[0].outputs[0].token_ids
    assert code == 0 and printed == text + "\n"
    assert_invalid(error, ["sampling_params.logits_processors"], "args_json must be a JSON object, not list")


def test_the_setting_takes_name_equals_module_class():
    config = EngineConfig.of(logits_processors=["ban=tests.module:Ban"])
    assert config.sampling.logits_processors == {"ban": "tests.module:Ban"}
    with pytest.raises(ValueError, match="logits processor 'ban' must be written name=module:Class"):
        EngineConfig.of(logits_processors=["ban"])
    with pytest.raises(ValueError, match=r"logits processor 'x': nowhere:X does not import"):
        LogitsProcessors({"x": "nowhere:X"})
