"""Structured output: specs, compiling off the step loop, masked sampling, and the constraint through every path.

The tiny random Llama with its byte-level tokenizer (one token per byte) checks the mechanics: regex and choice
outputs match whatever the weights prefer, greedy and sampled, with n > 1, speculation, preemption and stop
strings, and an unconstrained request in the same steps keeps its own tokens. SmolLM2 checks JSON schemas through
gRPC (a random model's strings need not end; a real one's do).
"""

import json
import math
import os
import re
import time
from types import SimpleNamespace

import grpc
import jsonschema
import pytest
from test_grpc import ServerThread, assert_invalid, collect, refusal
from waiting import wait_until

from spindle import LLM
from spindle.backend import grammar_compiler, structured_output
from spindle.backend.grammar_compiler import CompileAbandonedError
from spindle.backend.structured_output import StructuredOutputManager
from spindle.frontend.engine.connection import ping_backend, start_backend
from spindle.frontend.engine.llm_engine import LLMEngine
from spindle.frontend.grpc.mapping import structured_output_from_proto
from spindle.shared import CompletionOutput, SamplingParams, StructuredOutput
from spindle.shared.config import EngineConfig
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.v1 import spindle_pb2

PHONE = r"\d{3}-\d{4}"
CHOICES = ["yes", "no", 'a "quoted"\nline', "naïve"]
# Minutes to compile (xgrammar expands the optional properties' orders), though its text is only 86 kB.
SLOW_SCHEMA = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}})
CRASH_GRAMMAR = 'root ::= "crash"'


def compile_or_abort(kind: str, text: str) -> str:
    """The compile workers' function, but the worker aborts (as a crash in native code would) on CRASH_GRAMMAR."""
    if text == CRASH_GRAMMAR:
        os.abort()
    return grammar_compiler.compile_in_worker(kind, text)


@pytest.fixture(scope="module")
def llm(tiny_llm_dir) -> LLM:
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def manager(tiny_llm_dir) -> StructuredOutputManager:
    """A manager whose compiles may take 2 s (the specs below that compile take milliseconds)."""
    manager = StructuredOutputManager(tiny_llm_dir, 256, [2], compile_timeout=2)
    yield manager
    manager.shutdown()


