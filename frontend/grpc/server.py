"""The gRPC server's life: ``spindle.v1.SpindleService``, health and reflection on one port, then the drain on SIGTERM.

The service itself is :class:`~spindle.frontend.grpc.servicer.SpindleServicer` (with the status code of every
error); this module serves it with the standard health service, server reflection (both ``grpc.reflection.v1`` and
the older ``v1alpha``), the API-key check (``UNAUTHENTICATED``, and ``PERMISSION_DENIED`` for an adapter call without
the admin key), and ``INVALID_ARGUMENT`` for a request message that does not parse (gRPC would answer ``UNKNOWN``).

This module runs in the frontend process and never imports torch.
"""

import asyncio
import contextlib
import hmac
import inspect
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.grpc.admission_control import CallLimit, OverLimitError
from spindle.frontend.grpc.args import ServerConfig
from spindle.frontend.grpc.metrics import MetricsServer
from spindle.frontend.grpc.servicer import SpindleServicer
from spindle.frontend.grpc.vllm_servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from spindle.frontend.grpc.vllm_servicer import VllmEngineServicer
from spindle.shared.gc_heap import freeze_startup_heap
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

if TYPE_CHECKING:
    from spindle.frontend.http.server import HttpServer

logger = logging.getLogger(__name__)

SERVICE_NAME = spindle_pb2.DESCRIPTOR.services_by_name["SpindleService"].full_name
ADMIN_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in ("LoadLoraAdapter", "UnloadLoraAdapter"))
"""The calls that change what every tenant is served: with an API key, only the admin key may make them."""
CONTROL_STREAMS = 32
"""Calls a connection may have open beside its ``max_streams_per_connection`` generations (unary calls, watches,
reflection): past both, a gRPC client waits for one to end before it opens another."""
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
"""Server reflection as grpcurl and current clients ask for it first; ``v1alpha`` is its older, identical twin."""

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _add_reflection_v1_to_pool(pool: descriptor_pool.DescriptorPool) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool``, so that reflection can describe its v1 service too.

    grpcio-reflection ships only the v1alpha proto; v1 is the same file in another package, so it is built from it.
    """
    with contextlib.suppress(KeyError):  # KeyError: not there yet
        pool.FindServiceByName(REFLECTION_V1)
        return  # already there (a v1 reflection_pb2 module is loaded, or a server started before)
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{REFLECTION_V1.rsplit('.', 1)[0]}."
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", new.strip(".")
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.AddSerializedFile(proto.SerializeToString())


def _add_reflection(server: grpc.aio.Server, service_names: tuple[str, ...]) -> None:
    """Serve reflection under both ``grpc.reflection.v1`` and ``v1alpha``, listing ``service_names`` and both.

    The two protos are wire-identical apart from the service's name, so one v1alpha servicer answers both.
    """
    _add_reflection_v1_to_pool(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer((*service_names, REFLECTION_V1, reflection.SERVICE_NAME))
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for service in (REFLECTION_V1, reflection.SERVICE_NAME):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the keys they need; health checks need none.

    With an ``api_key``, every other call needs ``authorization: Bearer <api_key>`` or the admin key
    (``UNAUTHENTICATED``). The :data:`ADMIN_METHODS` need the admin key (``PERMISSION_DENIED``) as soon as either key
    is set: without an admin key, a server with an API key takes none of them.
    """

    def __init__(self, api_key: str | None, admin_api_key: str | None) -> None:
        self.api_key = None if api_key is None else f"Bearer {api_key}".encode()
        self.admin_api_key = None if admin_api_key is None else f"Bearer {admin_api_key}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        admin = self.admin_api_key is not None and hmac.compare_digest(given.encode(), self.admin_api_key)
        if not admin and self.api_key is not None and not hmac.compare_digest(given.encode(), self.api_key):
            reason = "wrong API key" if given else "missing API key"
            return _refusing(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                f"{reason}: send the metadata 'authorization: Bearer <api key>'",
            )
        if details.method in ADMIN_METHODS and not admin:
            if self.admin_api_key is not None:
                return _refusing(
                    handler,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "loading and unloading adapters needs the admin key: send 'authorization: Bearer <admin api key>'",
                )
            return _refusing(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                "this server has an API key but no admin key (--admin-api-key): it loads and unloads no adapters",
            )
        return handler


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler in ``handler``'s shape that ends every call with ``code`` and ``message``."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    factory = _HANDLER_FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(deny, handler.request_deserializer, handler.response_serializer)


