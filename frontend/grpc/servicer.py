"""``spindle.v1.SpindleService`` over an engine, and the one mapping of exceptions to status codes.

Errors are status codes a caller can act on, chosen by the exception's type in :func:`status_for` and nowhere
else: ``INVALID_ARGUMENT`` (with a ``google.rpc.BadRequest`` field violation per field at fault) for bad inputs and
parameters, ``RESOURCE_EXHAUSTED`` when the waiting queue is full or a call would go over another of the server's
limits (streams per connection, watchers, tokenizer calls), ``UNAVAILABLE`` when the backend is down or the
server or engine drains, ``INTERNAL`` (logged) for a bug of ours. gRPC itself answers ``RESOURCE_EXHAUSTED`` for a
message over the size limit, ``CANCELLED`` and ``DEADLINE_EXCEEDED`` (which abort the request in the backend: the
handler's task is cancelled, which closes the engine stream); :mod:`spindle.frontend.grpc.server` adds
``UNAUTHENTICATED`` without the API key, ``PERMISSION_DENIED`` for an adapter call without the admin key and
``INVALID_ARGUMENT`` for a request message that does not parse. A stream whose client leaves
``max_unread_outputs`` outputs unread for ``unread_timeout`` seconds is aborted
(:mod:`~spindle.frontend.grpc.read_ahead`).

Request ids belong to the caller's connection: the engine knows a request under its id prefixed with a digest of the
connection's peer address, so ``Abort`` reaches only the caller's own requests (another's id is as unknown as one
never used), and two callers may use the same id.
The LoRA adapter calls add ``NOT_FOUND`` (an unknown adapter, with a field violation naming the field that holds the
name), ``ALREADY_EXISTS`` (a name taken) and ``FAILED_PRECONDITION`` (loading adapters at run time is off).

With ``--otlp-traces-endpoint``, each ``Generate`` and ``Chat`` call gets a trace span
(:mod:`spindle.frontend.grpc.tracing`); ``WatchLoad`` and ``GetServerInfo`` report the load that a
:class:`~spindle.frontend.grpc.metrics.LoadTracker` follows.
"""

import asyncio
import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import EngineDeadError
from spindle.frontend.grpc.admission_control import AdmissionControl, CallLimit, OverLimitError
from spindle.frontend.grpc.args import CEILINGS, ServerConfig
from spindle.frontend.grpc.mapping import (
    ResponseBuilder,
    beam_search_params_from_proto,
    embed_inputs_from_proto,
    embed_response,
    lora_adapter_to_proto,
    lora_request_from_proto,
    messages_from_proto,
    pooling_params_from_proto,
    prompt_inputs_from_proto,
    sampling_params_from_proto,
    tool_choice_from_proto,
    tools_from_proto,
)
from spindle.frontend.grpc.metrics import Load, LoadTracker, kv_cache_usage
from spindle.frontend.grpc.read_ahead import read_ahead
from spindle.frontend.grpc.tracing import RequestTracer
from spindle.frontend.processing.generation_config import default_sampling_params, parse_override
from spindle.shared import EmbeddingRequestOutput, PoolingParams, PromptInputs, RequestOutput, SamplingParams
from spindle.shared.beam_search import BeamSearchParams
from spindle.shared.errors import (
    AlreadyExistsError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
    OutputProcessingError,
    ResourceExhaustedError,
)
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

logger = logging.getLogger(__name__)

FieldViolation = error_details_pb2.BadRequest.FieldViolation

WATCH_INTERVAL = 1.0
"""Seconds between two ``WatchLoad`` reports when nothing changes, unless the request sets its ``interval``."""
WATCH_INTERVAL_BOUNDS = (0.05, 60.0)
"""The shortest and longest ``WatchLoad`` interval a request may set, in seconds."""


class RuntimeLoraDisabledError(Exception):
    """A call loads or unloads a LoRA adapter, and the backend does not allow it (no ``--allow-runtime-lora``)."""


