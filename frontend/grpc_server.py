"""The gRPC service: ``spindle.v1.SpindleService`` over an :class:`AsyncLLMEngine`, with health and reflection.

Errors are status codes a caller can act on: ``INVALID_ARGUMENT`` (with ``google.rpc.BadRequest`` field violations)
for bad inputs and parameters, ``RESOURCE_EXHAUSTED`` when the waiting queue is full (gRPC itself answers it for a
message over the size limit), ``UNAVAILABLE`` when the backend is down or the server drains, ``UNAUTHENTICATED``
without the configured API key; ``CANCELLED`` and ``DEADLINE_EXCEEDED`` come from gRPC and abort the request in the
backend (the handler's task is cancelled, which closes the engine stream). ``INTERNAL`` means a bug of ours.

This module runs in the frontend process and never imports torch.
"""

import argparse
import asyncio
import dataclasses
import functools
import hmac
import importlib.metadata
import inspect
import logging
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from spindle.frontend.async_llm_engine import AsyncLLMEngine
from spindle.frontend.core_client import EngineDeadError
from spindle.shared import CompletionOutput, Logprob, PromptInputs, RequestOutput, SamplingParams
from spindle.shared.config import attribute_help
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = spindle_pb2.DESCRIPTOR.services_by_name["SpindleService"].full_name
_FINISH_REASONS = {
    "stop": spindle_pb2.FINISH_REASON_STOP,
    "length": spindle_pb2.FINISH_REASON_LENGTH,
    "abort": spindle_pb2.FINISH_REASON_ABORT,
}
# Proto3 fields whose "unset" means the SamplingParams default rather than zero.
_OPTIONAL_PARAMS = (
    "n",
    "temperature",
    "top_p",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "cache_salt",
)
_PLAIN_PARAMS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
)


def _version() -> str:
    try:
        return importlib.metadata.version("spindle-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclasses.dataclass
class ServerConfig:
    """How the gRPC server listens and what it accepts.

    Attributes:
        host: interface to listen on (``0.0.0.0`` in a container).
        port: TCP port; ``0`` picks a free one (:meth:`GrpcServer.start` returns it).
        api_key: when set, every call but health checks needs ``authorization: Bearer <api_key>`` metadata.
        tls_cert: PEM certificate chain file; with ``tls_key``, the server speaks TLS only.
        tls_key: PEM private key file.
        max_message_bytes: largest request or response message.
        max_queued_requests: most requests accepted but not yet streaming (waiting for the backend to schedule
            them); one more is refused with ``RESOURCE_EXHAUSTED``.
        max_n: largest ``n`` (completions per request).
        max_tokens_limit: largest ``max_tokens``; ``0`` allows up to the model's context length.
        grace_period: seconds that streams in flight may take to finish after SIGTERM.

    """

    host: str = "127.0.0.1"
    port: int = 50051
    api_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = 4 * 2**20
    max_queued_requests: int = 256
    max_n: int = 16
    max_tokens_limit: int = 0
    grace_period: float = 30.0

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for name in ("max_message_bytes", "max_queued_requests", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per :class:`ServerConfig` field, defaulting to ``SPINDLE_<FIELD>`` from the environment."""
    helps = attribute_help(ServerConfig)
    for field in dataclasses.fields(ServerConfig):
        default = os.environ.get(f"SPINDLE_{field.name.upper()}", field.default)
        kind = {"int": int, "float": float}.get(type(field.default).__name__, str)
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=kind,
            default=None if default is None else kind(default),
            help=helps[field.name],
        )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the :class:`ServerConfig` from flags added by :func:`add_server_args`."""
    return ServerConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ServerConfig)})