class _HealthServicer(health.aio.HealthServicer):
    """The standard health service, whose ``Watch`` streams count against the server's watchers.

    Args:
        watchers: the limit ``WatchLoad`` streams count against too.

    """

    def __init__(self, watchers: CallLimit) -> None:
        super().__init__()
        self.watchers = watchers

    async def Watch(  # noqa: N802 - gRPC method names are CamelCase
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Stream the service's health: now, and on each change; ``RESOURCE_EXHAUSTED`` past the watchers' limit."""
        try:
            with self.watchers.hold():
                await super().Watch(request, context)
        except OverLimitError as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))


class _Unparsable:
    """What a request deserializer returns, instead of raising, for bytes that are not its message."""

    def __init__(self, message: str) -> None:
        self.message = message


class _UnparsableRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers ``INVALID_ARGUMENT`` to a request message that does not parse, where gRPC would say ``UNKNOWN``.

    gRPC ends a call whose deserializer raises with ``UNKNOWN``, before any handler could choose the code. So each
    single-request method gets a deserializer that returns an :class:`_Unparsable` instead, and a behavior that
    aborts the call on it. (Request-streaming methods, reflection's only, are left as they are.)
    """

    def __init__(self) -> None:
        self.wrapped: dict[grpc.RpcMethodHandler, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        if handler not in self.wrapped:
            self.wrapped[handler] = _refusing_unparsable(handler, details.method)
        return self.wrapped[handler]


def _refusing_unparsable(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with a deserializer that cannot raise and a behavior that aborts on what it could not parse."""
    deserializer = handler.request_deserializer
    message_type = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    expected = f"a {message_type.full_name}" if message_type is not None else f"the request message of {method}"

    def parse(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except DecodeError as error:
            return _Unparsable(f"the request does not parse as {expected} ({error}): check what the client sends")

    behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
    if inspect.isasyncgenfunction(behavior):

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(request, context):
                yield response

    elif inspect.iscoroutinefunction(behavior):

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behavior(request, context)

    else:  # a synchronous behavior runs in gRPC's thread pool, where the call cannot be aborted from a coroutine
        return handler
    factory = _HANDLER_FACTORIES[(False, handler.response_streaming)]
    return factory(checked, parse, handler.response_serializer)


class GrpcServer:
    """The gRPC server: Spindle, health and reflection services on one port, and its drain on shutdown.

    Health reports ``SERVING`` while the backend lives (one of them, with data-parallel backends) and the server is
    not draining, ``NOT_SERVING``
    otherwise, both for the whole server (``""``) and for ``spindle.v1.SpindleService``. With ``config.metrics_port``
    it also serves Prometheus metrics over HTTP: its ``metrics`` attribute holds the
    :class:`~spindle.frontend.grpc.metrics.MetricsServer` while the server runs (with ``config.http_port`` too,
    without a port of its own when ``metrics_port`` is unset: the HTTP API's ``/metrics`` serves its registry).
    With ``config.http_port`` it serves the OpenAI-compatible API too, on the same event loop: its ``http``
    attribute holds the ``HttpServer`` of :doc:`http` (whose ``port`` is the bound one) while the server runs.

    Args:
        engine: the engine, connected to its backend (or backends).
        config: where to listen and the limits.

    Raises:
        ValueError: the model's generation config does not make valid request defaults, or its ``max_new_tokens``
            is above ``config.max_tokens_limit``.

    """

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.servicer = SpindleServicer(engine, config)
        self.vllm_servicer = VllmEngineServicer(self.servicer)
        self.health = _HealthServicer(self.servicer.watchers)
        self.port: int | None = None
        self.metrics: MetricsServer | None = None
        self.http: HttpServer | None = None
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_concurrent_streams", config.max_streams_per_connection + CONTROL_STREAMS),
            # gRPC's default SO_REUSEPORT lets another server bind the same port (port 0 may even pick a taken one)
            # and take a share of this one's connections.
            ("grpc.so_reuseport", 0),
        ]
        # The keys are checked first, so a caller without one learns nothing, not even that its message is bad.
        keys = (config.api_key, config.admin_api_key)
        interceptors = [_AuthInterceptor(*keys)] if keys != (None, None) else []
        interceptors.append(_UnparsableRequestInterceptor())
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        self._watcher: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind, start serving and watching the backend; returns the bound port."""
        spindle_pb2_grpc.add_SpindleServiceServicer_to_server(self.servicer, self.server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.vllm_servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        _add_reflection(
            self.server, (SERVICE_NAME, VLLM_SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
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
        self.servicer.load.start()
        config = self.config
        if config.metrics_port is not None or config.http_port is not None:
            self.metrics = MetricsServer(self.engine, self.servicer.load, config.metrics_host, config.metrics_port)
        await self.server.start()
        if config.http_port is not None:
            # Imported here: only a server with an HTTP port needs the ASGI stack.
            import prometheus_client

            from spindle.frontend.http.server import HttpServer

            registry = self.metrics.registry
            self.http = HttpServer(
                self.servicer, lambda: prometheus_client.generate_latest(registry), config.http_host, config.http_port
            )
            await self.http.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watcher = asyncio.get_running_loop().create_task(self._watch_backend())
        logger.info("Serving %s on %s:%d", self.servicer.served_model_names[0], self.config.host, self.port)
        return self.port

    async def drain(self) -> None:
        """Report NOT_SERVING, refuse new streams, let those in flight finish for ``grace_period`` s, then stop."""
        control = self.servicer.admission_control
        control.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        logger.info("Draining %d streams for up to %.0f s", control.num_streams, self.config.grace_period)
        try:
            await asyncio.wait_for(control.streams_done.wait(), self.config.grace_period)
        except TimeoutError:
            logger.warning("Streams still running after the grace period are cancelled")
        await self.stop()

    async def stop(self, grace: float = 0.5) -> None:
        """Stop serving at once (streams in flight are cancelled, which aborts them in the backend)."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.http is not None:
            await self.http.stop()
            self.http = None
        await self.server.stop(grace)
        await self.servicer.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME, VLLM_SERVICE_NAME):
            await self.health.set(service, status)

    async def _watch_backend(self) -> None:
        """NOT_SERVING while the backend is down, SERVING again once the engine has brought one back."""
        serving = True
        while True:
            await asyncio.sleep(0.1)
            up = not self.engine.is_dead
            if up == serving or self.servicer.admission_control.draining:  # a drain's NOT_SERVING stays
                continue
            serving = up
            if up:
                logger.info("The model backend is back: reporting SERVING")
                await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            else:
                logger.error("The model backend is down: reporting NOT_SERVING until it is back")
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve(engine: AsyncLLMEngine, config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see :meth:`GrpcServer.drain`).

    Raises:
        SystemExit: (status 2, the message on stderr) the server's settings do not fit the model, such as a bad value
            in its ``generation_config.json``.

    """
    try:
        server = GrpcServer(engine, config)
    except ValueError as error:  # what only the backend's handshake could show; other bad flags fail before it
        print(f"spindle serve: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    await server.start()
    freeze_startup_heap()
    print(f"spindle: serving {server.servicer.served_model_names[0]} on {config.host}:{server.port}", flush=True)
    if server.http is not None:
        print(f"spindle: OpenAI-compatible API on http://{config.http_host}:{server.http.port}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.drain()
