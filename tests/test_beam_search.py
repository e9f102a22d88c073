"""Beam search (``LLM.beam_search``) against transformers' ``generate(num_beams=...)`` on the tiny random Llama.

The reference model's eos is moved to a token its beams often write, so that beams finish at eos, scores with the
length penalty rank finished beams against running ones, and each ``early_stopping`` rule decides when to stop.
"""

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_grpc import assert_invalid, refusal, served
from transformers import AutoModelForCausalLM

from spindle import LLM, cli
from spindle.shared.beam_search import BeamSearchParams
from spindle.shared.errors import InvalidRequestError
from spindle.v1 import spindle_pb2

PROMPTS = [[5, 77, 140, 9, 33], [200, 13], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]]
MAX_TOKENS = 10


def hf_beams(model, prompt: list[int], params: BeamSearchParams, eos: int) -> list[tuple[list[int], float]]:
    """transformers' ``beam_width`` beams of ``prompt``: (generated tokens, score), best first."""
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=params.beam_width,
        num_return_sequences=params.beam_width,
        max_new_tokens=params.max_tokens,
        do_sample=False,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        eos_token_id=eos,
        pad_token_id=eos,
        output_scores=True,
        return_dict_in_generate=True,
    )
    rows = [row[: row.index(eos) + 1] if eos in row else row for row in out.sequences[:, len(prompt) :].tolist()]
    if params.beam_width == 1:  # greedy search: the score is the tokens' log-probabilities' sum, length-penalised
        logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
        return [(rows[0], logprobs[: len(rows[0])].sum().item() / len(rows[0]) ** params.length_penalty)]
    return list(zip(rows, out.sequences_scores.tolist(), strict=True))


@pytest.fixture(scope="module")
def eos_model_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its eos moved to the token its 4-beam completions of :data:`PROMPTS` write most."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    unused = model.config.vocab_size  # an id no beam can write: nothing finishes before max_new_tokens
    counts = collections.Counter()
    for prompt in PROMPTS:
        for tokens, _ in hf_beams(model, prompt, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS), unused):
            counts.update(tokens[1:])  # not the first token: every beam would end at once
    eos = counts.most_common(1)[0][0]
    path = tmp_path_factory.mktemp("tiny-llm-eos")
    shutil.copytree(tiny_llm_dir, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (path / name).is_file():
            config = json.loads((path / name).read_text())
            config["eos_token_id"] = eos
            (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def llm(eos_model_dir: Path) -> LLM:
    llm = LLM(str(eos_model_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference_model(eos_model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(eos_model_dir, dtype=torch.float32).eval()


SEARCHES = {
    "width-1-is-greedy": BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS),
    "width-3": BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS),
    "width-4-early-stopping": BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, early_stopping=True),
    "width-5-long-favoured-never": BeamSearchParams(
        beam_width=5, max_tokens=MAX_TOKENS, length_penalty=2.0, early_stopping="never"
    ),
    "width-4-short-favoured": BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=-1.0),
    "width-6-ignore-eos": BeamSearchParams(beam_width=6, max_tokens=MAX_TOKENS, ignore_eos=True),
}


@pytest.mark.parametrize("params", SEARCHES.values(), ids=SEARCHES.keys())
def test_beams_and_scores_match_transformers(llm, reference_model, params):
    eos = llm.llm_engine.client.info.eos_token_ids[0]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        # transformers has no ignore_eos: an eos id outside the vocabulary is one no beam writes.
        expected = hf_beams(
            reference_model, prompt, params, reference_model.config.vocab_size if params.ignore_eos else eos
        )
        assert [s.output_token_ids for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.score for s in output.sequences] == pytest.approx([score for _, score in expected], abs=1e-4)
        for sequence in output.sequences:
            assert sequence.tokens[: len(prompt)] == prompt and sequence.num_prompt_tokens == len(prompt)
            assert sequence.score == pytest.approx(
                sequence.cum_logprob / len(sequence.output_token_ids) ** params.length_penalty
            )
            ended = sequence.output_token_ids[-1] == eos and not params.ignore_eos
            assert sequence.finish_reason == ("stop" if ended else "length")


def test_the_searches_finish_beams_at_eos(llm):
    """The moved eos is reached, so the comparisons above cover beams finished before max_tokens."""
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], SEARCHES["width-3"])
    reasons = [sequence.finish_reason for output in outputs for sequence in output.sequences]
    assert "stop" in reasons and "length" in reasons