class InvalidArgumentError(ValueError):
    """A bad request field, named so that it becomes a ``google.rpc.BadRequest`` field violation."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


def _violated_fields(message: str, prompt_field: str) -> list[str]:
    """Name the request fields a ValueError of the engine or of ``SamplingParams`` is about."""
    names = [f"sampling_params.{name}" for name in re.findall(r"SamplingParams\.(\w+)", message)]
    if "request id" in message:
        names.append("request_id")
    if message.startswith("messages") or "chat template" in message:
        names.append("messages")
    if "prompt" in message and not names:
        names.append(prompt_field)
    if "max_tokens=" in message and "the prompt has" in message:
        names += [prompt_field, "sampling_params.max_tokens"]
    return list(dict.fromkeys(names)) or [prompt_field]


def sampling_params_from_proto(message: spindle_pb2.SamplingParams, config: ServerConfig) -> SamplingParams:
    """Build (and so validate) :class:`SamplingParams`; unset optional fields keep their defaults.

    Raises:
        InvalidArgumentError: a value is out of range, or above the server's ``max_n`` / ``max_tokens_limit``.

    """
    kwargs: dict[str, Any] = {name: getattr(message, name) for name in _PLAIN_PARAMS}
    kwargs |= {name: getattr(message, name) for name in _OPTIONAL_PARAMS if message.HasField(name)}
    kwargs |= {"stop": list(message.stop) or None, "stop_token_ids": list(message.stop_token_ids) or None}
    kwargs["logit_bias"] = dict(message.logit_bias) or None
    if kwargs.get("n", 1) > config.max_n:
        raise InvalidArgumentError(
            f"n={kwargs['n']} is above this server's limit of {config.max_n}", ["sampling_params.n"]
        )
    max_tokens = kwargs.get("max_tokens")
    if config.max_tokens_limit and max_tokens is not None and max_tokens > config.max_tokens_limit:
        raise InvalidArgumentError(
            f"max_tokens={max_tokens} is above this server's limit of {config.max_tokens_limit}",
            ["sampling_params.max_tokens"],
        )
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:
        raise InvalidArgumentError(str(error), _violated_fields(str(error), "prompt")) from error


def _prompt_inputs(prompt: spindle_pb2.Prompt) -> PromptInputs:
    kind = prompt.WhichOneof("input")
    if kind is None:
        raise InvalidArgumentError("the prompt is empty: set prompt.text or prompt.token_ids", ["prompt"])
    inputs: dict[str, Any] = (
        {"prompt": prompt.text} if kind == "text" else {"prompt_token_ids": list(prompt.token_ids.ids)}
    )
    if prompt.multi_modal_data:
        data: dict[str, list[bytes]] = {}
        for item in prompt.multi_modal_data:
            data.setdefault(item.mime_type.split("/")[0], []).append(item.data)
        inputs["multi_modal_data"] = data
    return inputs


def _position_logprobs(logprobs: dict[int, Logprob] | None) -> spindle_pb2.PositionLogprobs:
    return spindle_pb2.PositionLogprobs(
        tokens=[
            spindle_pb2.TokenLogprob(token_id=token_id, logprob=lp.logprob, rank=lp.rank or 0, text=lp.decoded_token)
            for token_id, lp in (logprobs or {}).items()
        ]
    )


def _completion_delta(completion: CompletionOutput, finish_reason: str | None) -> spindle_pb2.CompletionDelta:
    delta = spindle_pb2.CompletionDelta(
        index=completion.index,
        text=completion.text,
        token_ids=completion.token_ids,
        logprobs=[_position_logprobs(lp) for lp in completion.logprobs or []],
        finish_reason=_FINISH_REASONS.get(finish_reason, spindle_pb2.FINISH_REASON_UNSPECIFIED),
    )
    if completion.cumulative_logprob is not None:
        delta.cumulative_logprob = completion.cumulative_logprob
    if finish_reason is not None and isinstance(completion.stop_reason, str):
        delta.stop_string = completion.stop_reason
    elif finish_reason is not None and isinstance(completion.stop_reason, int):
        delta.stop_token_id = completion.stop_reason
    return delta


class _ResponseBuilder:
    """Turns one request's delta-mode ``RequestOutput`` stream into ``GenerateResponse`` messages."""

    def __init__(self) -> None:
        self.reported_finished: set[int] = set()
        self.completion_tokens = 0
        self.sent_prompt_logprobs = False

    def build(self, output: RequestOutput) -> spindle_pb2.GenerateResponse:
        response = spindle_pb2.GenerateResponse(request_id=output.request_id, finished=output.finished)
        for completion in output.outputs:
            # Finished completions keep appearing in later outputs; report their end once.
            finish = completion.finish_reason if completion.index not in self.reported_finished else None
            if completion.token_ids or completion.text or finish is not None:
                response.choices.append(_completion_delta(completion, finish))
                self.completion_tokens += len(completion.token_ids)
            if finish is not None:
                self.reported_finished.add(completion.index)
        if output.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            response.prompt_logprobs.extend(_position_logprobs(lp) for lp in output.prompt_logprobs)
            self.sent_prompt_logprobs = True
        if output.finished:
            response.usage.CopyFrom(
                spindle_pb2.Usage(
                    prompt_tokens=len(output.prompt_token_ids),
                    completion_tokens=self.completion_tokens,
                    cached_tokens=output.num_cached_tokens,
                )
            )
        return response


