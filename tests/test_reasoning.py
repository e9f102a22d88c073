"""Reasoning parsers on the formats DeepSeek-R1 and Qwen3 write, whole and streamed token by token."""

import itertools
import json
import re
import time
from pathlib import Path
from typing import get_args

import pytest
import torch
from test_grpc import served

from spindle import LLM, SamplingParams, cli
from spindle.frontend.processing.reasoning import REASONING_PARSERS, ReasoningSplit, reasoning_parser
from spindle.shared.config import ReasoningParserName
from spindle.shared.sampling_params import LogitsProcessorSpec, StructuredOutput
from spindle.v1 import spindle_pb2

# Completions in the two families' formats, as their chat templates make the models write them, with the split
# each parser must give: (parser, text, reasoning, content).
COMPLETIONS = [
    # DeepSeek-R1 (and its distills): the template ends the prompt with "<think>\n"; the text closes the block.
    (
        "deepseek_r1",
        "Okay, so I need to add 2 and 3. That is 5.\n</think>\n\nThe sum of 2 and 3 is **5**.",
        "Okay, so I need to add 2 and 3. That is 5.\n",
        "\n\nThe sum of 2 and 3 is **5**.",
    ),
    # Older R1 builds write the start tag themselves.
    ("deepseek_r1", "<think>\nHmm, 7 is prime.\n</think>\n\nYes.", "\nHmm, 7 is prime.\n", "\n\nYes."),
    # Cut by max_tokens inside the block: all of it is reasoning.
    ("deepseek_r1", "Let me think step by step. First,", "Let me think step by step. First,", ""),
    # Qwen3 thinking: both tags in the text.
    (
        "qwen3",
        "<think>\nThe user wants the capital of France. It is Paris.\n</think>\n\nThe capital of France is Paris.",
        "\nThe user wants the capital of France. It is Paris.\n",
        "\n\nThe capital of France is Paris.",
    ),
    # Qwen3 with enable_thinking=False: the template wrote an empty block into the prompt; the text is the answer.
    ("qwen3", "The capital of France is Paris.", None, "The capital of France is Paris."),
    # Qwen3 cut inside its block.
    ("qwen3", "<think>\nFirst, recall that", "\nFirst, recall that", ""),
    # A block of nothing.
    ("qwen3", "<think>\n\n</think>\n\nHi!", "\n\n", "\n\nHi!"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), COMPLETIONS)
def test_a_finished_completion_splits_into_reasoning_and_content(name, text, reasoning, content):
    assert reasoning_parser(name).split(text, finished=True) == ReasoningSplit(reasoning, content)


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
@pytest.mark.parametrize(("name", "text", "reasoning", "content"), COMPLETIONS)
def test_streamed_parts_only_grow_and_add_up_to_the_whole(name, text, reasoning, content, size):
    """Token-sized pieces: no part shrinks (nothing streamed is taken back), no tag leaks out, and the last split,
    when the completion finishes, is the whole text's."""
    parser = reasoning_parser(name)
    shown = ReasoningSplit(None, "")
    so_far = ""
    for piece in pieces(text, size):
        so_far += piece
        split = parser.split(so_far, finished=False)
        assert (split.reasoning or "").startswith(shown.reasoning or "") and split.content.startswith(shown.content)
        assert "</think>" not in (split.reasoning or "") and "<think" not in (split.reasoning or "")
        shown = split
    final = parser.split(so_far, finished=True)
    assert final == ReasoningSplit(reasoning, content)
    assert (final.reasoning or "").startswith(shown.reasoning or "") and final.content.startswith(shown.content)


def test_a_tail_that_may_begin_the_end_tag_is_held_back_until_it_is_known():
    parser = reasoning_parser("deepseek_r1")
    assert parser.split("Five is odd.</thi", finished=False) == ReasoningSplit("Five is odd.", "")
    assert parser.split("Five is odd.</thin", finished=True) == ReasoningSplit("Five is odd.</thin", "")
    assert parser.split("a < b", finished=False) == ReasoningSplit("a < b", "")  # "<" then " ": no tag


def test_unknown_parsers_are_refused_with_the_names():
    """The engine's setting takes exactly the parsers' names."""
    assert set(get_args(ReasoningParserName)) == set(REASONING_PARSERS)
    assert reasoning_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2': the parsers are deepseek_r1, qwen3"):
        reasoning_parser("r2")
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]


