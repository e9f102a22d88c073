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
from transformers import AutoModelForCausalLM

from spindle import LLM
from spindle.shared.beam_search import BeamSearchParams
from spindle.shared.errors import InvalidRequestError

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
