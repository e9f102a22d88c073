import io
import json
import logging
import math
import pickle
import re

import msgspec
import pytest

from spindle import FinishReason, SamplingParams, StructuredOutput
from spindle.shared.config import configure_logging
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.json_depth import MAX_JSON_DEPTH, check_json_text, check_json_value
from spindle.shared.protocol import BackendMessage, EngineRequest, RequestError, SequenceDelta
from spindle.shared.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

BAD_VALUES = [
    ("n", 0),
    ("temperature", -0.1),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("top_p", math.nan),
    ("min_p", -math.inf),
    ("presence_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 1.1),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0),
    ("seed", -1),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop_token_ids", [-5]),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("logit_bias", {3: 101.0}),
    ("logit_bias", {-1: 1.0}),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_bad_values_name_the_field_the_value_and_the_range(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert f"SamplingParams.{field}={value!r}" in message and "must be" in message
    assert err.value.field == f"sampling_params.{field}" and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("stop", [f"stop{i}" for i in range(MAX_STOP_STRINGS + 1)], "has 65 stop strings, more than the limit of 64"),
        ("stop", "x" * (MAX_STOP_STRING_LENGTH + 1), "has a string of 257 characters ('xxxxxxxxxxxxxxxxxxxx'...)"),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), "has 1025 token ids, more than the limit of 1024"),
        ("logit_bias", dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0), "has 1025 entries, more than the limit of 1024"),
    ],
    ids=["stop-strings", "stop-length", "stop-token-ids", "logit-bias"],
)
def test_what_costs_work_per_token_is_capped_and_the_caps_are_taken(field, value, message):
    with pytest.raises(InvalidRequestError, match=re.escape(f"SamplingParams.{field} {message}")) as err:
        SamplingParams(**{field: value})
    assert err.value.field == f"sampling_params.{field}" and len(str(err.value)) < 200
    at_cap = value[:-1] if isinstance(value, str | list) else dict(list(value.items())[:-1])
    assert SamplingParams(**{field: at_cap})


def test_stop_token_ids_are_a_set_on_both_sides_of_the_socket():
    params = SamplingParams(stop_token_ids=[7, 3, 7])
    assert params.stop_token_ids == frozenset({3, 7})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens=5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_defaults_and_normalisation_match_vllm():
    params = SamplingParams(stop="###")
    assert params.stop == ["###"]
    assert (params.n, params.temperature, params.max_tokens, params.skip_special_tokens) == (1, 1.0, 16, True)
    assert SamplingParams(temperature=0).greedy and not params.greedy


def test_engine_messages_round_trip_through_msgpack():
    request = EngineRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], logit_bias={7: 2.0}), 1.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineRequest) == request
    delta = SequenceDelta("r1", 0, [42], finish_reason="stop", stop_reason=42)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(delta), type=SequenceDelta) == delta


def test_finish_reason_travels_as_its_value_and_an_unknown_one_fails_to_decode():
    delta = SequenceDelta("r1", 0, [7], finish_reason=FinishReason.LENGTH)
    raw = msgspec.msgpack.encode(delta)
    assert msgspec.msgpack.decode(raw)[5] == "length"  # a plain msgpack string on the wire
    decoded = msgspec.msgpack.decode(raw, type=SequenceDelta)
    assert decoded.finish_reason is FinishReason.LENGTH and decoded.finish_reason == "length"
    bogus = msgspec.msgpack.encode(["r1", 0, [7], None, None, "eos"])
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'eos'"):
        msgspec.msgpack.decode(bogus, type=SequenceDelta)


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("prompt", "the prompt is too long", also=["sampling_params.max_tokens"]),
        InvalidRequestError("request_id", "request id 'a' is already in use"),
        EngineUnavailableError("the engine is shutting down"),
    ],
    ids=["invalid-two-fields", "invalid", "unavailable"],
)
def test_a_refusal_crosses_the_socket_as_the_same_exception(error):
    raw = msgspec.msgpack.encode(RequestError.from_exception("r1", error))
    message = msgspec.msgpack.decode(raw, type=BackendMessage)
    assert isinstance(message, RequestError) and message.request_id == "r1"
    for rebuilt in (message.to_exception(), pickle.loads(pickle.dumps(error))):
        assert type(rebuilt) is type(error) and str(rebuilt) == str(error)
        assert getattr(rebuilt, "fields", None) == getattr(error, "fields", None)


