import msgspec
import pytest

from spindle import SamplingParams
from spindle.shared.protocol import EngineRequest, SequenceDelta

BAD_VALUES = [
    ("n", 0),
    ("temperature", -0.1),
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
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert f"SamplingParams.{field}={value!r}" in message and "must be" in message


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


def test_decoding_revalidates_params():
    raw = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(raw, type=SamplingParams)
