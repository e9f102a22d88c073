import random
from dataclasses import dataclass, field

import pytest
from tokenizers.decoders import DecodeStream

from spindle import SamplingParams
from spindle.frontend.processing.detokenizer import IncrementalDetokenizer
from spindle.frontend.processing.tokenizer import Tokenizer

pytest_plugins = ["fixtures_tokenizer"]

PROMPT = "Question: say something.\nAnswer:"
TEXTS = [
    " The cat sat on the mat, then it ran away!",
    " Emoji 😀🎉👍🏽 and CJK 你好世界, 日本語 and naïve café.",
    "\n\ndef f(x):\n    return x ** 2\n",
    " 🧑‍🚀 spacer",
]
ANSWER = " The answer is forty-two. Done."


@dataclass
class Run:
    """What streaming one completion through a detokenizer produced."""

    detokenizer: IncrementalDetokenizer
    deltas: list[str] = field(default_factory=list)
    stop: str | None = None
    tokens_used: int = 0


def stream(
    tokenizer: Tokenizer, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], chunk: int = 1
) -> Run:
    """Feed ``output_ids`` in chunks as an engine would, reading a delta after each, until a stop string."""
    run = Run(IncrementalDetokenizer(tokenizer, params, prompt_ids))
    for start in range(0, len(output_ids), chunk):
        run.tokens_used = min(start + chunk, len(output_ids))
        run.stop = run.detokenizer.update(output_ids[start : start + chunk])
        if run.stop is not None:
            break
        run.deltas.append(run.detokenizer.get_delta())
    run.deltas.append(run.detokenizer.get_delta(finished=True))
    return run


def continuation(hf, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True) -> str:
    """The reference: what decoding the output after the prompt adds to the prompt's own decoded text."""
    full = hf.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    prompt = hf.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    assert full.startswith(prompt)
    return full[len(prompt) :]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_real_text_streams_as_the_reference_decodes_it(tokenizer_pair, text, chunk):
    ours, hf = tokenizer_pair
    prompt_ids = hf.encode(PROMPT)
    output_ids = hf.encode(text, add_special_tokens=False)
    run = stream(ours, SamplingParams(), prompt_ids, output_ids, chunk)
    # Llama-style encoding prepends a "▁" to the text, so the reference is the decoding, not the text.
    assert run.detokenizer.output_text == "".join(run.deltas) == continuation(hf, prompt_ids, output_ids)
    assert run.detokenizer.output_text.strip() == text.strip()
    assert not any("\ufffd" in delta for delta in run.deltas)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)],
    ids=["skip_special", "keep_special_unspaced"],
)
def test_random_token_sequences_stream_as_the_reference_decodes_them(tokenizer, hf_tokenizer, params):
    rng = random.Random(1234)
    prompt_ids = hf_tokenizer.encode(PROMPT)
    # A final ASCII token completes any character the random bytes left open, so the reference has nothing
    # pending either; invalid bytes in the middle come out as U+FFFD in both.
    end = hf_tokenizer.encode("x")
    for _ in range(200):
        output_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))] + end
        run = stream(tokenizer, params, prompt_ids, output_ids, chunk=rng.choice([1, 2, 5]))
        expected = continuation(hf_tokenizer, prompt_ids, output_ids, params.skip_special_tokens)
        assert run.detokenizer.output_text == "".join(run.deltas) == expected


def test_characters_split_over_byte_tokens_come_out_whole(tokenizer_pair):
    ours, hf = tokenizer_pair
    output_ids = hf.encode("😀你", add_special_tokens=False)
    assert any(ours.decode([token_id]).endswith("\ufffd") for token_id in output_ids), "no character was split"
    run = stream(ours, SamplingParams(), hf.encode(PROMPT), output_ids)
    assert [delta for delta in run.deltas if delta.strip()] == ["😀", "你"]


def test_the_first_token_gets_its_leading_space_from_the_prompt(llama_style_tokenizer, hf_llama_style):
    ids = hf_llama_style.encode("Hello the cat")
    prompt_ids, output_ids = ids[:2], ids[2:]
    assert hf_llama_style.decode(output_ids) == "the cat"  # alone, the decoder strips the leading space
    run = stream(llama_style_tokenizer, SamplingParams(), prompt_ids, output_ids)
    assert run.detokenizer.output_text == continuation(hf_llama_style, prompt_ids, output_ids) == " the cat"


def test_a_character_begun_in_the_prompt_comes_out_whole(tokenizer, hf_tokenizer):
    ids = hf_tokenizer.encode("a😀b")
    prompt_ids = ids[:2]  # "a" and the emoji's first byte
    assert hf_tokenizer.decode(prompt_ids) == "a\ufffd"
    run = stream(tokenizer, SamplingParams(), prompt_ids, ids[2:])
    assert run.detokenizer.output_text == "".join(run.deltas) == "😀b"


def test_invalid_utf8_that_breaks_the_decode_stream_is_survived(llama_style_tokenizer, hf_llama_style):
    backend = llama_style_tokenizer.backend
    # An ASCII byte token, then a stray continuation byte: decoded together they become U+FFFD, which changes
    # text DecodeStream already returned.
    output_ids = [backend.token_to_id("<0x41>"), backend.token_to_id("<0x80>")]
    output_ids += hf_llama_style.encode(" the cat", add_special_tokens=False)
    raw = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for token_id in output_ids:
            raw.step(backend, token_id)
    run = stream(llama_style_tokenizer, SamplingParams(), hf_llama_style.encode("Hi"), output_ids)
    assert run.detokenizer.output_text.startswith("A")
    assert run.detokenizer.output_text.endswith(hf_llama_style.decode(output_ids[2:]))