def answer(completion: CompletionOutput) -> str:
    """The text without the tiny tokenizer's eos (id 2, ``#``), which is not a special token there, so not skipped."""
    return completion.text.removesuffix("#") if completion.token_ids[-1:] == [2] else completion.text


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[str]]:
    """The texts of each prompt's completions."""
    return [[answer(c) for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "kwargs,field,message",
    [
        ({}, "sampling_params.structured_output", "got none"),
        ({"regex": "a", "choice": ["b"]}, "sampling_params.structured_output", "got regex, choice"),
        ({"json_schema": "{"}, "sampling_params.structured_output.json_schema", "not valid JSON"),
        ({"json_schema": "[1]"}, "sampling_params.structured_output.json_schema", "not list"),
        ({"regex": ""}, "sampling_params.structured_output.regex", "empty"),
        ({"choice": ["a", ""]}, "sampling_params.structured_output.choice", "no empty one"),
    ],
)
def test_a_malformed_spec_is_refused_when_built(kwargs, field, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        StructuredOutput(**kwargs)
    assert error.value.fields == (field,)


def test_a_dict_schema_becomes_json_text():
    spec = StructuredOutput(json_schema={"type": "integer"})
    assert spec.kind == "json_schema" and json.loads(spec.json_schema) == {"type": "integer"}


@pytest.mark.parametrize(
    "spec,field,message",
    [
        (StructuredOutput(grammar='root ::= "a" |'), "grammar", "EBNF parser error"),
        (StructuredOutput(regex="(ab"), "regex", "parenthesis is not closed"),
        (StructuredOutput(json_schema='{"type": "nonsense"}'), "json_schema", 'Unsupported type "nonsense"'),
    ],
)
def test_the_compiler_message_names_the_field(manager, spec, field, message):
    with pytest.raises(InvalidRequestError) as error:
        manager.compile(spec).result(60)
    assert error.value.fields == (f"sampling_params.structured_output.{field}",)
    assert message in str(error.value) and not str(error.value).startswith("[")  # xgrammar's log prefix is gone


def test_a_spec_compiles_once(manager):
    first = manager.compile(StructuredOutput(regex=PHONE + "y"))
    first.result(60)
    compiles = manager.compiler.num_compiles
    assert manager.compile(StructuredOutput(regex=PHONE + "y")) is first
    assert manager.compiler.num_compiles == compiles  # a cache hit compiles nothing
    assert manager.compile(StructuredOutput(regex=PHONE + "x")) is not first
    wait_until(lambda: manager.compiler.num_compiles == compiles + 1, "the other spec is sent to a worker")


def compiled(manager: StructuredOutputManager, request_id: str) -> None:
    """Wait for the request's grammar, its sequences' matchers started."""
    wait_until(lambda: not manager.collect() and not manager.is_compiling(request_id), "the grammar compiled")


def test_a_thinking_sequence_is_free_until_its_thinking_ends(manager, llm):
    """Its tokens only bring it to the end of the thinking block; the grammar constrains the tokens after it."""
    ids = llm.get_tokenizer().encode("x</t>ab", add_special_tokens=False)
    end, eos = ids[1:5], 2
    manager.add_request("think", [901], StructuredOutput(regex="ab"), after=end)
    compiled(manager, "think")
    assert manager.follows(901) and not manager.is_constrained(901)
    # Drafts stop short of the block's last token: the token sampled after them would escape the grammar.
    assert manager.allowed_drafts(901, ids[:7]) == ids[:4]
    assert not any(manager.advance("think", 901, token_id) for token_id in ids[:5])
    assert manager.is_constrained(901) and manager.allowed_drafts(901, ids[5:]) == ids[5:]
    assert not manager.advance("think", 901, ids[5]) and not manager.advance("think", 901, ids[6])
    assert manager.advance("think", 901, eos)  # the grammar is complete
    # A resumed sequence replays its thinking and the answer after it.
    manager.add_request("resumed", [902], StructuredOutput(regex="ab"), replay={902: ids[:6]}, after=end)
    compiled(manager, "resumed")
    assert manager.is_constrained(902) and manager.allowed_drafts(902, [ids[6], ids[6]]) == [ids[6]]  # past "a"
    assert not manager.advance("resumed", 902, ids[6]) and manager.advance("resumed", 902, eos)
    manager.remove_request("think", [901])
    manager.remove_request("resumed", [902])


def test_a_spec_past_the_timeout_stays_refused_for_a_while(manager, monkeypatch):
    spec = StructuredOutput(json_schema=SLOW_SCHEMA)
    with pytest.raises(CompileAbandonedError, match="the json_schema did not compile within 2 s") as error:
        manager.compile(spec).result(60)
    assert error.value.fields == ("sampling_params.structured_output.json_schema",)
    compiles = manager.compiler.num_compiles
    with pytest.raises(CompileAbandonedError):
        manager.compile(spec).result(0)  # refused at once: no worker spends another 2 s on it
    assert manager.compiler.num_compiles == compiles
    later = time.monotonic() + structured_output.REFUSAL_TTL
    monkeypatch.setattr(structured_output, "time", SimpleNamespace(monotonic=lambda: later))
    retried = manager.compile(spec)
    wait_until(lambda: manager.compiler.num_compiles == compiles + 1, "the spec is compiled again once its TTL ends")
    with pytest.raises(CompileAbandonedError):
        retried.result(60)


def test_a_tokenizer_xgrammar_cannot_load_makes_the_backend_unavailable_until_it_can(tiny_llm_dir, monkeypatch):
    manager = StructuredOutputManager(tiny_llm_dir, 256, [2])
    load = manager.compiler._load_tokenizer_info

    def broken_load() -> None:
        raise OSError("no tokenizer.json")

    try:
        monkeypatch.setattr(manager.compiler, "_load_tokenizer_info", broken_load)
        with pytest.raises(EngineUnavailableError, match="structured output is unavailable.*no tokenizer.json"):
            manager.compile(StructuredOutput(regex=PHONE)).result(60)
        monkeypatch.setattr(manager.compiler, "_load_tokenizer_info", load)
        assert manager.compile(StructuredOutput(regex=PHONE)).result(60) is not None  # not cached: tried again
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0},
        {"temperature": 1.0, "seed": 3, "n": 3},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "n": 2},
        {"temperature": 0, "num_speculative_tokens": 4, "repetition_penalty": 1.2},
        {"temperature": 0.7, "logprobs": 3, "presence_penalty": 1.0},
    ],
)
def test_regex_and_choice_outputs_match(llm, params):
    # The prompts hold the answers, so that speculation has drafts to propose.
    prompts = ["call 555-0123 or 555-9876 now", "yes or no? " + " ".join(CHOICES)]
    specs = [StructuredOutput(regex=PHONE), StructuredOutput(choice=CHOICES)]
    out = llm.generate(
        prompts, [SamplingParams(max_tokens=40, structured_output=s, **params) for s in specs], use_tqdm=False
    )
    phones, choices = out
    assert all(re.fullmatch(PHONE, answer(c)) and c.finish_reason == "stop" for c in phones.outputs), phones.outputs
    assert all(answer(c) in CHOICES and c.finish_reason == "stop" for c in choices.outputs), choices.outputs
    if params.get("logprobs"):
        # Logprobs are those of the constrained distribution: the "-" after three digits is certain.
        assert all(c.logprobs[3][c.token_ids[3]].logprob == pytest.approx(0) for c in phones.outputs)