def test_decoding_revalidates_params():
    raw = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(raw, type=SamplingParams)


def deep(depth: int) -> list:
    """A list nested ``depth`` levels deep."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    "text,too_deep",
    [
        ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, False),
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), True),
        ("[" * 100_000, True),  # unterminated: refused before json.loads could raise RecursionError
        (json.dumps({"a": [{"b": "[[[[{{{{" * 100}] * 3}), False),  # brackets in strings nest nothing
        (json.dumps(['\\"[[[' * 100, "]]" * 100]), False),  # nor after escaped quotes and backslashes
        (json.dumps([{"k": "v"}] * 10_000), False),
        ('"' + '\\"[' * 10_000, False),  # an unterminated string runs to the end
    ],
    ids=["at-limit", "over", "unterminated", "in-strings", "escapes", "wide", "open-string"],
)
def test_json_text_nested_too_deep_is_refused_without_decoding(text, too_deep):
    if too_deep:
        with pytest.raises(InvalidRequestError, match=f"^f is nested deeper than {MAX_JSON_DEPTH} levels") as err:
            check_json_text(text, "f")
        assert err.value.field == "f"
    else:
        check_json_text(text, "f")


def test_python_values_nested_too_deep_are_refused_even_shared_or_cyclic():
    check_json_value({"a": deep(MAX_JSON_DEPTH - 1)}, "f")
    shared = deep(30)
    for _ in range(30):  # 2**30 paths to the innermost list, walked once each level
        shared = [shared, shared]
    check_json_value(shared, "f", limit=60)
    cyclic: dict = {}
    cyclic["self"] = cyclic
    for value in ({"a": deep(MAX_JSON_DEPTH)}, deep(100_000), cyclic):
        with pytest.raises(InvalidRequestError, match="is nested deeper than"):
            check_json_value(value, "f")


@pytest.mark.parametrize("as_text", [False, True], ids=["dict", "text"])
def test_a_json_schema_nested_too_deep_is_refused_naming_the_field(as_text):
    schema = {"type": "array", "items": {}}
    for _ in range(MAX_JSON_DEPTH):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidRequestError, match="nested deeper than") as err:
        StructuredOutput(json_schema=json.dumps(schema) if as_text else schema)
    assert err.value.field == "sampling_params.structured_output.json_schema"


@pytest.fixture
def log_stream():
    """Where configure_logging() sends the records for one test; the root logger's handlers are restored after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    yield stream
    root.handlers[:], root.level = handlers, level
    logging.captureWarnings(False)


FORGED = "2099-01-01 00:00:00,000 INFO spindle: forged"
HOSTILE = f"x\n{FORGED}\r\x1b[2K\x85\u2028\x1c"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_log_record_stays_one_line_whatever_a_request_puts_in_it(log_stream, log_format):
    configure_logging(log_format, stream=log_stream)
    logger = logging.getLogger("spindle.test")
    logger.info("Request refused: %s", HOSTILE, extra={"request_id": HOSTILE})
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        logger.exception("Bug", extra={"request_id": "r1"})
    lines = log_stream.getvalue().splitlines()  # splitlines() also breaks at \x85, \u2028, \x1c ...
    if log_format == "json":
        entries = [json.loads(line) for line in lines]
        assert [entry["message"] for entry in entries] == [f"Request refused: {HOSTILE}", "Bug"]
        assert entries[0]["request_id"] == HOSTILE and entries[1]["exception"].endswith(f"ValueError: {HOSTILE}")
        return
    escaped = "x\\n" + FORGED + "\\r\\x1b[2K\\x85\\u2028\\x1c"
    assert lines[0].endswith(f"INFO spindle.test: Request refused: {escaped} [request_id={escaped}]")
    assert lines[1].endswith("ERROR spindle.test: Bug [request_id=r1]")
    records = [line for line in lines if not line.startswith(" ")]  # a traceback's lines are indented
    assert records == lines[:2] and not any(line.startswith(FORGED) for line in lines)
    assert lines[2:] and all(line.startswith("    ") for line in lines[2:])
