"""The closing search: a short completion of the grammar from where the output stands, in few tokens.

A raw vocabulary of the printable ASCII characters, a few non-ASCII words and some multi-character tokens (``"}``,
``"]}``) stands in for a model's: the search walks characters, then writes what it found in the fewest tokens.
"""

import json
import string

import pytest
import xgrammar

from spindle.backend.grammar_closer import GrammarCloser

VOCAB = [*string.printable, '"}', '"]}', "naïve", "日本", "<eos>"]
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def tokenizer_info() -> xgrammar.TokenizerInfo:
    return xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def compiler(tokenizer_info) -> xgrammar.GrammarCompiler:
    return xgrammar.GrammarCompiler(tokenizer_info, max_threads=1)


@pytest.fixture(scope="module")
def closer(tokenizer_info) -> GrammarCloser:
    return GrammarCloser(tokenizer_info)


def close(closer: GrammarCloser, grammar: xgrammar.CompiledGrammar, prefix: str) -> str | None:
    """The closing found after ``prefix`` (written a character a token), checked to complete the grammar."""
    matcher = xgrammar.GrammarMatcher(grammar, override_stop_tokens=[EOS])
    for character in prefix:
        assert matcher.accept_token(VOCAB.index(character))
    tokens = closer.closing(matcher)
    if tokens is None:
        return None
    assert not matcher.is_completed() or not tokens  # the matcher is left where it was
    assert all(matcher.accept_token(t) for t in tokens) and matcher.is_completed()
    return "".join(VOCAB[t] for t in tokens)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "n": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "tags", "ok"],
}


@pytest.mark.parametrize(
    ("prefix", "closing"),
    [
        ('{"name": "Par', '", "n": 0, "tags": [""], "ok": false}'),
        ('{"name": "P", "n": 2000000.000', ', "tags": [""], "ok": false}'),
        ('{"name": "P", "n": -', '0, "tags": [""], "ok": false}'),
        ('{"name": "P", "n": 2.5e', '0, "tags": [""], "ok": false}'),
        ('{"name": "P", "n": 2, "tags": ["a", "b', '"], "ok": false}'),
        ('{"name": "P", "n": 2, "tags": ["a"], "ok": tr', "ue}"),
        ('{"name": "P", "n": 2, "tags": ["a"], "ok": true', "}"),
        ('{"name": "P", "n": 2, "tags": ["', '"], "ok": false}'),
    ],
)
def test_a_json_value_closes_with_closers_first_and_required_parts_smallest(compiler, closer, prefix, closing):
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    assert close(closer, grammar, prefix) == closing
    json.loads(prefix + closing)


@pytest.mark.parametrize(
    ("spec", "prefix", "closing"),
    [
        (r"[a-z]+@[a-z]+\.com", "bob", "@a.com"),  # a character the letters come before is still reached
        (r"[a-z]+@[a-z]+\.com", "bob@ex", ".com"),
        (r"\d{3}-\d{4}", "55", "0-0000"),
        (r"(yes|no)!?", "yes", ""),  # complete already: nothing to add
    ],
)
def test_a_regex_closes(compiler, closer, spec, prefix, closing):
    assert close(closer, compiler.compile_regex(spec), prefix) == closing


def test_a_string_that_needs_characters_is_filled_with_letters(compiler, closer):
    schema = {"type": "object", "properties": {"id": {"type": "string", "minLength": 3}}, "required": ["id"]}
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert close(closer, grammar, '{"id": "x') == 'aa"}'


def test_non_ascii_words_are_reached_through_the_tokens_the_grammar_allows(compiler, closer):
    assert close(closer, compiler.compile_grammar('root ::= "naïve" | "日本"'), "") in ("naïve", "日本")


def test_the_closing_is_written_in_the_fewest_tokens(compiler, closer):
    """``"]}`` is one token of the vocabulary: the three characters the search finds become that token."""
    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"}}}, "required": ["t"]}
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgrammar.GrammarMatcher(grammar, override_stop_tokens=[EOS])
    assert all(matcher.accept_token(VOCAB.index(character)) for character in '{"t": ["a')
    assert closer.closing(matcher) == [VOCAB.index('"]}')]


def test_a_closing_out_of_reach_is_none(compiler, closer):
    """Past the search's length bound (a regex of 300 fixed characters), nothing is forced."""
    assert close(closer, compiler.compile_regex("a{300}"), "") is None


def test_the_openers_mask_holds_the_tokens_that_open_something(closer, tokenizer_info):
    bits = closer.openers.view(-1).tolist()
    marked = {t for t in range(len(VOCAB)) if bits[t // 32] >> (t % 32) & 1}
    assert marked == {VOCAB.index(c) for c in ",{["}  # no multi-character token of VOCAB holds one