def test_text_prompts_are_tokenized_and_completions_decoded(llm):
    text, tokens = llm.beam_search(
        ["hello", {"prompt_token_ids": llm.get_tokenizer().encode("hello")}], SEARCHES["width-3"]
    )
    assert [s.tokens for s in text.sequences] == [s.tokens for s in tokens.sequences]
    for sequence in text.sequences:
        assert sequence.text == llm.get_tokenizer().decode(sequence.output_token_ids)


def test_the_beams_share_their_prompt_blocks(llm):
    """A 24-token prompt is 3 full blocks of 8: after the first step, each beam's request finds them cached."""
    blocks = llm.llm_engine.engine_core.block_manager
    queries, hits = blocks.num_prefix_queries, blocks.num_prefix_hits
    prompt = list(range(100, 124))
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)  # 10 steps, whatever is written
    llm.beam_search({"prompt_token_ids": prompt}, params)
    requests = 1 + 3 * (MAX_TOKENS - 1)
    assert blocks.num_prefix_queries - queries == len(prompt) + sum(3 * (len(prompt) + n) for n in range(1, MAX_TOKENS))
    assert blocks.num_prefix_hits - hits >= len(prompt) * (requests - 1)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: BeamSearchParams(beam_width=0, max_tokens=4), "beam_width=0 is invalid"),
        (lambda: BeamSearchParams(beam_width=21, max_tokens=4), "beam_width=21 is invalid"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=0), "max_tokens=0 is invalid"),
        (lambda: BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan")), "must be a finite"),
    ],
)
def test_bad_parameters_are_refused(make, message):
    with pytest.raises(InvalidRequestError, match=message):
        make()


def test_a_width_past_the_logprobs_a_step_gives_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="beam_width=11 keeps 22 extensions .* at most 10"):
        llm.beam_search("hi", BeamSearchParams(beam_width=11, max_tokens=4))


@pytest.fixture(scope="module")
def server(eos_model_dir: Path):
    with served(eos_model_dir, backend_args={"block_size": 8}, max_n=4, max_tokens_limit=64) as server:
        yield server


def test_grpc_and_the_cli_give_the_llms_beams(llm, server, capsys):
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=0.5, early_stopping="never")
    expected = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, params)[0].sequences
    with server.client(timeout=60) as client:
        response = client.beam_search(
            PROMPTS[0], 4, MAX_TOKENS, length_penalty=0.5, early_stopping=spindle_pb2.EARLY_STOPPING_NEVER
        )
    assert response.finished and [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [list(c.token_ids) for c in response.choices] == [s.output_token_ids for s in expected]
    assert [c.cumulative_logprob for c in response.choices] == pytest.approx([s.cum_logprob for s in expected])
    assert [c.finish_reason for c in response.choices] == [
        spindle_pb2.FINISH_REASON_STOP if s.finish_reason == "stop" else spindle_pb2.FINISH_REASON_LENGTH
        for s in expected
    ]
    assert response.usage.prompt_tokens == len(PROMPTS[0]) and response.timings.total_seconds > 0
    text = llm.get_tokenizer().decode(PROMPTS[0])
    by_text = llm.beam_search(text, params)[0].sequences
    argv = ["beam-search", text, "--address", server.address, "--max-tokens", str(MAX_TOKENS)]
    assert cli.main([*argv, "--length-penalty", "0.5", "--early-stopping", "never"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["text"] for p in printed] == [s.text for s in by_text]
    assert [p["score"] for p in printed] == pytest.approx([s.score for s in by_text], abs=1e-5)


@pytest.mark.parametrize(
    ("call", "field", "message"),
    [
        (lambda c: c.beam_search("hi", 5, 4), "beam_search.beam_width", "above this server's limit of 4"),
        (lambda c: c.beam_search("hi", 2, 65), "beam_search.max_tokens", "above this server's limit of 64"),
        (lambda c: c.beam_search("hi", 0, 4), "beam_search.beam_width", "beam_width=0 is invalid"),
    ],
)
def test_grpc_refuses_bad_beam_searches(server, call, field, message):
    with server.client(timeout=60) as client:
        error = refusal(lambda: call(client))
    assert_invalid(error, [field], message)
