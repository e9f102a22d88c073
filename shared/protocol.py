"""What the frontend and the engine core exchange: requests in, per-step token deltas out (token ids only)."""

import msgspec

from shared.outputs import TokenLogprobs
from shared.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct):
    """A tokenized request handed to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class SequenceDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did for one completion of a request: its new tokens and, at the end, why it finished.

    ``prompt_logprobs`` comes once, with the first generated token. ``finish_reason`` is ``"stop"`` (eos or a stop
    token, named by ``stop_reason`` for the latter), ``"length"`` or ``"abort"``.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