def tokens_to_complete(hf, output_ids: list[int], text: str) -> int:
    """The reference for when a stop must fire: the fewest output tokens whose decoded text contains ``text``."""
    return next(n for n in range(1, len(output_ids) + 1) if text in hf.decode(output_ids[:n]))


@pytest.mark.parametrize(
    "stops,include,matched,kept",
    [
        (["swer is fo"], False, "swer is fo", " The an"),
        (["swer is fo"], True, "swer is fo", " The answer is fo"),
        ([" The"], False, " The", ""),
        (["nowhere", "is forty", "forty"], False, "is forty", " The answer "),
        (["forty", "is forty"], True, "is forty", " The answer is forty"),
    ],
    ids=["spans_tokens", "spans_tokens_included", "at_start", "earliest_wins", "earliest_wins_included"],
)
def test_stop_strings(tokenizer, hf_tokenizer, stops, include, matched, kept):
    output_ids = hf_tokenizer.encode(ANSWER, add_special_tokens=False)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    run = stream(tokenizer, params, hf_tokenizer.encode(PROMPT), output_ids)
    assert run.stop == matched
    assert run.tokens_used == tokens_to_complete(hf_tokenizer, output_ids, matched)
    assert run.detokenizer.output_text == "".join(run.deltas) == kept


@pytest.mark.parametrize(
    "stops,matched",
    [
        (["Done", "forty", "answer"], "answer"),
        (["answer is", "answer"], "answer is"),  # both start at the same place: the first given wins
        (["answer", "answer is"], "answer"),
    ],
)
def test_all_stops_completed_by_one_update_the_earliest_wins(tokenizer, hf_tokenizer, stops, matched):
    params = SamplingParams(stop=stops, include_stop_str_in_output=True)
    output_ids = hf_tokenizer.encode(ANSWER, add_special_tokens=False)
    run = stream(tokenizer, params, hf_tokenizer.encode(PROMPT), output_ids, chunk=len(output_ids))
    assert (run.stop, run.detokenizer.output_text) == (matched, f" The {matched}")


def test_stop_strings_are_not_searched_in_the_prompt(tokenizer, hf_tokenizer):
    params = SamplingParams(stop=["Answer", "on"])
    run = stream(tokenizer, params, hf_tokenizer.encode(PROMPT), hf_tokenizer.encode(" ok", add_special_tokens=False))
    assert run.stop is None and run.detokenizer.output_text == " ok"


@pytest.mark.parametrize(
    "stops,include,final",
    [
        (["forty-two!"], False, ANSWER),
        (["forty-two!"], True, ANSWER),
        (["Done", "x"], False, " The answer is forty-two. "),
        (["Done"], True, " The answer is forty-two. Done"),
        (None, False, ANSWER),
    ],
)
def test_deltas_hold_back_what_may_become_a_stop_string(tokenizer, hf_tokenizer, stops, include, final):
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    holdback = max(map(len, stops)) - 1 if stops and not include else 0
    detokenizer = IncrementalDetokenizer(tokenizer, params, hf_tokenizer.encode(PROMPT))
    streamed = ""
    for token_id in hf_tokenizer.encode(ANSWER, add_special_tokens=False):
        if detokenizer.update([token_id]) is not None:
            break
        streamed += detokenizer.get_delta()
        assert streamed == detokenizer.output_text[: max(0, len(detokenizer.output_text) - holdback)]
        assert final.startswith(streamed)  # nothing streamed is ever taken back
    assert streamed + detokenizer.get_delta(finished=True) == detokenizer.output_text == final
    assert detokenizer.get_delta(finished=True) == ""


CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
CHAT_REPLY = "Sure.<|im_end|><|im_start|>assistant\nOK<|im_end|>"


@pytest.mark.parametrize(
    "skip,spaces,prompt,expected",
    [
        (True, True, CHAT_PROMPT, "Sure.assistant\nOK"),
        (False, False, CHAT_PROMPT, CHAT_REPLY),
        (False, True, CHAT_PROMPT, "Sure. <|im_end|> <|im_start|> assistant\nOK <|im_end|>"),
        (False, True, "<|im_start|>", " Sure. <|im_end|> <|im_start|> assistant\nOK <|im_end|>"),
    ],
    ids=["skipped", "kept_unspaced", "kept_spaced", "kept_spaced_after_a_special_prompt_end"],
)
def test_special_token_flags(tokenizer, hf_tokenizer, skip, spaces, prompt, expected):
    output_ids = hf_tokenizer.encode(CHAT_REPLY)
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    for chunk in (1, len(output_ids)):
        run = stream(tokenizer, params, hf_tokenizer.encode(prompt), output_ids, chunk)
        assert run.detokenizer.output_text == "".join(run.deltas) == expected
    if not spaces or skip:
        assert expected == hf_tokenizer.decode(output_ids, skip_special_tokens=skip)


def test_spaced_special_tokens_split_the_text_into_separately_decoded_pieces(llama_style_tokenizer, hf_llama_style):
    bos, eos = hf_llama_style.bos_token_id, hf_llama_style.eos_token_id
    words = hf_llama_style.encode("Hello the cat", add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=False)
    run = stream(llama_style_tokenizer, params, [bos], [*words, eos])
    # Slow tokenizers (and vLLM) decode the text between special tokens on its own, then join with spaces.
    pieces = [hf_llama_style.decode([bos], skip_special_tokens=False), hf_llama_style.decode(words), "</s>"]
    assert run.detokenizer.output_text == " ".join(pieces).removeprefix("<s>") == " Hello the cat </s>"
