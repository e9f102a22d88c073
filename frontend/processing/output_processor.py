"""Turns the engine core's token deltas into ``RequestOutput`` objects: detokenization, stop strings, logprobs."""

import logging
import sys
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from spindle.frontend.processing.detokenizer import IncrementalDetokenizer
from spindle.frontend.processing.reasoning import ReasoningParser
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.frontend.processing.tools import ChatTools
from spindle.shared import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    FinishReason,
    Logprob,
    PoolingParams,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
    ToolCall,
)
from spindle.shared.errors import OutputProcessingError
from spindle.shared.protocol import EngineRequest, ResumedCompletion, SequenceDelta

logger = logging.getLogger(__name__)

EMBEDDING_SAMPLING_PARAMS = SamplingParams(max_tokens=None)
"""The sampling parameters an embedding request carries to the engine core, which generates nothing for it."""


@dataclass
class _Completion:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text: str = ""
    num_sent_tokens: int = 0
    # With a reasoning parser: how much of each part of the text the outputs so far carried.
    num_sent_reasoning: int = 0
    num_sent_content: int = 0
    num_decoded_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # A chat request with tools: the calls found so far (each sent once whole), and whether the reply is parsed whole.
    tool_calls: list[ToolCall] | None = None
    calls_done: bool = False