def status_for(error: Exception) -> tuple[grpc.StatusCode, str, list[FieldViolation]]:
    """The status code, message and field violations that end a call which raised ``error``.

    Args:
        error: what an RPC method raised.

    Returns:
        ``INVALID_ARGUMENT`` with one violation per :attr:`~spindle.shared.errors.InvalidRequestError.fields` entry
        for an :class:`~spindle.shared.errors.InvalidRequestError`, but ``NOT_FOUND`` for a
        :class:`~spindle.shared.errors.NotFoundError`, ``ALREADY_EXISTS`` for an
        :class:`~spindle.shared.errors.AlreadyExistsError` and ``RESOURCE_EXHAUSTED`` for a
        :class:`~spindle.shared.errors.ResourceExhaustedError` (with the same violations); ``FAILED_PRECONDITION`` for a
        :class:`RuntimeLoraDisabledError`; ``UNAVAILABLE`` for an
        :class:`~spindle.shared.errors.EngineUnavailableError` or an
        :class:`~spindle.frontend.engine.connection.EngineDeadError`; ``RESOURCE_EXHAUSTED`` for an
        :class:`~spindle.frontend.grpc.admission_control.OverLimitError` (a full queue, or another limit);
        ``INTERNAL`` with its own message for an :class:`~spindle.shared.errors.OutputProcessingError` (logged where
        it happened, with its request id); ``INTERNAL`` for anything else, a bug (the caller logs it).

    """
    if isinstance(error, InvalidRequestError):
        code = grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(error, NotFoundError):
            code = grpc.StatusCode.NOT_FOUND
        elif isinstance(error, AlreadyExistsError):
            code = grpc.StatusCode.ALREADY_EXISTS
        elif isinstance(error, ResourceExhaustedError):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
        return code, str(error), [FieldViolation(field=field, description=error.reason) for field in error.fields]
    if isinstance(error, RuntimeLoraDisabledError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(error), []
    if isinstance(error, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(error), []
    if isinstance(error, EngineDeadError):
        message = f"the model backend is down ({error}): retry soon (one is being brought back) or use another replica"
        return grpc.StatusCode.UNAVAILABLE, message, []
    if isinstance(error, OverLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), []
    if isinstance(error, OutputProcessingError):
        return grpc.StatusCode.INTERNAL, str(error), []
    message = f"internal error ({type(error).__name__}: {error}): a bug in Spindle, please report it"
    return grpc.StatusCode.INTERNAL, message, []


async def _abort_with(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, violations: Sequence[FieldViolation] = ()
) -> None:
    """End the call with ``code`` and ``message``; ``violations`` travel as a ``google.rpc.BadRequest`` detail."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if violations:
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=violations))
        status.details.append(detail)
    await context.abort_with_status(rpc_status.to_status(status))


def ends_with_status(method: Callable) -> Callable:
    """Turn any exception of an RPC method into the status :func:`status_for` gives it (gRPC would say UNKNOWN)."""

    async def fail(context: grpc.aio.ServicerContext, error: Exception) -> None:
        code, message, violations = status_for(error)
        if code == grpc.StatusCode.INTERNAL and not isinstance(error, OutputProcessingError):  # logged already
            logger.error("Bug in %s", method.__name__, exc_info=error)
        await _abort_with(context, code, message, violations)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: "SpindleServicer", request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            try:
                async for response in method(self, request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await fail(context, error)

        return stream

    @functools.wraps(method)
    async def unary(self: "SpindleServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await fail(context, error)

    return unary


def server_version() -> str:
    """The installed spindle-serve version (``unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version("spindle-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class SpindleServicer(spindle_pb2_grpc.SpindleServiceServicer):
    """Implements ``spindle.v1.SpindleService`` on an engine.

    Each method raises what goes wrong; :func:`status_for` alone turns it into the call's status.

    Args:
        engine: the engine, connected to its backend (or backends, whose figures add up).
        config: the server's limits, and where to send traces.

    Attributes:
        admission_control: which calls it takes in (none while the server drains), and those in flight.
        connections: the ``Generate``, ``Chat`` and ``Embed`` calls open on each connection (by peer address).
        watchers: the ``WatchLoad`` and health ``Watch`` streams open.
        tokenizer_calls: the ``Tokenize`` and ``Detokenize`` calls that run or wait for a tokenizer thread.
        load: what ``WatchLoad`` and ``GetServerInfo`` report (and the metrics read); started with the server.
        tracer: makes each request's trace span; ``None`` without ``config.otlp_traces_endpoint``.
        served_model_names: the names the server answers to (``config.served_model_name``, or the model's name).
        generation_defaults: the ``SamplingParams`` defaults that the generation config gives
            (:mod:`~spindle.frontend.processing.generation_config`).
        default_sampling: the ``SamplingParams`` defaults of requests that leave those fields unset: the generation
            config's, and ``config.num_speculative_tokens`` where it is set.

    Raises:
        ValueError: the generation config's defaults are not valid sampling parameters, or its ``max_tokens`` is
            above ``config.max_tokens_limit``.

    """

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.served_model_names = list(config.served_model_name or [engine.info.model_name])
        override = parse_override(config.override_generation_config)
        files = engine.info.tokenizer_files
        self.generation_defaults = default_sampling_params(config.generation_config, files, override)
        self.default_sampling = dict(self.generation_defaults)
        if config.num_speculative_tokens:
            self.default_sampling["num_speculative_tokens"] = config.num_speculative_tokens
        limit, default_max = config.max_tokens_limit, self.default_sampling.get("max_tokens")
        if limit and default_max is not None and default_max > limit:
            raise ValueError(
                f"the generation config's max_new_tokens={default_max} is above --max-tokens-limit={limit}: lower it "
                "with --override-generation-config '{\"max_new_tokens\": N}'"
            )
        if config.chat_template is not None:
            engine.tokenizer.chat_template = config.chat_template
        self.load = LoadTracker(engine)
        self.tracer = RequestTracer.otlp(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
        self.started = time.monotonic()
        self.admission_control = AdmissionControl(config.max_queued_requests)
        self.connections = CallLimit(config.max_streams_per_connection, "streams on this connection")
        self.watchers = CallLimit(config.max_watchers, "load and health watches")
        # Tokenize and Detokenize run here, off the event loop; those beyond the threads wait, up to the queue's size.
        self._tokenizer_threads = ThreadPoolExecutor(
            config.tokenizer_threads, thread_name_prefix="spindle-tokenize", initializer=_yield_to_serving
        )
        self._endings: set[asyncio.Task] = set()  # the statuses of calls ended for unread outputs, being sent
        self.tokenizer_calls = CallLimit(
            config.tokenizer_threads + config.max_queued_requests, "Tokenize and Detokenize calls"
        )

    @ends_with_status
    async def Generate(  # noqa: N802 - gRPC method names are CamelCase
        self, request: spindle_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spindle_pb2.GenerateResponse]:
        """Stream the completions of one prompt (or, with ``beam_search``, its beams)."""
        if request.HasField("beam_search"):
            beams = self._beam_search_params(request)

            def start(params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
                inputs = prompt_inputs_from_proto(request.prompt)
                return self.engine.beam_search(inputs, beams, request_id, lora_request=lora_request_from_proto(request))

            async for response in self._stream(request, context, "Generate", start):
                yield response
            return

        def start(params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
            inputs = prompt_inputs_from_proto(request.prompt)
            return self.engine.generate(
                inputs,
                params,
                request_id,
                delta=True,
                priority=request.priority,
                lora_request=lora_request_from_proto(request),
            )

        async for response in self._stream(request, context, "Generate", start):
            yield response

    @ends_with_status
    async def Chat(  # noqa: N802
        self, request: spindle_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spindle_pb2.GenerateResponse]:
        """Stream the model's reply to a conversation; with tools, each choice's calls come where it ends."""
        messages = messages_from_proto(request)
        tools, tool_choice = tools_from_proto(request), tool_choice_from_proto(request)
        add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True

        def start(params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
            return self.engine.chat(
                messages,
                params,
                request_id,
                add_generation_prompt=add_generation_prompt,
                delta=True,
                tools=tools,
                tool_choice=tool_choice,
                priority=request.priority,
                lora_request=lora_request_from_proto(request),
            )

        async for response in self._stream(request, context, "Chat", start):
            yield response

    @ends_with_status
    async def Embed(  # noqa: N802
        self, request: spindle_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.EmbedResponse:
        """Embed every input, each an engine request queued with the others at once; embeddings in input order."""
        self.check_embed_inputs(len(request.inputs))
        inputs = embed_inputs_from_proto(request)
        pooling = pooling_params_from_proto(request.pooling_params)
        request_id = request.request_id or uuid.uuid4().hex
        outputs = await self.admitted_embeddings(context.peer(), request_id, inputs, pooling, request.priority)
        return embed_response(request_id, outputs)

    @ends_with_status
    async def Tokenize(  # noqa: N802
        self, request: spindle_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.TokenizeResponse:
        """Tokenize text."""
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        tokenizer = self.engine.tokenizer

        def tokenize() -> spindle_pb2.TokenizeResponse:
            token_ids = tokenizer.encode(request.text, add_special_tokens=add_special)
            return spindle_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokenizer.convert_ids_to_tokens(token_ids))

        return await self._off_loop(tokenize)

    @ends_with_status
    async def Detokenize(  # noqa: N802
        self, request: spindle_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.DetokenizeResponse:
        """Decode token ids."""
        vocab_size = self.engine.info.vocab_size
        outside = sorted({t for t in request.token_ids if not 0 <= t < vocab_size})
        if outside:
            raise InvalidRequestError(
                "token_ids", f"token ids {outside} are outside the vocabulary: token ids must be in [0, {vocab_size})"
            )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        tokenizer = self.engine.tokenizer

        def detokenize() -> spindle_pb2.DetokenizeResponse:
            return spindle_pb2.DetokenizeResponse(
                text=tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
            )

        return await self._off_loop(detokenize)

    @ends_with_status
    async def Abort(  # noqa: N802
        self, request: spindle_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.AbortResponse:
        """Abort a request in flight that this caller's connection made (any other is as unknown as one never made)."""
        return spindle_pb2.AbortResponse(aborted=await self.engine.abort(engine_id(context, request.request_id)))

    @ends_with_status
    async def GetModelInfo(  # noqa: N802
        self, request: spindle_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.GetModelInfoResponse:
        """Describe the served model."""
        info, tokenizer = self.engine.info, self.engine.tokenizer
        special = [
            spindle_pb2.SpecialToken(
                name=name, text=text, token_id=token_id_or_minus_one(tokenizer.backend.token_to_id(text))
            )
            for name, text in sorted(tokenizer.special_tokens.items())
        ]
        return spindle_pb2.GetModelInfoResponse(
            model_name=self.served_model_names[0],
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            special_tokens=special,
            has_chat_template=tokenizer.has_chat_template,
            served_model_names=self.served_model_names,
            default_sampling_params_json=json.dumps(self.default_sampling),
        )

    @ends_with_status
    async def GetServerInfo(  # noqa: N802
        self, request: spindle_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.GetServerInfoResponse:
        """Report version, uptime and load."""
        stats = await self.engine.get_stats()
        load = self.load.load()
        return spindle_pb2.GetServerInfoResponse(
            version=server_version(),
            uptime_seconds=time.monotonic() - self.started,
            num_running_requests=stats.num_running,
            num_waiting_requests=stats.num_waiting,
            num_free_kv_blocks=stats.num_free_blocks,
            num_total_kv_blocks=stats.num_total_blocks,
            num_preemptions=stats.num_preemptions,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
            kv_cache_usage=kv_cache_usage(stats),
            prefix_cache_hit_rate=load.prefix_cache_hit_rate,
            generation_tokens_per_second=load.generation_tokens_per_second,
        )

    @ends_with_status
    async def WatchLoad(  # noqa: N802
        self, request: spindle_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spindle_pb2.LoadReport]:
        """Stream load reports: one at once, one on each change, and one at least every ``interval``."""
        interval = _watch_interval(request)
        reported, reported_at = None, 0.0
        with self.watchers.hold():
            while True:
                if self.admission_control.draining:
                    raise EngineUnavailableError("the server is shutting down: watch another replica")
                if self.engine.is_dead:
                    raise EngineDeadError("it died, and no other has taken over yet")
                load = self.load.load()
                # Throughput and hit rate move with every step: on their own they wait for the interval.
                figures = (load.num_requests_running, load.num_requests_waiting, int(load.kv_cache_usage * 100))
                if figures != reported or time.monotonic() - reported_at >= interval:
                    reported, reported_at = figures, time.monotonic()
                    yield _load_report(load)
                await self.load.wait(max(0.0, reported_at + interval - time.monotonic()))

    @ends_with_status
    async def LoadLoraAdapter(  # noqa: N802
        self, request: spindle_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.LoadLoraAdapterResponse:
        """Load an adapter from the backend's adapter directory, if it loads adapters at run time."""
        self._check_runtime_lora("load")
        adapter = await self.engine.load_lora(request.name, request.path, confined=True)
        return spindle_pb2.LoadLoraAdapterResponse(adapter=lora_adapter_to_proto(adapter))

    @ends_with_status
    async def UnloadLoraAdapter(  # noqa: N802
        self, request: spindle_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.UnloadLoraAdapterResponse:
        """Unload an adapter, if the backend loads adapters at run time; streams using it finish first."""
        self._check_runtime_lora("unload")
        await self.engine.unload_lora(request.name)
        return spindle_pb2.UnloadLoraAdapterResponse()

    @ends_with_status
    async def ListLoraAdapters(  # noqa: N802
        self, request: spindle_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.ListLoraAdaptersResponse:
        """List the adapters requests may name."""
        adapters = await self.engine.list_loras()
        return spindle_pb2.ListLoraAdaptersResponse(adapters=[lora_adapter_to_proto(a) for a in adapters])

    def _check_runtime_lora(self, action: str) -> None:
        """Refuse to change the adapters unless the backend's handshake said it allows it."""
        if self.engine.info.runtime_lora_dir is None:
            raise RuntimeLoraDisabledError(
                f"this server does not {action} LoRA adapters at run time: its backend must run with "
                "--allow-runtime-lora --lora-dir DIR (adapters given at start-up with --lora-modules serve anyway)"
            )

    async def close(self) -> None:
        """Stop following the engine's load and the tokenizer threads, and export the trace spans still buffered."""
        await self.load.close()
        self._tokenizer_threads.shutdown(wait=False, cancel_futures=True)
        for ending in self._endings:
            ending.cancel()
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            tracer.shutdown()

    async def _off_loop(self, work: Callable[[], Any]) -> Any:
        """``work()``'s result, run in a tokenizer thread (a long text would stall every stream on the loop).

        Raises:
            OverLimitError: the threads are busy and ``max_queued_requests`` calls wait for them already.

        """
        with self.tokenizer_calls.hold():
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_threads, work)

    def _end_unread(self, context: grpc.aio.ServicerContext, handler: asyncio.Task) -> None:
        """End a call whose client left its outputs unread (its request is aborted already).

        Its handler waits in a write that may never end, so it is cancelled, and the call's status (which gRPC sends
        after the unread outputs) is sent from a task of its own.
        """
        message = (
            f"the client left {self.config.max_unread_outputs} outputs unread for {self.config.unread_timeout:g} s "
            "(the server's max_unread_outputs and unread_timeout): its request was aborted"
        )
        ending = asyncio.get_running_loop().create_task(_abort_quietly(context, message))
        self._endings.add(ending)
        ending.add_done_callback(self._endings.discard)
        handler.cancel()

    def _beam_search_params(self, request: spindle_pb2.GenerateRequest) -> BeamSearchParams:
        """A request's beam search, checked: no sampling parameters beside it, a width within ``max_n``."""
        if request.HasField("sampling_params"):
            raise InvalidRequestError(
                "sampling_params", "a beam search takes no sampling_params: its parameters are in beam_search"
            )
        params = beam_search_params_from_proto(request.beam_search)
        _check_limit("beam_search.beam_width", params.beam_width, self.config.max_n)
        _check_limit("beam_search.max_tokens", params.max_tokens, self.config.max_tokens_limit)
        return params

    def check_limits(self, message: Any) -> None:
        """Refuse sampling parameters over this server's ``max_n``, ``max_tokens_limit`` and per-token limits.

        ``message`` is a ``SamplingParams`` message of either service (their fields of these names agree); a field
        without presence counts as set when it is not zero.

        Raises:
            InvalidRequestError: a limit is passed (the field is ``sampling_params.<name>``).

        """
        longest_stop = max(map(len, message.stop), default=0)
        for field, size, setting, what in (
            ("stop", len(message.stop), "max_stop_strings", "has {} stop strings, more than"),
            ("stop", longest_stop, "max_stop_string_length", "has a string of {} characters, longer than"),
            ("stop_token_ids", len(message.stop_token_ids), "max_stop_token_ids", "has {} token ids, more than"),
            ("logit_bias", len(message.logit_bias), "max_logit_bias", "has {} entries, more than"),
        ):
            # Past the ceiling, SamplingParams refuses it as it would for any caller.
            limit, flag = getattr(self.config, setting), "--" + setting.replace("_", "-")
            if limit < size <= CEILINGS[setting]:
                raise InvalidRequestError(
                    f"sampling_params.{field}",
                    f"SamplingParams.{field} {what.format(size)} this server's limit of {limit} ({flag})",
                )
        for field, limit in (
            ("n", self.config.max_n),
            ("best_of", self.config.max_n),
            ("max_tokens", self.config.max_tokens_limit),
        ):
            if field in message.DESCRIPTOR.fields_by_name and _given(message, field):  # vLLM's message has no best_of
                _check_limit(f"sampling_params.{field}", getattr(message, field), limit)

    async def admitted_outputs(
        self,
        context: grpc.aio.ServicerContext,
        request_id: str,
        start: Callable[[str], AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[RequestOutput]:
        """The outputs of one engine request, admitted as every generation of this server is.

        The call holds a stream of its connection and a place in the queue; ``start(engine_id)`` starts the request
        under the caller's connection-scoped id (see :func:`engine_id`), and a client that leaves outputs unread past
        the server's limits has its request aborted and its call ended.

        Raises:
            OverLimitError: the connection has its most streams open, or the queue is full.

        """
        stalled = functools.partial(self._end_unread, context, asyncio.current_task())
        async for output in self.admitted(context.peer(), request_id, start, stalled):
            yield output

    async def admitted(
        self,
        peer: str,
        request_id: str,
        start: Callable[[str], AsyncIterator[RequestOutput]],
        stalled: Callable[[], None],
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`admitted_outputs` for any transport: the caller is ``peer``, its connection's address.

        ``stalled()`` is called once the request was aborted because its client left its outputs unread: the caller
        ends the call from there (it may wait in a write to that client).

        Raises:
            OverLimitError: the connection has its most streams open, or the queue is full.

        """
        config = self.config
        with self.connections.hold(peer), self.admission_control.admit() as admitted:
            request_engine_id = scoped_id(peer, request_id)
            outputs = start(request_engine_id)
            size, timeout = config.max_unread_outputs, config.unread_timeout
            # Closed with this generator, not when collected: a caller may close it from outside its awaits.
            async with contextlib.aclosing(read_ahead(outputs, size, timeout, request_engine_id, stalled)) as stream:
                async for output in stream:
                    admitted.started()
                    yield output

    def check_embed_inputs(self, num_inputs: int) -> None:
        """Refuse more inputs in one embedding call than ``max_embed_inputs`` (or the queue) holds.

        Raises:
            InvalidRequestError: too many inputs (the field is ``inputs``).

        """
        limit = min(self.config.max_embed_inputs, self.config.max_queued_requests)
        if num_inputs > limit:
            raise InvalidRequestError(
                "inputs", f"the request has {num_inputs} inputs, more than this server's limit of {limit}"
            )

    async def admitted_embeddings(
        self, peer: str, request_id: str, inputs: list[PromptInputs], pooling: PoolingParams, priority: int = 0
    ) -> list[EmbeddingRequestOutput]:
        """Embed ``inputs`` for the caller ``peer``, admitted as every ``Embed`` call is (each input one request).

        Raises:
            OverLimitError: the connection has its most streams open, or the queue has no room for the inputs.

        """
        # Each input waits in the queue until the call ends: an embedding ends with its prefill.
        with self.connections.hold(peer), self.admission_control.admit(len(inputs)):
            return await self.engine.embed(inputs, pooling, scoped_id(peer, request_id), priority=priority)

    async def _stream(
        self,
        request: spindle_pb2.GenerateRequest | spindle_pb2.ChatRequest,
        context: grpc.aio.ServicerContext,
        method: str,
        start: Callable[[SamplingParams, str], AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[spindle_pb2.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        span = None
        if self.tracer is not None:
            span = self.tracer.start(
                request_id, context.invocation_metadata() or (), self.engine.info.model_name, method
            )
        try:
            self.check_limits(request.sampling_params)
            params = sampling_params_from_proto(request.sampling_params, self.default_sampling)
            if span is not None:
                span.set_params(params)
            builder = ResponseBuilder()
            async for output in self.admitted_outputs(context, request_id, functools.partial(start, params)):
                response = builder.build(output)
                response.request_id = request_id  # the caller's, not the engine's
                if span is not None:
                    span.record(output, builder.completion_tokens)
                yield response
        except Exception as error:
            if span is not None:
                code, message, _ = status_for(error)
                span.set_status(code.value[0], message)
            raise
        except BaseException:  # the caller cancelled, or its deadline passed: the handler's task is cancelled
            if span is not None:
                span.set_status(grpc.StatusCode.CANCELLED.value[0], "the call was cancelled")
            raise
        finally:
            if span is not None:
                span.end()


async def _abort_quietly(context: grpc.aio.ServicerContext, message: str) -> None:
    """End the call with ``RESOURCE_EXHAUSTED`` and ``message``, once its client reads what comes before."""
    with contextlib.suppress(grpc.aio.AbortError, grpc.aio.UsageError):  # ended: by this abort, or before it
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def engine_id(context: grpc.aio.ServicerContext, request_id: str) -> str:
    """The engine's id of the caller's ``request_id``: under a digest of the caller's connection (its peer address).

    A connection is the one identity every caller has (one API key is shared by all of them), and a request lives
    no longer than the connection its stream is on, over which its ``Abort`` comes too.
    """
    return scoped_id(context.peer(), request_id)


def scoped_id(peer: str, request_id: str) -> str:
    """The engine's id of ``request_id`` made by the caller at ``peer``: ``<digest of peer>-<request_id>``."""
    caller = hashlib.sha256(peer.encode()).hexdigest()[:16]
    return f"{caller}-{request_id}"


def _check_limit(field: str, value: int, limit: int) -> None:
    """Refuse ``value`` of ``field`` (``sampling_params.max_tokens``) above this server's ``limit`` (0: none).

    Raises:
        InvalidRequestError: for ``field``, naming its last part, the value and the limit.

    """
    if limit and value > limit:
        name = field.rsplit(".", 1)[-1]
        raise InvalidRequestError(field, f"{name}={value} is above this server's limit of {limit}")


def _given(message: Any, name: str) -> bool:
    """Whether ``message`` sets field ``name``: by its presence where it has one, else by a value other than zero."""
    field = message.DESCRIPTOR.fields_by_name[name]
    return message.HasField(name) if field.has_presence else bool(getattr(message, name))


def token_id_or_minus_one(token_id: int | None) -> int:
    """``token_id``, or -1 for a token the model does not have (where a proto field has no presence)."""
    return -1 if token_id is None else token_id


def _watch_interval(request: spindle_pb2.WatchLoadRequest) -> float:
    """The request's ``interval`` in seconds (:data:`WATCH_INTERVAL` when unset), within the bounds."""
    if not request.HasField("interval"):
        return WATCH_INTERVAL
    seconds = request.interval.seconds + request.interval.nanos / 1e9
    low, high = WATCH_INTERVAL_BOUNDS
    if not low <= seconds <= high:
        raise InvalidRequestError(
            "interval",
            f"interval={seconds:g}s is outside [{low:g}s, {high:g}s]: leave it unset for {WATCH_INTERVAL:g}s",
        )
    return seconds


def _load_report(load: Load) -> spindle_pb2.LoadReport:
    timestamp = timestamp_pb2.Timestamp()
    timestamp.FromNanoseconds(int(load.timestamp * 1e9))
    return spindle_pb2.LoadReport(
        num_requests_running=load.num_requests_running,
        num_requests_waiting=load.num_requests_waiting,
        kv_cache_usage=load.kv_cache_usage,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        generation_tokens_per_second=load.generation_tokens_per_second,
        timestamp=timestamp,
    )


TOKENIZER_NICENESS = 10
"""How much the tokenizer threads yield the CPU (Linux niceness, per thread): a megabyte Tokenize call takes seconds
of a core, which on a small machine the backend's step threads and the event loop need more."""


def _yield_to_serving() -> None:
    """Lower the calling thread's CPU priority by :data:`TOKENIZER_NICENESS` (where the platform allows it)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: run at the usual priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICENESS)