@pytest.mark.parametrize(
    ("literal", "accepted"),
    [
        ("1.5", True),
        ("-0.25e-7", True),
        ("1234567890123456", True),  # 16 digits
        ("12345678901234567", False),  # 17
        ("0." + "1" * 16, True),
        ("0." + "1" * 17, False),
        ("2000000000.000000000125000022393411251", False),  # what a model wrote until max_tokens cut it
        ("1e308", True),
        ("1E+299", True),
        ("1e309", False),  # past a double: inf
        ("1e1000", False),
    ],
)
def test_json_number_literals_are_bounded_to_what_a_double_holds(literal, accepted):
    import xgrammar

    schema = json.dumps({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    ebnf = grammar_compiler.bounded_numbers(str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)))
    # Within the bounds a literal parses to a finite double; past them the grammar refuses it.
    assert (
        xgrammar.testing._is_grammar_accept_string(xgrammar.Grammar.from_ebnf(ebnf), f'{{"x": {literal}}}') is accepted
    )
    assert math.isfinite(float(literal)) or not accepted


def test_bounding_numbers_keeps_every_schema_shape_compiling():
    """The ten shapes below (bounded strings, ranges, nesting) compile with their numbers bounded."""
    import xgrammar

    for schema in SCHEMAS:
        ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        xgrammar.Grammar.from_ebnf(grammar_compiler.bounded_numbers(ebnf))


def test_a_model_that_favours_digits_still_ends_its_json(llm):
    """Digits biased up, a number would run until max_tokens cut the JSON; bounded, the object closes and parses."""
    digits = {token: 8.0 for token in llm.get_tokenizer().encode("0123456789", add_special_tokens=False)}
    schema = {"type": "object", "properties": {"population": {"type": "number"}}, "required": ["population"]}
    params = SamplingParams(
        temperature=0, max_tokens=80, logit_bias=digits, structured_output=StructuredOutput(json_schema=schema)
    )
    completion = llm.generate("The population is", params, use_tqdm=False)[0].outputs[0]
    value = json.loads(answer(completion))["population"]
    assert completion.finish_reason == "stop" and math.isfinite(value)


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "size": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
    "required": ["name", "tags", "size"],
}