async def _abort_with(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, fields=()) -> None:
    """End the call with ``code``; ``fields`` become ``google.rpc.BadRequest`` field violations."""
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    if fields:
        detail = any_pb2.Any()
        detail.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=field, description=message) for field in fields
                ]
            )
        )
        status.details.append(detail)
    await context.abort_with_status(rpc_status.to_status(status))


def _reports_bugs(method: Callable) -> Callable:
    """Turn an unexpected exception of an RPC method into ``INTERNAL`` (gRPC would say ``UNKNOWN``) and log it."""

    async def report(context: grpc.aio.ServicerContext, error: Exception) -> None:
        logger.exception("Bug in %s", method.__name__)
        message = f"internal error ({type(error).__name__}: {error}): a bug in Spindle, please report it"
        await _abort_with(context, grpc.StatusCode.INTERNAL, message)

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(self: "SpindleServicer", request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            try:
                async for response in method(self, request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as error:
                await report(context, error)

        return stream

    @functools.wraps(method)
    async def unary(self: "SpindleServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await report(context, error)

    return unary


class SpindleServicer(spindle_pb2_grpc.SpindleServiceServicer):
    """Implements ``spindle.v1.SpindleService`` on an :class:`AsyncLLMEngine`.

    Args:
        engine: the engine, connected to its backend.
        config: the server's limits.

    """

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.started = time.monotonic()
        self.draining = False
        self.num_queued = 0
        self.num_streams = 0
        self.streams_done = asyncio.Event()
        self.streams_done.set()

    @_reports_bugs
    async def Generate(  # noqa: N802 - gRPC method names are CamelCase
        self, request: spindle_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spindle_pb2.GenerateResponse]:
        """Stream the completions of one prompt."""

        def start(params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
            return self.engine.generate(_prompt_inputs(request.prompt), params, request_id, delta=True)

        async for response in self._stream(request, context, "prompt", start):
            yield response

    @_reports_bugs
    async def Chat(  # noqa: N802
        self, request: spindle_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spindle_pb2.GenerateResponse]:
        """Stream the model's reply to a conversation."""
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True

        def start(params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
            return self.engine.chat(
                messages, params, request_id, add_generation_prompt=add_generation_prompt, delta=True
            )

        async for response in self._stream(request, context, "messages", start):
            yield response

    @_reports_bugs
    async def Tokenize(  # noqa: N802
        self, request: spindle_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.TokenizeResponse:
        """Tokenize text."""
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = self.engine.tokenizer.encode(request.text, add_special_tokens=add_special)
        tokens = self.engine.tokenizer.convert_ids_to_tokens(token_ids)
        return spindle_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokens)

    @_reports_bugs
    async def Detokenize(  # noqa: N802
        self, request: spindle_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.DetokenizeResponse:
        """Decode token ids."""
        vocab_size = self.engine.info.vocab_size
        outside = sorted({t for t in request.token_ids if not 0 <= t < vocab_size})
        if outside:
            message = f"token ids {outside} are outside the vocabulary: token ids must be in [0, {vocab_size})"
            await _abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, message, ["token_ids"])
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return spindle_pb2.DetokenizeResponse(
            text=self.engine.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)
        )

    @_reports_bugs
    async def Abort(  # noqa: N802
        self, request: spindle_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.AbortResponse:
        """Abort a request in flight."""
        aborted = request.request_id in self.engine.output_processor.requests
        await self.engine.abort(request.request_id)
        return spindle_pb2.AbortResponse(aborted=aborted)

    @_reports_bugs
    async def GetModelInfo(  # noqa: N802
        self, request: spindle_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.GetModelInfoResponse:
        """Describe the served model."""
        info, tokenizer = self.engine.info, self.engine.tokenizer
        special = [
            spindle_pb2.SpecialToken(name=name, text=text, token_id=_token_id(tokenizer.backend.token_to_id(text)))
            for name, text in sorted(tokenizer.special_tokens.items())
        ]
        return spindle_pb2.GetModelInfoResponse(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            special_tokens=special,
            has_chat_template=tokenizer.has_chat_template,
        )

    @_reports_bugs
    async def GetServerInfo(  # noqa: N802
        self, request: spindle_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> spindle_pb2.GetServerInfoResponse:
        """Report version, uptime and load."""
        try:
            stats = await self.engine.get_stats()
        except EngineDeadError as dead:
            await _abort_with(context, grpc.StatusCode.UNAVAILABLE, _dead_message(dead))
        return spindle_pb2.GetServerInfoResponse(
            version=_version(),
            uptime_seconds=time.monotonic() - self.started,
            num_running_requests=stats.num_running,
            num_waiting_requests=stats.num_waiting,
            num_free_kv_blocks=stats.num_free_blocks,
            num_total_kv_blocks=stats.num_total_blocks,
            num_preemptions=stats.num_preemptions,
        )

    async def _stream(
        self,
        request: spindle_pb2.GenerateRequest | spindle_pb2.ChatRequest,
        context: grpc.aio.ServicerContext,
        prompt_field: str,
        start: Callable[[SamplingParams, str], AsyncIterator[RequestOutput]],
    ) -> AsyncIterator[spindle_pb2.GenerateResponse]:
        if self.draining:
            await _abort_with(context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down: retry elsewhere")
        if self.num_queued >= self.config.max_queued_requests:
            await _abort_with(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.num_queued} requests are already waiting (the limit is {self.config.max_queued_requests}):"
                " retry later with backoff",
            )
        self.num_queued += 1
        self.num_streams += 1
        self.streams_done.clear()
        queued = True
        builder = _ResponseBuilder()
        try:
            params = sampling_params_from_proto(request.sampling_params, self.config)
            async for output in start(params, request.request_id or uuid.uuid4().hex):
                if queued:
                    self.num_queued -= 1
                    queued = False
                yield builder.build(output)
        except InvalidArgumentError as error:
            await _abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, str(error), error.fields)
        except ValueError as error:
            message = str(error)
            if "shutting down" in message:
                await _abort_with(context, grpc.StatusCode.UNAVAILABLE, message)
            await _abort_with(
                context, grpc.StatusCode.INVALID_ARGUMENT, message, _violated_fields(message, prompt_field)
            )
        except EngineDeadError as dead:
            await _abort_with(context, grpc.StatusCode.UNAVAILABLE, _dead_message(dead))
        finally:
            self.num_queued -= queued
            self.num_streams -= 1
            if not self.num_streams:
                self.streams_done.set()


def _token_id(token_id: int | None) -> int:
    return -1 if token_id is None else token_id


def _dead_message(dead: EngineDeadError) -> str:
    return f"the model backend is down ({dead}): retry against another replica, or restart this one"


_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks that lacks ``authorization: Bearer <api_key>``."""

    def __init__(self, api_key: str) -> None:
        self.expected = f"Bearer {api_key}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self.expected):
            return handler

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            reason = "wrong API key" if given else "missing API key"
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, f"{reason}: send the metadata 'authorization: Bearer <api key>'"
            )

        factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
        return factory(deny, handler.request_deserializer, handler.response_serializer)


class GrpcServer:
    """The gRPC server: Spindle, health and reflection services on one port, and its drain on shutdown.

    Health reports ``SERVING`` while the backend lives and the server is not draining, ``NOT_SERVING`` otherwise,
    both for the whole server (``""``) and for ``spindle.v1.SpindleService``.

    Args:
        engine: the engine, connected to its backend.
        config: where to listen and the limits.

    """

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.servicer = SpindleServicer(engine, config)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
        ]
        interceptors = [_ApiKeyInterceptor(config.api_key)] if config.api_key else []
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self._watcher: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind, start serving and watching the backend; returns the bound port."""
        spindle_pb2_grpc.add_SpindleServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert:
            with open(self.config.tls_key, "rb") as key, open(self.config.tls_cert, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        # The first stats call starts the engine's output task, which also watches the backend's heartbeats.
        await self.engine.get_stats()
        await self.server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watcher = asyncio.get_running_loop().create_task(self._watch_backend())
        logger.info("Serving %s on %s:%d", self.engine.info.model_name, self.config.host, self.port)
        return self.port

    async def drain(self) -> None:
        """Report NOT_SERVING, refuse new streams, let those in flight finish for ``grace_period`` s, then stop."""
        self.servicer.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        logger.info("Draining %d streams for up to %.0f s", self.servicer.num_streams, self.config.grace_period)
        try:
            await asyncio.wait_for(self.servicer.streams_done.wait(), self.config.grace_period)
        except TimeoutError:
            logger.warning("Streams still running after the grace period are cancelled")
        await self.stop()

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving at once (streams in flight are cancelled, which aborts them in the backend)."""
        if self._watcher is not None:
            self._watcher.cancel()
        await self.server.stop(grace)

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _watch_backend(self) -> None:
        while not self.engine.is_dead:
            await asyncio.sleep(0.1)
        logger.error("The model backend is down: reporting NOT_SERVING")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve(engine: AsyncLLMEngine, config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see :meth:`GrpcServer.drain`)."""
    server = GrpcServer(engine, config)
    await server.start()
    print(f"spindle: serving {engine.info.model_name} on {config.host}:{server.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.drain()
