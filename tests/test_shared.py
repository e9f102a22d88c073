import math
import pickle

import msgspec
import pytest

from spindle import FinishReason, SamplingParams
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.protocol import BackendMessage, EngineRequest, RequestError, SequenceDelta

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