@pytest.mark.parametrize(
    ("max_tokens", "name", "finish_reason"),
    # 44 tokens (one a byte) hold the smallest valid object exactly; with 61, the name runs until the closing
    # (36 tokens from inside it) and its margin of 8 take all the room left, and eos ends it early.
    [(44, "", "length"), (61, "hhhhhhhhc", "stop")],
)
def test_a_constrained_output_near_max_tokens_closes_and_parses(llm, max_tokens, name, finish_reason):
    """Letters biased up, the name string would run past max_tokens; its shortest closing is forced in time."""
    letters = {token: 8.0 for token in llm.get_tokenizer().encode("abcdefgh", add_special_tokens=False)}
    spec = StructuredOutput(json_schema=NESTED)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias=letters, structured_output=spec)
    completion = llm.generate("Name:", params, use_tqdm=False)[0].outputs[0]
    value = json.loads(answer(completion))
    assert value == {"name": name, "tags": [""], "size": {"n": 0}} and completion.finish_reason == finish_reason
    assert len(completion.token_ids) == min(max_tokens, len(answer(completion)) + 1)


POINTS = {
    "type": "array",
    "items": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    "minItems": 1,
}


def test_near_its_limit_an_output_opens_nothing_more(llm):
    """Biased to open a new element at every turn, each output still closes, whatever its max_tokens falls on.

    A ``,`` opening one more ``{"x": 0}`` lengthens the closing by 9 tokens at once, more than the margin: near the
    limit such a token is masked, so the closing always fits.
    """
    openers = {token: 6.0 for token in llm.get_tokenizer().encode(',{}"x: 0', add_special_tokens=False)}
    spec = StructuredOutput(json_schema=POINTS)
    params = [
        SamplingParams(temperature=0, max_tokens=n, logit_bias=openers, structured_output=spec) for n in range(24, 56)
    ]
    outputs = llm.generate(["Points:"] * len(params), params, use_tqdm=False)
    values = [json.loads(answer(output.outputs[0])) for output in outputs]
    assert all(len(value) >= 1 for value in values) and max(map(len, values)) > 2  # several elements opened


def test_close_at_max_tokens_false_lets_the_limit_cut(llm):
    letters = {token: 8.0 for token in llm.get_tokenizer().encode("abcdefgh", add_special_tokens=False)}
    spec = StructuredOutput(json_schema=NESTED, close_at_max_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=61, logit_bias=letters, structured_output=spec)
    completion = llm.generate("Name:", params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 61
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer(completion))


STRUCTURAL_TAGS = {
    "format": {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "<answer>"},
                {
                    "type": "json_schema",
                    "json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                },
                {"type": "const_string", "value": "</answer>"},
            ],
        },
    },
    "legacy": {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"enum": [1, 2]}, "end": "</f>"}],
        "triggers": ["<f>"],
    },
}


@pytest.mark.parametrize("form", STRUCTURAL_TAGS)
def test_a_structural_tag_constrains_the_output(llm, form):
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=60, structured_output=StructuredOutput(structural_tag=STRUCTURAL_TAGS[form])
    )
    text = answer(llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0])
    if form == "format":
        match = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)  # the format allows whitespace in the JSON
        assert match is not None and isinstance(json.loads(match[1])["n"], int), text
    else:  # free text; each call of the structure holds what its schema allows
        assert all(call in ("1", "2") for call in re.findall(r"<f>(.*?)</f>", text)), text


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("[1]", "must be a JSON object, not list"),
        ("{", "is not valid JSON"),
        ("{}", r"needs a 'format' \(or, in the older form, 'structures'\)"),
    ],
)
def test_a_malformed_structural_tag_is_refused_when_built(tag, message):
    with pytest.raises(InvalidRequestError, match=message):
        StructuredOutput(structural_tag=tag)