class Write:
    """A logits processor the tests register: the output starts with ``token_ids``, whatever the model prefers."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, prompt_token_ids: list[int], output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) < len(self.token_ids):
            forced = self.token_ids[len(output_token_ids)]
            logits[torch.arange(len(logits)) != forced] = float("-inf")
        return logits


# A thinking block written for the tiny random model (by the processor), then an answer its regex constrains: the
# grammar applies after the block, to the answer alone.
THOUGHTS = "<think>two and two</think>"
ANSWER = "[a-z]{2,6}"
PROCESSORS = {"write": f"{__name__}:Write"}


def thinking_params(llm: LLM) -> SamplingParams:
    """Greedy, the thinking block written first, the answer constrained."""
    thoughts = llm.get_tokenizer().encode(THOUGHTS, add_special_tokens=False)
    return SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_output=StructuredOutput(regex=ANSWER),
        logits_processors=[LogitsProcessorSpec(name="write", args={"token_ids": thoughts})],
    )


@pytest.fixture(scope="module")
def llm(tiny_llm_dir):
    llm = LLM(
        str(tiny_llm_dir),
        dtype="float32",
        kv_cache_memory="4MiB",
        reasoning_parser="qwen3",
        logits_processors=PROCESSORS,
    )
    yield llm
    llm.shutdown()


def expected_split(text: str) -> tuple[str, str]:
    """The thinking block and the answer, split by hand; the answer follows its grammar."""
    match = re.fullmatch(r"<think>(.*)</think>(.*?)#?", text, re.S)
    assert match is not None and re.fullmatch(ANSWER, match[2]), text
    return match[1], match[2]


def test_the_llm_gives_reasoning_apart_from_the_answer(llm):
    completion = llm.generate("Question:", thinking_params(llm), use_tqdm=False)[0].outputs[0]
    raw = llm.get_tokenizer().decode(completion.token_ids)  # the text the model wrote, tags and all
    assert (completion.reasoning_content, completion.text.removesuffix("#")) == expected_split(raw)
    assert completion.reasoning_content == "two and two"


def test_a_prompt_whose_thinking_block_is_closed_is_constrained_from_the_start(llm):
    """Qwen3 with ``enable_thinking=False`` ends its prompt with an empty block: the grammar applies at once."""
    params = SamplingParams(temperature=0, max_tokens=40, structured_output=StructuredOutput(regex=ANSWER))
    completion = llm.generate("Question: <think>\n\n</think>\n\n", params, use_tqdm=False)[0].outputs[0]
    assert completion.reasoning_content is None and re.fullmatch(ANSWER, completion.text.removesuffix("#"))
    thinking = llm.generate("Question: <think>", params, use_tqdm=False)[0].outputs[0]  # a block left open
    assert "</think>" not in thinking.text and not re.fullmatch(ANSWER, thinking.text.removesuffix("#"))


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "cumulative"])
def test_each_step_of_a_stream_carries_only_new_reasoning_and_content(llm, delta):
    engine = llm.llm_engine
    engine.add_request("r", "Question:", thinking_params(llm), delta=delta)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [out.outputs[0] for out in engine.step()]
    raw = llm.get_tokenizer().decode([t for c in outputs for t in c.token_ids] if delta else outputs[-1].token_ids)
    thoughts, answer = expected_split(raw)
    if delta:
        assert "".join(c.reasoning_content or "" for c in outputs) == thoughts
        assert "".join(c.text for c in outputs).removesuffix("#") == answer
        assert all(c.reasoning_content is None or c.reasoning_content for c in outputs)  # no empty parts
    else:
        for before, after in itertools.pairwise(outputs):  # cumulative parts only grow
            assert (after.reasoning_content or "").startswith(before.reasoning_content or "")
            assert after.text.startswith(before.text)
        assert (outputs[-1].reasoning_content, outputs[-1].text.removesuffix("#")) == (thoughts, answer)


def test_grpc_streams_reasoning_apart_and_ends_with_the_request_timings(tiny_llm_dir, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the backend child imports Write from here
    backend_args = {"logits_processors": PROCESSORS}
    with served(tiny_llm_dir, engine_args={"reasoning_parser": "qwen3"}, backend_args=backend_args) as server:
        with server.client(timeout=30) as client:
            start = time.time()
            thoughts = client.tokenize(THOUGHTS, add_special_tokens=False)
            write = spindle_pb2.LogitsProcessor(name="write", args_json=json.dumps({"token_ids": thoughts}))
            constraint = spindle_pb2.StructuredOutput(regex=ANSWER)
            messages = list(
                client.generate(
                    "Question:", temperature=0, max_tokens=40, structured_output=constraint, logits_processors=[write]
                )
            )
        # The CLI: the answer on stdout, the thoughts on stderr.
        argv = ["generate", "Question:", "--regex", ANSWER, "--temperature", "0", "--max-tokens", "40"]
        argv += ["--logits-processor", f"write={write.args_json}"]
        assert cli.main([*argv, "--address", server.address]) == 0
        printed = capsys.readouterr()
    deltas = [delta for message in messages for delta in message.choices]
    thoughts = "".join(d.reasoning_content for d in deltas if d.HasField("reasoning_content"))
    answer = "".join(d.text for d in deltas).removesuffix("#")
    assert thoughts == "two and two" and re.fullmatch(ANSWER, answer)
    assert printed.out.strip().removesuffix("#") == answer and printed.err.strip() == thoughts
    last = messages[-1]
    assert last.finished and not any(m.HasField("timings") for m in messages[:-1])
    timings = last.timings
    assert start - 1 <= timings.arrival_time <= time.time()
    assert 0 <= timings.queue_seconds <= timings.time_to_first_token_seconds <= timings.total_seconds
    assert timings.total_seconds == pytest.approx(timings.time_to_first_token_seconds + timings.decode_seconds)
