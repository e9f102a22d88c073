"""What the engines return: one :class:`RequestOutput` per request per step, vLLM-shaped."""

import enum

import msgspec


class FinishReason(enum.StrEnum):
    """Why a completion ended, as both processes and the wire name it.

    A :class:`str` subclass: a member equals its value (``FinishReason.STOP == "stop"``), prints as it, and msgpack
    carries the value, so code written against vLLM's string finish reasons keeps working, while a decoder refuses
    any other string.
    """

    STOP = "stop"
    """Eos, a stop token id (``stop_reason`` names it) or a stop string (``stop_reason`` names that)."""
    LENGTH = "length"
    """``max_tokens``, or the context reached ``max_model_len``."""
    ABORT = "abort"
    """The request was aborted, or the engine shut down before it finished."""


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position, as the backend computes them from the raw model logits.

    ``token_ids[0]`` is the chosen (sampled, or next prompt) token, followed by the top-N tokens in
    descending order; ``logprobs`` is parallel to ``token_ids``; ``rank`` is the chosen token's
    rank in the vocabulary (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class Logprob(msgspec.Struct):
    """The log-probability of one token, with its rank and its text, as vLLM reports it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated (or prompt) position: token id to :class:`Logprob` for the chosen and top-N tokens."""


class ToolCall(msgspec.Struct):
    """One call of a tool, parsed from a chat completion.

    Attributes:
        id: unique within the response (``call_`` and 24 random characters).
        name: the tool's name.
        arguments: the arguments, a JSON object as text (as OpenAI's API carries them).

    """

    id: str
    name: str
    arguments: str


class CompletionOutput(msgspec.Struct):
    """One completion of a request (there are ``n`` of them).

    Attributes:
        index: which of the ``n`` completions this is.
        text: generated text (cumulative, or the new part when the request streams deltas).
        token_ids: generated token ids (cumulative, or the new ones).
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when logprobs were asked.
        logprobs: per generated token, the requested log-probabilities.
        finish_reason: a :class:`FinishReason` (equal to ``"stop"``, ``"length"`` or ``"abort"``) once finished, else
            ``None``.
        stop_reason: the stop string or stop token id that ended it, ``None`` for eos or length.
        tool_calls: a chat request with tools: its calls, each as soon as it is whole in the text (all so far, or
            in delta mode the new ones; ``[]`` where it finishes without new ones); ``None`` otherwise.
        num_draft_tokens: draft tokens (speculative decoding, ``num_speculative_tokens``) verified for this
            completion so far.
        num_accepted_draft_tokens: those of them the model agreed with, which became output.
        reasoning_content: a reasoning model's thoughts, apart from ``text`` (its answer), when the engine runs a
            reasoning parser (``reasoning_parser``) and the model wrote a thinking block; ``None`` otherwise.
            Cumulative, or the new part in delta mode (``None`` when nothing is new).

    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    tool_calls: list[ToolCall] | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    reasoning_content: str | None = None

    def finished(self) -> bool:
        """Whether this completion has ended."""
        return self.finish_reason is not None


class RequestMetrics(msgspec.Struct):
    """Wall-clock times (``time.time()``) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class RequestOutput(msgspec.Struct):
    """The state of one request after a step.

    Attributes:
        request_id: the id given to ``add_request`` / ``generate``.
        prompt: the prompt text, when the prompt was given as text.
        prompt_token_ids: the tokenized prompt.
        prompt_logprobs: per prompt position (the first is ``None``), when asked.
        outputs: the ``n`` completions, by index.
        finished: whether every completion has ended.
        metrics: arrival, first-token and finish times.
        num_cached_tokens: prompt tokens whose KV came from blocks shared with another sequence.

    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0


class EmbeddingOutput(msgspec.Struct):
    """The embedding of one prompt.

    Attributes:
        embedding: the pooled vector: the model's hidden size long, or ``PoolingParams.dimensions``; of unit L2 norm
            with ``PoolingParams.normalize`` (the default). Empty when the request was aborted.

    """

    embedding: list[float]


class EmbeddingRequestOutput(msgspec.Struct):
    """The result of one embedding request (one prompt), as vLLM's ``EmbeddingRequestOutput``.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text, when the prompt was given as text.
        prompt_token_ids: the tokenized prompt, whose hidden states were pooled.
        outputs: the embedding.
        finished: whether the request has ended (an embedding request reports once, when it ends).
        metrics: arrival and finish times.
        num_cached_tokens: prompt tokens whose KV came from blocks shared with another sequence (``last`` pooling
            only: ``mean`` and ``cls`` compute every position).

    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