def test_a_constrained_request_leaves_its_neighbours_alone(llm):
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = run(llm, ["the same free prompt"], [free])
    constrained = SamplingParams(temperature=0, max_tokens=30, structured_output=StructuredOutput(regex="[a-z ]+"))
    together = run(llm, ["the same free prompt", "other text"] * 2, [free, constrained] * 2)
    assert together[0] == together[2] == alone[0]
    assert all(re.fullmatch("[a-z ]+", t[0]) for t in together[1::2])


def test_the_grammar_survives_preemption(tiny_llm_dir):
    # 6 blocks of 16 tokens for 4 sequences of up to ~50 tokens each: they preempt each other over and over.
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="48KiB", max_model_len=64)
    spec = StructuredOutput(regex="(ab|cd)[0-9]{10,30}")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=2, structured_output=spec)
    try:
        outputs = llm.generate(["first prompt", "second prompt"], params, use_tqdm=False)
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    assert all(re.fullmatch("(ab|cd)[0-9]{10,30}", answer(c)) for out in outputs for c in out.outputs)


def test_a_stop_string_still_cuts_a_constrained_output(llm):
    params = SamplingParams(temperature=0, max_tokens=20, stop=["-"], structured_output=StructuredOutput(regex=PHONE))
    [[text]] = run(llm, ["phone"], [params])
    assert re.fullmatch(r"\d{3}", text)


def finish_all(engine: LLMEngine) -> tuple[dict[str, CompletionOutput], list[InvalidRequestError]]:
    """Step ``engine`` until no request is left: each finished request's first completion, and the refusals."""
    finished, refused = {}, []

    def step() -> bool:
        try:
            finished.update((out.request_id, out.outputs[0]) for out in engine.step() if out.finished)
        except InvalidRequestError as error:
            refused.append(error)
        return not engine.has_unfinished_requests()

    wait_until(step, "every request ends", interval=0)
    return finished, refused


@pytest.mark.parametrize(
    "spec,message,multiprocess",
    [
        (StructuredOutput(regex="("), "the regex does not compile", False),
        (StructuredOutput(regex="("), "the regex does not compile", True),
        (StructuredOutput(json_schema=SLOW_SCHEMA), "the json_schema did not compile within 2 s", False),
        (StructuredOutput(json_schema=SLOW_SCHEMA), "the json_schema did not compile within 2 s", True),
        # The worker's function is replaced in this process only: an in-process engine's workers run it.
        (
            StructuredOutput(grammar=CRASH_GRAMMAR),
            "the grammar crashed the grammar compiler (killed by SIGABRT)",
            False,
        ),
    ],
)
def test_a_spec_that_does_not_compile_fails_its_request_only(tiny_llm_dir, monkeypatch, spec, message, multiprocess):
    monkeypatch.setattr(grammar_compiler, "compile_in_worker", compile_or_abort)
    config = EngineConfig.of(
        model=str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", grammar_compile_timeout=2
    )
    engine = LLMEngine(config, multiprocess)
    try:
        bad = engine.add_request(None, "bad", SamplingParams(structured_output=spec))
        phone = SamplingParams(temperature=0, max_tokens=20, structured_output=StructuredOutput(regex=PHONE))
        constrained = engine.add_request(None, "call 555-0123", phone)
        free = engine.add_request(None, "fine", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        finished, [refused] = finish_all(engine)
        assert refused.fields == (f"sampling_params.structured_output.{spec.kind}",)
        assert message in str(refused) and repr(bad) in refused.__notes__[0]
        assert set(finished) == {constrained, free} and len(finished[free].token_ids) == 8
        assert re.fullmatch(PHONE, answer(finished[constrained]))
        # The engine and its compile workers serve on.
        again = engine.add_request(
            None, "call", SamplingParams(max_tokens=20, structured_output=StructuredOutput(regex=PHONE + "!"))
        )
        finished, refused = finish_all(engine)
        assert not refused and re.fullmatch(PHONE + "!", answer(finished[again]))
    finally:
        engine.shutdown()


def test_structured_output_from_proto():
    proto = spindle_pb2.StructuredOutput
    assert structured_output_from_proto(proto(choice=spindle_pb2.Choices(choices=["a", "b"]))).choice == ["a", "b"]
    assert structured_output_from_proto(proto(regex="x+")).regex == "x+"
    assert structured_output_from_proto(proto(regex="x+")).close_at_max_tokens
    assert not structured_output_from_proto(proto(regex="x+", close_at_max_tokens=False)).close_at_max_tokens
    assert structured_output_from_proto(proto(json_object=True)).json_object
    with pytest.raises(InvalidRequestError, match="must be true"):
        structured_output_from_proto(proto(json_object=False))
    with pytest.raises(InvalidRequestError, match="is empty"):
        structured_output_from_proto(proto())


# Ten shapes of schema. Strings, arrays and numbers are bounded, so that every completion ends within max_tokens
# (an unbounded integer lets a small model write zeros until the limit: the grammar cannot make it stop).
NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {"city": NAME, "population": {"type": "integer", "minimum": 1, "maximum": 50_000_000}},
        "required": ["city", "population"],
    },
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
    },
    {
        "type": "object",
        "properties": {
            "primes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 2, "maximum": 97},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["primes"],
    },
    {
        "type": "object",
        "properties": {
            "author": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]},
            "year": {"type": "integer", "minimum": 1800, "maximum": 2025},
        },
        "required": ["author", "year"],
    },
    {"type": "object", "properties": {"title": NAME, "subtitle": NAME}, "required": ["title"]},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["x", "y"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["answer", "confidence"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["id", "tags"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "error": {"type": ["string", "null"], "maxLength": 16}},
        "required": ["ok", "error"],
    },
]


