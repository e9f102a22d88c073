"""The OpenAI-compatible routes, as a Starlette app over the gRPC server's servicer: one engine, one set of limits.

Every generation goes through :meth:`~spindle.frontend.grpc.servicer.SpindleServicer.admitted` (the queue, the
streams of a connection, the unread-output limit, request ids scoped by the caller's address) and every embedding
through :meth:`~spindle.frontend.grpc.servicer.SpindleServicer.admitted_embeddings`, as on the gRPC port; errors are
the ones :func:`~spindle.frontend.grpc.servicer.status_for` chooses, in OpenAI's shape (:mod:`.protocol`).
"""

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from spindle.frontend.grpc.mapping import sampling_params_from_proto
from spindle.frontend.grpc.servicer import SpindleServicer
from spindle.frontend.http import protocol
from spindle.frontend.http.protocol import RequestError, field
from spindle.frontend.processing.tools import ChatTools, new_tool_call_id
from spindle.shared import CompletionOutput, PoolingParams, PromptInputs, RequestOutput, SamplingParams, ToolCall
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.lora import LoRARequest

logger = logging.getLogger(__name__)

Events = AsyncIterator[dict[str, Any]]
"""What a generation route produces: the whole response (one item), or each event of its stream."""


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests (a completion's prompts) as they come, each with its stream's index.

    Each stream is read by a task of its own into a queue of one place per stream, so that a client that stops
    reading holds them all back (and their unread-output limits apply). Closing this generator closes them all.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(len(streams))

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for output in stream:
                    await queue.put((index, output))
            await queue.put((index, None))
        except Exception as error:
            await queue.put((index, error))

    loop = asyncio.get_running_loop()
    pumps = [loop.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


class GenerationResponse:
    """The ASGI response of one generation: a JSON body, or a server-sent event stream ending in ``[DONE]``.

    The first item of ``events`` comes before anything is sent, so that a request refused on its way in (a bad
    parameter, a full queue) gets its own HTTP status; an error after it is an ``error`` event. The events are
    produced in a task that ends when the client disconnects, which closes the engine streams and so aborts their
    requests (their KV blocks come back); so does a stall (the client left ``max_unread_outputs`` unread for
    ``unread_timeout`` seconds), which also drops the connection.

    Args:
        make: ``make(stalled)`` returns the events; ``stalled`` is what to call on a stall.
        stream: send server-sent events (else the one item as JSON).
        renames: the route's parameter names where they differ from the gRPC API's (see :func:`protocol.error_body`).
        tasks: the set of responses in flight, which a server's stop cancels.

    """

    def __init__(
        self,
        make: Callable[[Callable[[], None]], Events],
        stream: bool,
        renames: dict[str, str],
        tasks: set[asyncio.Task],
    ) -> None:
        self.make = make
        self.stream = stream
        self.renames = renames
        self.tasks = tasks
        self.work: asyncio.Task | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the response, unless the client leaves first."""
        loop = asyncio.get_running_loop()
        self.work = loop.create_task(self._respond(send))
        self.tasks.add(self.work)
        gone = loop.create_task(_disconnected(receive))
        try:
            await asyncio.wait([self.work, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.tasks.discard(self.work)
            for task in (self.work, gone):
                task.cancel()
            await asyncio.gather(self.work, gone, return_exceptions=True)

    def _stalled(self) -> None:
        if self.work is not None:
            self.work.cancel()

    async def _respond(self, send: Send) -> None:
        events = self.make(self._stalled)
        try:
            try:
                first = await anext(events)
            except Exception as error:
                status, body = self._error(error)
                await _send_json(send, status, body)
                return
            if not self.stream:
                await _send_json(send, 200, first)
                return
            headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": _event(first), "more_body": True})
            try:
                async for event in events:
                    await send({"type": "http.response.body", "body": _event(event), "more_body": True})
            except Exception as error:
                await send({"type": "http.response.body", "body": _event(self._error(error)[1]), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            await events.aclose()

    def _error(self, error: Exception) -> tuple[int, dict[str, Any]]:
        status, body = protocol.error_body(error, self.renames)
        if status == 500 and body["error"]["code"] == "internal_error":
            logger.error("Bug in an HTTP request", exc_info=error)
        return status, body


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _json(data: dict[str, Any]) -> bytes:
    """``data`` as compact JSON, as Starlette's ``JSONResponse`` writes it."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + _json(data) + b"\n\n"


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = _json(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _error_response(error: Exception) -> JSONResponse:
    status, body = protocol.error_body(error)
    return JSONResponse(body, status)


class OpenAIApp:
    """The OpenAI-compatible API of one frontend: its routes over the gRPC server's servicer.

    Args:
        servicer: the gRPC server's servicer, whose engine, limits and admission the routes share.
        metrics: renders the Prometheus metrics (those of ``--metrics-port``) as text.

    Attributes:
        app: the Starlette (ASGI) application.
        responses: the generation responses in flight, which :meth:`cancel` ends.

    """

    def __init__(self, servicer: SpindleServicer, metrics: Callable[[], bytes]) -> None:
        self.servicer = servicer
        self.engine = servicer.engine
        self.config = servicer.config
        self.metrics = metrics
        self.responses: set[asyncio.Task] = set()
        keys = (self.config.api_key, self.config.admin_api_key)
        self.keys = [f"Bearer {key}".encode() for key in keys if key is not None]
        routes = [
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/embeddings", self._guarded(self.embeddings), methods=["POST"]),
            Route("/v1/models", self._guarded(self.models), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        handlers = {HTTPException: _http_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    def cancel(self) -> None:
        """End every generation in flight (its requests are aborted in the engine)."""
        for task in self.responses:
            task.cancel()

    def _guarded(self, route: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``route`` behind the API key, its errors as OpenAI error bodies."""

        async def guarded(request: Request) -> Response:
            try:
                self._check_key(request)
                return await route(request)
            except Exception as error:
                status, body = protocol.error_body(error)
                if status == 500 and body["error"]["code"] == "internal_error":
                    logger.error("Bug in %s", request.url.path, exc_info=error)
                return JSONResponse(body, status)

        return guarded

    def _check_key(self, request: Request) -> None:
        if not self.keys:
            return
        given = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(given, key) for key in self.keys):
            reason = "wrong API key" if given else "missing API key"
            raise RequestError(
                401,
                f"{reason}: send the header 'Authorization: Bearer <api key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    async def _body(self, request: Request, allowed: frozenset[str]) -> dict[str, Any]:
        """The request's JSON object, at most ``max_message_bytes`` long, with no field but ``allowed``."""
        limit = self.config.max_message_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except ValueError as error:
            raise RequestError(400, f"the request body is not valid JSON: {error}") from error
        return protocol.check_fields(body, allowed)

    def _lora(self, body: dict[str, Any]) -> tuple[str, LoRARequest | None]:
        """The ``model`` a request names, and its adapter: none for a served model name (also when ``model`` is unset).

        Any other name is an adapter's, and an unknown one ``404 model_not_found``, as in vLLM.
        """
        names = self.servicer.served_model_names
        model = field(body, "model", "str") or names[0]
        return model, None if model in names else LoRARequest(model)

    def _sampling(self, body: dict[str, Any], names: dict[str, str] | None = None, **set_here: int) -> SamplingParams:
        """The request's sampling parameters, checked against the server's limits as a gRPC request's are.

        The server's defaults (:attr:`~spindle.frontend.grpc.servicer.SpindleServicer.default_sampling`) fill the
        fields the body leaves out; one it sets wins, even at 0 (which a gRPC request could not say for ``top_k``).
        """
        message = protocol.sampling_message(body, names)
        for name, value in set_here.items():
            try:
                setattr(message, name, value)
            except ValueError as error:  # past int32
                raise InvalidRequestError(name, f"{name}={value} is out of range: {error}") from error
        self.servicer.check_limits(message)
        renames = names or {}
        defaults = {
            name: value
            for name, value in self.servicer.default_sampling.items()
            if body.get(renames.get(name, name)) is None and name not in set_here
        }
        return sampling_params_from_proto(message, defaults)

    def _request_id(self, request: Request, prefix: str) -> str:
        return request.headers.get("x-request-id") or protocol.new_id(prefix)

    def _peer(self, request: Request) -> str:
        """The caller's connection, as gRPC names a peer: it scopes request ids and counts the connection's streams."""
        client = request.client
        return f"http:{client.host}:{client.port}" if client is not None else "http:unknown"

    def _outputs(
        self,
        request: Request,
        request_id: str,
        start: Callable[[str], AsyncIterator[RequestOutput]],
        stalled: Callable[[], None],
    ) -> AsyncIterator[RequestOutput]:
        return self.servicer.admitted(self._peer(request), request_id, start, stalled)

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: one or more prompts, ``n`` completions each."""
        body = await self._body(request, protocol.COMPLETION_FIELDS)
        model, lora = self._lora(body)
        if "prompt" not in body:
            raise InvalidRequestError("prompt", "prompt is required: a string, strings, token ids or lists of them")
        inputs = protocol.prompts(body["prompt"], "prompt")
        logprobs, echo = field(body, "logprobs", "int"), bool(field(body, "echo", "bool"))
        set_here = {} if logprobs is None else {"logprobs": logprobs}
        params = self._sampling(body, **set_here)
        if echo and logprobs is not None:
            raise InvalidRequestError("echo", "echo with logprobs is not supported: leave one of them out")
        stream, include_usage = self._stream_flags(body)
        priority = field(body, "priority", "int") or 0
        request_id = self._request_id(request, "cmpl")

        def make(stalled: Callable[[], None]) -> Events:
            streams = []
            for index, prompt in enumerate(inputs):

                def start(engine_id: str, prompt: PromptInputs = prompt) -> AsyncIterator[RequestOutput]:
                    return self.engine.generate(
                        prompt, params, engine_id, delta=True, priority=priority, lora_request=lora
                    )

                one_id = request_id if len(inputs) == 1 else f"{request_id}-{index}"
                streams.append(self._outputs(request, one_id, start, stalled))
            shaper = _CompletionShaper(request_id, model, params, echo, self.engine.tokenizer)
            return shaper.events(merged(streams), stream, include_usage)

        return GenerationResponse(make, stream, {}, self.responses)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: the model's reply to a conversation, rendered with its chat template."""
        body = await self._body(request, protocol.CHAT_FIELDS)
        model, lora = self._lora(body)
        messages = field(body, "messages", "list")
        if messages is None:
            raise InvalidRequestError("messages", "messages is required: a list of {'role', 'content'} objects")
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        renames = {"max_tokens": max_name, "logprobs": "top_logprobs"}
        top = field(body, "top_logprobs", "int")
        if top is not None and not field(body, "logprobs", "bool"):
            raise InvalidRequestError("top_logprobs", "top_logprobs needs logprobs: true")
        set_here = {"logprobs": top or 0} if field(body, "logprobs", "bool") else {}
        try:
            params = self._sampling(body, {"max_tokens": max_name}, **set_here)
        except InvalidRequestError as error:
            raise InvalidRequestError(protocol.openai_param(error.field, renames), error.reason) from error
        if body.get(max_name) is None and "max_tokens" not in self.servicer.default_sampling:
            # OpenAI's default: up to the context (or this server's limit), where a gRPC request's is 16 tokens.
            params.max_tokens = self.config.max_tokens_limit or None
        tools = field(body, "tools", "list")
        tool_choice = body.get("tool_choice") or "auto"
        chat_tools = ChatTools.from_request(tools, tool_choice, params)
        add_generation_prompt = field(body, "add_generation_prompt", "bool")
        max_calls = 1 if field(body, "parallel_tool_calls", "bool") is False else None
        stream, include_usage = self._stream_flags(body)
        priority = field(body, "priority", "int") or 0
        request_id = self._request_id(request, "chatcmpl")

        def make(stalled: Callable[[], None]) -> Events:
            def start(engine_id: str) -> AsyncIterator[RequestOutput]:
                return self.engine.chat(
                    messages,
                    params,
                    engine_id,
                    add_generation_prompt=add_generation_prompt is not False,
                    delta=True,
                    tools=tools,
                    tool_choice=tool_choice,
                    priority=priority,
                    lora_request=lora,
                )

            shaper = _ChatShaper(request_id, model, params, top if top is not None else 0, chat_tools, max_calls)
            outputs = merged([self._outputs(request, request_id, start, stalled)])
            return shaper.events(outputs, stream, include_usage)

        return GenerationResponse(make, stream, renames, self.responses)

    def _stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """Whether the request streams, and whether its stream ends with a usage chunk (``stream_options``)."""
        stream = bool(field(body, "stream", "bool"))
        options = field(body, "stream_options", "object")
        if options is not None and not stream:
            raise InvalidRequestError("stream_options", "stream_options is only allowed with stream: true")
        include_usage = bool(field(options or {}, "include_usage", "bool"))
        return stream, include_usage

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: one embedding per input, as floats or base64."""
        body = await self._body(request, protocol.EMBEDDING_FIELDS)
        model, lora = self._lora(body)
        if lora is not None:
            raise RequestError(
                404,
                f"the model {model!r} does not exist: embeddings use the base model",
                code="model_not_found",
                param="model",
            )
        if "input" not in body:
            raise InvalidRequestError("input", "input is required: a string, strings, token ids or lists of them")
        inputs = protocol.prompts(body["input"], "input")
        self.servicer.check_embed_inputs(len(inputs))
        encoding_format = field(body, "encoding_format", "str") or "float"
        if encoding_format not in ("float", "base64"):
            raise InvalidRequestError(
                "encoding_format", f"encoding_format must be float or base64, not {encoding_format!r}"
            )
        dimensions = field(body, "dimensions", "int")
        pooling = PoolingParams() if dimensions is None else PoolingParams(dimensions=dimensions)
        priority = field(body, "priority", "int") or 0
        request_id = self._request_id(request, "embd")
        outputs = await self.servicer.admitted_embeddings(self._peer(request), request_id, inputs, pooling, priority)
        return JSONResponse(protocol.embeddings_response(model, outputs, encoding_format))

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: each served model name and every loaded LoRA adapter (its ``parent`` the first name)."""
        info, names = self.engine.info, self.servicer.served_model_names
        created = protocol.now()
        base = {"object": "model", "created": created, "owned_by": "spindle", "max_model_len": info.max_model_len}
        data = [base | {"id": name, "root": info.model_name, "parent": None} for name in names]
        for adapter in await self.engine.list_loras():
            data.append(base | {"id": adapter.name, "root": adapter.path, "parent": names[0]})
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        """``GET /health``: ``200`` while the backend lives and the server takes requests, else ``503``."""
        if self.servicer.admission_control.draining:
            return _error_response(EngineUnavailableError("the server is shutting down"))
        if self.engine.is_dead:
            return _error_response(EngineUnavailableError("the model backend is down: one is being brought back"))
        return Response(status_code=200)

    async def prometheus(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus text of ``--metrics-port``, vLLM's names included."""
        return Response(self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(
        413, f"the request body has {size} bytes or more, above this server's limit of {limit} (--max-message-bytes)"
    )


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's own errors (no such route, a wrong method) in OpenAI's shape."""
    assert isinstance(error, HTTPException)
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(RequestError(error.status_code, message).body, error.status_code)


class _Shaper:
    """Turns a generation's delta-mode outputs into an OpenAI response or its stream's chunks.

    Each choice's index is ``prompt index * n + completion index``; a finished choice's end is reported once
    (finished completions keep coming in later outputs), and the usage adds up the prompts'.
    """

    object: str = ""
    """The ``object`` of a stream's chunks."""

    def __init__(self, request_id: str, model: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.model = model
        self.params = params
        self.created = protocol.now()
        self.ended: set[int] = set()
        self.finals: dict[int, RequestOutput] = {}
        self.completion_tokens = 0

    def new_parts(self, prompt_index: int, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """The completions of ``output`` with something new, each with its choice index."""
        if output.finished:
            self.finals[prompt_index] = output
        parts = []
        for completion in output.outputs:
            index = prompt_index * self.params.n + completion.index
            if index in self.ended:
                continue
            if completion.finish_reason is not None:
                self.ended.add(index)
            if completion.token_ids or completion.text or completion.finish_reason is not None:
                self.completion_tokens += len(completion.token_ids)
                parts.append((index, completion))
        return parts

    def usage(self) -> dict[str, Any]:
        """The ``usage`` of the whole request."""
        return protocol.usage(list(self.finals.values()), self.completion_tokens)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A stream chunk of ``choices``."""
        return {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    async def events(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], stream: bool, include_usage: bool
    ) -> Events:
        """The response (one item), or the stream's chunks and, with ``include_usage``, a last one of the usage."""
        async with contextlib.aclosing(outputs):
            async for prompt_index, output in outputs:
                choices = [self.part(index, part, output) for index, part in self.new_parts(prompt_index, output)]
                if stream:
                    for event in self.stream_events([c for c in choices if c is not None]):
                        yield event
        if not stream:
            yield self.response()
        elif include_usage:
            yield self.chunk([]) | {"usage": self.usage()}

    def part(self, index: int, completion: CompletionOutput, output: RequestOutput) -> dict[str, Any] | None:
        """Take in one choice's new part; return its stream choice (``None``: nothing to send yet)."""
        raise NotImplementedError

    def stream_events(self, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chunks that carry one output's stream choices."""
        return [self.chunk(choices)] if choices else []

    def response(self) -> dict[str, Any]:
        """The whole response, once every output is in."""
        raise NotImplementedError


class _CompletionShaper(_Shaper):
    """``/v1/completions``: text choices, legacy ``logprobs``, the prompt before the text with ``echo``."""

    object = "text_completion"

    def __init__(self, request_id: str, model: str, params: SamplingParams, echo: bool, tokenizer: Any) -> None:
        super().__init__(request_id, model, params)
        self.echo = echo
        self.tokenizer = tokenizer
        self.choices: dict[int, dict[str, Any]] = {}

    def part(self, index: int, completion: CompletionOutput, output: RequestOutput) -> dict[str, Any]:
        """Add the new text (and logprobs) to the choice; return its stream choice."""
        choice = self.choices.get(index)
        text = completion.text
        if choice is None:
            choice = self.choices[index] = {"index": index, "text": "", "logprobs": None}
            if self.echo:
                text = (output.prompt or self.tokenizer.decode(output.prompt_token_ids)) + text
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = protocol.completion_logprobs(completion, len(choice["text"]))
            if choice["logprobs"] is None:
                choice["logprobs"] = {key: [] for key in logprobs}
            for key, values in logprobs.items():
                choice["logprobs"][key].extend(values)
        choice["text"] += text
        ended = {"finish_reason": completion.finish_reason, "stop_reason": protocol.stop_reason(completion)}
        choice.update(ended)
        return {"index": index, "text": text, "logprobs": logprobs} | ended

    def response(self) -> dict[str, Any]:
        """The ``text_completion`` of every choice, by index."""
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choices[index] for index in sorted(self.choices)],
            "usage": self.usage(),
        }


class _ChatShaper(_Shaper):
    """``/v1/chat/completions``: assistant messages, role then content deltas, ``tool_calls`` when tools parse.

    A reasoning model's thoughts (with ``--reasoning-parser``) come as ``reasoning_content``, beside ``content``, in
    the message and in each delta that has new ones, as vLLM gives them.

    With ``tools`` (a tool choice other than ``none``), a choice's text is held until it ends, as it may be calls.
    Each call streams as OpenAI's and vLLM's do: a ``tool_calls`` delta with its index, id and name (and the start of
    its arguments) once its arguments begin, then deltas of the arguments' text as the model writes it, whose
    concatenation is the arguments' JSON; a call whose arguments cannot be followed so (given as a JSON string, or
    after the name) comes whole as soon as it is. The finish reason is then ``tool_calls``; a reply without calls
    comes as content when it ends. ``max_calls`` keeps a reply's first calls only (``parallel_tool_calls: false``
    keeps one).
    """

    object = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        params: SamplingParams,
        top: int,
        tools: ChatTools | None,
        max_calls: int | None = None,
    ) -> None:
        super().__init__(request_id, model, params)
        self.top = top
        self.tools = tools
        self.max_calls = max_calls
        self.texts: dict[int, str] = {}
        self.calls: dict[int, list[ToolCall]] = {}
        # By choice, the id and the arguments' text sent so far of each call streamed as it is written.
        self.streamed: dict[int, list[tuple[str, str]]] = {}
        self.reasoning: dict[int, str] = {}
        self.logprobs: dict[int, list[dict[str, Any]]] = {}
        self.ends: dict[int, CompletionOutput] = {}
        self.started = False

    def part(self, index: int, completion: CompletionOutput, output: RequestOutput) -> dict[str, Any] | None:
        """Add the new text (and logprobs) to the choice; return its delta (none while a reply with tools is held)."""
        self.texts[index] = self.texts.get(index, "") + completion.text
        thoughts = {"reasoning_content": completion.reasoning_content} if completion.reasoning_content else {}
        if thoughts:
            self.reasoning[index] = self.reasoning.get(index, "") + completion.reasoning_content
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = protocol.chat_logprobs(completion, self.top)
            self.logprobs.setdefault(index, []).extend(logprobs["content"])
        if completion.finish_reason is not None:
            self.ends[index] = completion
        if self.tools is None:
            choice = {"index": index, "delta": thoughts | {"content": completion.text}, "logprobs": logprobs}
            return choice | self._ending(completion)
        new = self._call_deltas(index, completion)
        calls = self.calls[index]
        if completion.finish_reason is None:  # the text is held; the calls stream as they are written
            return (
                {"index": index, "delta": {"tool_calls": new}, "logprobs": None, "finish_reason": None} if new else None
            )
        held = {"content": self.logprobs.get(index, [])} if self.params.logprobs is not None else None
        delta = ({"tool_calls": new} if new else {}) if calls else {"content": self.texts[index]}
        if index in self.reasoning:
            delta = {"reasoning_content": self.reasoning[index]} | delta
        return {"index": index, "delta": delta, "logprobs": held} | self._ending(completion)

    def _call_deltas(self, index: int, completion: CompletionOutput) -> list[dict[str, Any]]:
        """The ``tool_calls`` deltas of this output: the rest of each call now whole, then the call being written."""
        assert self.tools is not None
        calls = self.calls.setdefault(index, [])
        streamed = self.streamed.setdefault(index, [])
        first = len(calls)
        calls += (completion.tool_calls or [])[: None if self.max_calls is None else self.max_calls - first]
        writing = self.tools.writing(self.texts[index])
        deltas = []
        for i in range(first, len(calls)):
            if i < len(streamed):  # streamed as it was written: the rest of its arguments, under its id
                call_id, sent = streamed[i]
                calls[i] = msgspec.structs.replace(calls[i], id=call_id)
                whole = writing[i].arguments if i < len(writing) and writing[i].complete else calls[i].arguments
                if whole.startswith(sent) and len(whole) > len(sent):
                    deltas.append({"index": i, "function": {"arguments": whole[len(sent) :]}})
            else:
                deltas += _tool_calls([calls[i]], streamed=True, first=i)
        i = len(calls)
        if completion.finish_reason is None and i < len(writing) and (self.max_calls is None or i < self.max_calls):
            call = writing[i]
            if i == len(streamed):  # its head: index, id and name, with its arguments so far
                call_id = new_tool_call_id()
                streamed.append((call_id, call.arguments))
                deltas += _tool_calls([ToolCall(call_id, call.name, call.arguments)], streamed=True, first=i)
            elif len(call.arguments) > len(streamed[i][1]):
                call_id, sent = streamed[i]
                streamed[i] = (call_id, call.arguments)
                deltas.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
        return deltas

    def stream_events(self, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The role chunk of every choice before the first content, then the choices."""
        events = []
        if not self.started:
            self.started = True
            roles = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.params.n)
            ]
            events.append(self.chunk(roles))
        return events + super().stream_events(choices)

    def _ending(self, completion: CompletionOutput) -> dict[str, Any]:
        reason = completion.finish_reason
        if reason is not None and self.calls.get(completion.index):
            reason = "tool_calls"
        return {"finish_reason": reason, "stop_reason": protocol.stop_reason(completion)}

    def response(self) -> dict[str, Any]:
        """The ``chat.completion`` of every choice, by index."""
        choices = []
        for index in sorted(self.texts):
            end = self.ends.get(index)
            calls = self.calls.get(index)
            message: dict[str, Any] = {"role": "assistant", "content": None if calls else self.texts[index]}
            if index in self.reasoning:
                message["reasoning_content"] = self.reasoning[index]
            if calls:
                message["tool_calls"] = _tool_calls(calls, streamed=False)
            logprobs = {"content": self.logprobs.get(index, [])} if self.params.logprobs is not None else None
            ending = self._ending(end) if end is not None else {"finish_reason": None, "stop_reason": None}
            choices.append({"index": index, "message": message, "logprobs": logprobs} | ending)
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }


def _tool_calls(calls: list[Any], streamed: bool, first: int = 0) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls``: each call's id and function; in a stream's delta, its index too (from ``first``)."""
    result = []
    for index, call in enumerate(calls, start=first):
        entry = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        result.append(({"index": index} | entry) if streamed else entry)
    return result