class RequestState:
    """Everything the frontend tracks for one request between steps.

    ``tools``, for a chat request with tools, parses each completion's tool calls as each is whole, and the reply
    whole once it finishes (from its content, apart from its reasoning, with a ``reasoning`` parser, which splits
    each completion's text). With
    ``final_only`` the request has one output, when it finishes; a completion without stop strings is decoded then,
    in one call of its detokenizer (the same text: the detokenizer steps through the same tokens). Given
    :class:`~spindle.shared.PoolingParams` instead of sampling parameters, it is an embedding request's: one
    completion that gets no tokens, and an :class:`~spindle.shared.EmbeddingRequestOutput` as its output.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        tokenizer: Tokenizer,
        arrival_time: float,
        delta: bool,
        tools: ChatTools | None = None,
        final_only: bool = False,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.request_id = request_id
        self.reasoning = reasoning
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.pooling = params if isinstance(params, PoolingParams) else None
        self.embedding: list[float] = []
        if self.pooling is not None:
            params = EMBEDDING_SAMPLING_PARAMS
        self.params = params
        self.delta = delta
        # best_of above n: the engine runs best_of completions, and the output, once they end, keeps the best n.
        self.best_of = params.best_of if params.keeps_best_of else None
        self.final_only = final_only or self.best_of is not None
        self.tools = tools
        want_logprobs = params.logprobs is not None or self.best_of is not None
        self.completions = [
            _Completion(
                IncrementalDetokenizer(tokenizer, params, prompt_token_ids),
                logprobs=[] if want_logprobs else None,
                cumulative_logprob=0.0 if want_logprobs else None,
            )
            for _ in range(self.best_of or params.n)
        ]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        # When a step last gave this request tokens (None before the first): for the inter-token latency.
        self.last_token_time: float | None = None
        # The request as first sent to the engine (set by its sender), and how often it was resumed since.
        self.request: EngineRequest | None = None
        self.num_resumes = 0

    @property
    def finished(self) -> bool:
        """Whether every completion has ended."""
        for c in self.completions:  # a loop: asked of every request in every step, where a generator costs more
            if c.finish_reason is None:
                return False
        return True

    def resumed_request(self) -> EngineRequest:
        """The request to send again after its backend died: it goes on from the tokens streamed so far.

        Each unfinished completion carries its tokens, as output (``EngineRequest.resumed``); the finished ones stay
        finished. An embedding request is sent again whole: it has no output until it ends.
        """
        assert self.request is not None, "resumed_request() needs the request as sent"
        if self.pooling is not None:
            return self.request
        resumed = [
            ResumedCompletion(index, list(c.token_ids))
            for index, c in enumerate(self.completions)
            if c.finish_reason is None
        ]
        return msgspec.structs.replace(self.request, resumed=resumed)

    def _tool_calls(self, c: _Completion, content: str, new_text: str, finished: bool) -> list[ToolCall] | None:
        """The completion's tool calls for this output: each as soon as it is whole, with its id kept.

        Cumulative: every call so far (None before the first, unless finished). In delta mode: the calls new in this
        output, ``[]`` in the one where the completion finishes without new ones, None otherwise. The finished reply
        is parsed whole; should it disagree with the calls already sent (a JSON reply that turned out not to be
        one), those stand and nothing is added.
        """
        assert self.tools is not None
        new = None
        # A call becomes whole only with a closing "}" or ">": without one the text so far is not parsed again.
        if not c.calls_done and (finished or "}" in new_text or ">" in new_text):
            sent = c.tool_calls or []
            found = self.tools.parse(content) if finished else self.tools.parse_so_far(content)
            same = [(call.name, call.arguments) for call in found[: len(sent)]] == [
                (call.name, call.arguments) for call in sent
            ]
            new = found[len(sent) :] if same else []
            if new or finished:
                c.tool_calls = sent + new
            c.calls_done = finished
        if not self.delta:
            return c.tool_calls
        return new if new or (finished and new is not None) else None

    def _best(self, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
        """The ``n`` of ``best_of`` finished completions with the highest cumulative log-probability, best first.

        They are numbered anew; without ``logprobs`` asked, their per-token log-probabilities are left out.
        """
        best = sorted(outputs, key=lambda output: -output.cumulative_logprob)[: self.params.n]
        keep_logprobs = self.params.logprobs is not None
        return [
            msgspec.structs.replace(output, index=i, logprobs=output.logprobs if keep_logprobs else None)
            for i, output in enumerate(best)
        ]

    def output(self) -> RequestOutput | EmbeddingRequestOutput:
        """The request's state as a ``RequestOutput`` (only what is new since the last one in delta mode).

        A completion of a chat request with tools carries its tool calls as each is whole in its text: all
        so far, or in delta mode the new ones. An embedding request's is an ``EmbeddingRequestOutput``.
        """
        if self.pooling is not None:
            return EmbeddingRequestOutput(
                request_id=self.request_id,
                prompt=self.prompt,
                prompt_token_ids=self.prompt_token_ids,
                outputs=EmbeddingOutput(self.embedding),
                finished=self.finished,
                metrics=self.metrics,
                num_cached_tokens=self.num_cached_tokens,
            )
        outputs = []
        for index, c in enumerate(self.completions):
            finished = c.finish_reason is not None
            start = c.num_sent_tokens if self.delta else 0
            new_text = c.detokenizer.get_delta(finished) if self.params.detokenize else ""
            c.text += new_text
            text, reasoning = (new_text if self.delta else c.text), None
            content = c.text
            if self.reasoning is not None:
                split = self.reasoning.split(c.text, finished)
                content, thoughts = split.content, split.reasoning or ""
                text = content[c.num_sent_content :] if self.delta else content
                reasoning = (thoughts[c.num_sent_reasoning :] if self.delta else split.reasoning) or None
                c.num_sent_content, c.num_sent_reasoning = len(content), len(thoughts)
            tool_calls = self._tool_calls(c, content, new_text, finished) if self.tools is not None else None
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=c.token_ids[start:],
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=None if c.logprobs is None else c.logprobs[start:],
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    tool_calls=tool_calls,
                    num_draft_tokens=c.num_draft_tokens,
                    num_accepted_draft_tokens=c.num_accepted_draft_tokens,
                    reasoning_content=reasoning,
                )
            )
            c.num_sent_tokens = len(c.token_ids)
        if self.best_of is not None:
            outputs = self._best(outputs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )


class ProcessedStep(NamedTuple):
    """What :meth:`OutputProcessor.process` made of one step.

    Attributes:
        outputs: the outputs of the requests that changed, in the order they first appear in the step's deltas (an
            embedding request's and a ``final_only`` one's once, when it ends).
        stopped: the ``(request_id, index)`` of completions that a stop string ended, which the engine core must
            still end.
        failed: the requests whose output could not be processed, dropped here: the caller aborts each in the engine
            core and ends its stream with the error.

    """

    outputs: list[RequestOutput | EmbeddingRequestOutput]
    stopped: list[tuple[str, int]]
    failed: list[OutputProcessingError]


class StepListener(Protocol):
    """Something that follows requests as the :class:`OutputProcessor` applies each step (the server's metrics)."""

    def on_tokens(self, state: RequestState, num_new_tokens: int, now: float) -> None:
        """One step gave ``state`` ``num_new_tokens`` tokens (over all its completions) at ``now``.

        ``state.last_token_time`` is still the time of the previous step that gave it tokens, ``None`` before its
        first token.
        """

    def on_finished(self, state: RequestState, now: float) -> None:
        """``state`` ended at ``now``: all its completions finished, or it was aborted.

        Aborted (cancelled, refused by the backend, or lost with it), its unfinished completions have no finish
        reason yet.
        """


class OutputProcessor:
    """Applies each step's :class:`SequenceDelta` list to the request table and builds the ``RequestOutput`` objects.

    Stop strings need text, so they are matched here; a completion that matches one is reported back so the
    caller can end it in the engine core and free its blocks at once.

    Attributes:
        listeners: told of every request's tokens and end (:class:`StepListener`); the gRPC server's metrics and
            load figures add themselves here.

    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.listeners: list[StepListener] = []

    def add_request(self, state: RequestState) -> None:
        """Start tracking a request."""
        self.requests[state.request_id] = state

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop tracking requests (they were aborted); unknown ids are ignored."""
        now = time.time()
        for request_id in request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                self._tell(lambda listener, state=state: listener.on_finished(state, now))

    def process(self, deltas: list[SequenceDelta]) -> ProcessedStep:
        """Apply one step's deltas.

        A request whose deltas cannot be processed (a bug: its processing raised) fails alone: it is dropped here,
        as an aborted request is, the error is logged with its id, and it comes back in
        :attr:`ProcessedStep.failed` so that the caller ends its stream and aborts it in the engine core. The
        other requests of the step go on untouched.
        """
        now = time.time()
        changed: dict[str, RequestState] = {}
        num_new_tokens: dict[str, int] = {}
        stopped: list[tuple[str, int]] = []
        failed: dict[str, OutputProcessingError] = {}
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None:
                continue  # unknown, aborted, or failed earlier in this step
            try:
                ended_here = self._apply(state, delta, now)
            except Exception as error:
                failed[delta.request_id] = self._fail(state, error)
                changed.pop(delta.request_id, None)
                continue
            if ended_here is None:
                continue
            if ended_here:
                stopped.append((delta.request_id, delta.index))
            changed[delta.request_id] = state
            num_new_tokens[delta.request_id] = num_new_tokens.get(delta.request_id, 0) + len(delta.new_token_ids)
        outputs = []
        for request_id, state in changed.items():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
            try:
                output = state.output() if finished or not state.final_only else None
            except Exception as error:
                failed[request_id] = self._fail(state, error)
                continue
            if new := num_new_tokens[request_id]:
                if self.listeners:  # without any (an LLM's), no call to build for each request of each step
                    self._tell(lambda listener, state=state, new=new: listener.on_tokens(state, new, now))
                state.last_token_time = now
            if finished:
                del self.requests[request_id]
                self._tell(lambda listener, state=state: listener.on_finished(state, now))
            if output is not None:
                outputs.append(output)
        stopped = [(request_id, index) for request_id, index in stopped if request_id not in failed]
        return ProcessedStep(outputs, stopped, list(failed.values()))

    def _apply(self, state: RequestState, delta: SequenceDelta, now: float) -> bool | None:
        """Apply one delta to its request's state.

        Returns ``None`` when the completion had ended already (a stop string ended it: the core's late tokens are
        dropped), else whether a stop string ended it now, which the engine core must still be told.
        """
        c = state.completions[delta.index]
        if c.finish_reason is not None:
            return None
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            state.metrics.first_scheduled_time = delta.first_scheduled_time
        if delta.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [None, *(self._logprob_dict(lp) for lp in delta.prompt_logprobs)]
        if delta.num_cached_tokens > state.num_cached_tokens:
            state.num_cached_tokens = delta.num_cached_tokens
        if delta.embedding is not None:
            state.embedding = _floats(delta.embedding)
        c.token_ids += delta.new_token_ids
        if delta.num_draft_tokens:
            c.num_draft_tokens += delta.num_draft_tokens
            c.num_accepted_draft_tokens += delta.num_accepted_draft_tokens
        if delta.new_logprobs:
            for lp in delta.new_logprobs:
                c.logprobs.append(self._logprob_dict(lp))
                c.cumulative_logprob += lp.logprobs[0]
        if not state.params.detokenize or (
            state.final_only and not c.detokenizer.has_stop_strings and delta.finish_reason is None
        ):
            if delta.finish_reason is not None:  # no text: nothing but the engine core ends it
                c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
            return False  # decoded when it finishes (no stop string needs its text sooner), or never
        stop_str = c.detokenizer.update(c.token_ids[c.num_decoded_tokens :])
        c.num_decoded_tokens = len(c.token_ids)
        if stop_str is not None:
            c.finish_reason, c.stop_reason = FinishReason.STOP, stop_str
            return delta.finish_reason is None
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
        return False

    def _fail(self, state: RequestState, error: Exception) -> OutputProcessingError:
        """Drop a request whose processing raised ``error``, log it once, and return the error its stream ends with."""
        logger.error(
            "The output of the request could not be processed (%s: %s): it is aborted",
            type(error).__name__,
            error,
            exc_info=error,
            extra={"request_id": state.request_id},
        )
        self.abort_requests([state.request_id])
        return OutputProcessingError(state.request_id, error)

    def _tell(self, call: Callable[[StepListener], None]) -> None:
        """Make ``call`` (one :class:`StepListener` method's call) on every listener."""
        for listener in self.listeners:
            try:
                call(listener)
            except Exception:
                # A broken metric must not stop the outputs of every request: log it and serve on.
                logger.exception("%s failed to follow a step", type(listener).__name__)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        # The chosen token comes first with its own rank; the top-N follow with ranks 1..N.
        ranks = [lp.rank, *range(1, len(lp.token_ids))]
        return {
            token_id: Logprob(logprob, rank, self.tokenizer.id_to_text(token_id))
            for token_id, logprob, rank in zip(lp.token_ids, lp.logprobs, ranks, strict=True)
        }


def _floats(data: bytes) -> list[float]:
    """Little-endian float32 values (an embedding on the wire) as Python floats."""
    values = array("f", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