@pytest.fixture(scope="module")
def smollm2_server():
    process, address = start_backend(EngineConfig.of(kv_cache_memory="256MiB", max_model_len=2048))
    ping_backend(address, timeout=300)  # loaded: the server's own handshake then waits no longer than usual
    server = ServerThread(address)
    yield server
    server.close()
    process.stop()


@pytest.mark.slow
def test_json_schemas_through_grpc_parse_and_validate(smollm2_server):
    """Every completion of ten schemas, greedy and sampled, all streams at once, is JSON valid against its schema."""
    with smollm2_server.client(timeout=300) as client:
        streams = []
        for i, schema in enumerate(SCHEMAS):
            spec = spindle_pb2.StructuredOutput(json_schema=json.dumps(schema))
            messages = [{"role": "user", "content": f"Answer in JSON: example {i}"}]
            for params in ({"temperature": 0}, {"temperature": 0.8, "seed": i}):
                streams.append((schema, client.chat(messages, max_tokens=128, structured_output=spec, **params)))
        for schema, stream in streams:
            choices, _ = collect(stream)
            for choice in choices.values():
                assert choice["finish"] == [(spindle_pb2.FINISH_REASON_STOP, None)], choice
                jsonschema.validate(json.loads(choice["text"]), schema)


@pytest.mark.slow
def test_regex_choice_and_bad_grammar_through_grpc(smollm2_server):
    with smollm2_server.client(timeout=120) as client:
        spec = spindle_pb2.StructuredOutput(choice=spindle_pb2.Choices(choices=CHOICES))
        choices, _ = collect(client.chat([{"role": "user", "content": "Yes or no?"}], structured_output=spec, n=2))
        assert all(c["text"] in CHOICES for c in choices.values())
        spec = spindle_pb2.StructuredOutput(regex=PHONE)
        choices, _ = collect(client.generate("My number is", structured_output=spec, temperature=0))
        assert re.fullmatch(PHONE, choices[0]["text"])
        spec = spindle_pb2.StructuredOutput(grammar="root ::= ")
        error = refusal(lambda: client.generate("x", structured_output=spec))
        assert_invalid(error, ["sampling_params.structured_output.grammar"], "does not compile")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        error = refusal(lambda: client.generate("x", structured_output=spindle_pb2.StructuredOutput()))
        assert_invalid(error, ["sampling_params.structured_output"], "is empty")
