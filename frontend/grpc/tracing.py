"""OpenTelemetry tracing of requests: one ``llm_request`` span per ``Generate`` or ``Chat`` call.

With ``--otlp-traces-endpoint`` (vLLM's flag) the gRPC server exports a span per request over OTLP/gRPC. The span
is a child of the caller's when the call carries W3C trace context (``traceparent`` and ``tracestate`` metadata),
so the request shows up inside the trace of whatever sent it. Its attributes follow vLLM's ``gen_ai.*`` names
(:data:`SPAN_ATTRIBUTES`), and its events mark the request's life: ``queued`` (arrival), ``first_scheduled``,
``first_token`` and ``finished``, each at the time it happened.

OpenTelemetry is an optional dependency (``pip install 'spindle-serve[tracing]'``) imported only when a
:class:`RequestTracer` is made, so a server without the flag never loads it. The exporter takes OpenTelemetry's
standard variables too: ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE``,
``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME`` (default ``spindle``), ...
"""

import os
from collections.abc import Iterable
from typing import Any

import grpc

from spindle.shared import RequestOutput, SamplingParams

SPAN_NAME = "llm_request"
"""The name of a request's span, as vLLM names it."""

SPAN_ATTRIBUTES = {
    "gen_ai.request.id": "the request id",
    "gen_ai.response.model": "the served model's name",
    "gen_ai.request.max_tokens": "``max_tokens`` (when set)",
    "gen_ai.request.temperature": "``temperature``",
    "gen_ai.request.top_p": "``top_p``",
    "gen_ai.request.top_k": "``top_k`` (when it limits)",
    "gen_ai.request.n": "``n``, the number of completions",
    "gen_ai.usage.prompt_tokens": "prompt tokens",
    "gen_ai.usage.completion_tokens": "tokens generated, over all completions",
    "gen_ai.usage.cached_tokens": "prompt tokens whose K/V came from the prefix cache",
    "gen_ai.response.finish_reasons": "each completion's finish reason: ``stop``, ``length`` or ``abort``",
    "gen_ai.latency.time_in_queue": "seconds from arrival to first scheduling",
    "gen_ai.latency.time_to_first_token": "seconds from arrival to the first token",
    "gen_ai.latency.e2e": "seconds from arrival to the end",
    "gen_ai.latency.time_in_model_prefill": "seconds from first scheduling to the first token",
    "gen_ai.latency.time_in_model_decode": "seconds from the first token to the end",
    "gen_ai.latency.time_in_model_inference": "seconds from first scheduling to the end",
    "rpc.method": "``Generate`` or ``Chat``",
    "rpc.grpc.status_code": "the call's gRPC status code (0 is OK)",
}
"""The attributes of a request's span and what they hold; each is set when known (a refused request has few)."""

_ERROR_CODES = {
    code.value[0]
    for code in (
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    )
}
"""The codes that mark a server span as failed (OpenTelemetry's gRPC conventions): the server's fault, not the
caller's, so a bad request or a cancelled call is no error of ours."""


class RequestTracer:
    """Starts the span of each request and hands the finished spans to an exporter.

    It owns a tracer provider of its own rather than installing the global one, so that a process can hold several
    servers (tests do) and an application embedding the server keeps its own tracing set-up.

    Args:
        exporter: an OpenTelemetry ``SpanExporter``: OTLP for ``--otlp-traces-endpoint`` (:meth:`otlp`), an
            in-memory one in tests.
        batch: export from a background thread in batches (``False``: synchronously as each span ends).

    """

    def __init__(self, exporter: Any, batch: bool = True) -> None:
        # Imported here, not at the top: a server without tracing must never load OpenTelemetry.
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", "spindle")})
        # The sampler comes from OTEL_TRACES_SAMPLER; the default follows the caller's sampling decision.
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("spindle.frontend")
        self.propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER

    @classmethod
    def otlp(cls, endpoint: str) -> "RequestTracer":
        """A tracer that exports over OTLP/gRPC to ``endpoint`` (``http://`` is plaintext, ``https://`` TLS)."""
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint))

    def start(
        self, request_id: str, metadata: Iterable[tuple[str, str | bytes]], model: str, method: str
    ) -> "RequestSpan":
        """Start the span of request ``request_id``, under the trace context that the call's ``metadata`` carries."""
        carrier = {key: value for key, value in metadata if isinstance(value, str)}
        span = self.tracer.start_span(
            SPAN_NAME,
            context=self.propagator.extract(carrier),
            kind=self._server_kind,
            attributes={
                "gen_ai.request.id": request_id,
                "gen_ai.response.model": model,
                "rpc.method": method,
                "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
            },
        )
        return RequestSpan(span)

    def shutdown(self) -> None:
        """Export the spans still buffered, then stop."""
        self.provider.shutdown()


class RequestSpan:
    """The span of one request: filled in as the request goes, ended once by :meth:`end`.

    Args:
        span: the OpenTelemetry span, started.

    """

    def __init__(self, span: Any) -> None:
        self.span = span
        self.output: RequestOutput | None = None
        self.completion_tokens = 0

    def set_params(self, params: SamplingParams) -> None:
        """Record the request's sampling parameters."""
        attributes = {"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p}
        attributes["gen_ai.request.n"] = params.n
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.top_k > 0:
            attributes["gen_ai.request.top_k"] = params.top_k
        self.span.set_attributes(attributes)

    def record(self, output: RequestOutput, completion_tokens: int) -> None:
        """Keep the request's latest output and its tokens so far, for :meth:`end`."""
        self.output = output
        self.completion_tokens = completion_tokens

    def set_status(self, code: int, message: str) -> None:
        """Record the gRPC status code (a number) that ended the call; the server's own failures mark an error."""
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attribute("rpc.grpc.status_code", code)
        if code in _ERROR_CODES:
            self.span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        """Add the request's usage, latencies and timing events, then end the span (now)."""
        span, output = self.span, self.output
        if output is not None:
            metrics = output.metrics
            arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
            first_token, finished = metrics.first_token_time, metrics.finished_time
            for name, moment in (
                ("queued", arrival),
                ("first_scheduled", scheduled),
                ("first_token", first_token),
                ("finished", finished),
            ):
                if moment is not None:
                    span.add_event(name, timestamp=int(moment * 1e9))
            attributes: dict[str, Any] = {
                "gen_ai.usage.prompt_tokens": len(output.prompt_token_ids),
                "gen_ai.usage.completion_tokens": self.completion_tokens,
                "gen_ai.usage.cached_tokens": output.num_cached_tokens,
                "gen_ai.response.finish_reasons": [str(c.finish_reason or "abort") for c in output.outputs],
            }
            for name, since, until in (
                ("time_in_queue", arrival, scheduled),
                ("time_to_first_token", arrival, first_token),
                ("e2e", arrival, finished),
                ("time_in_model_prefill", scheduled, first_token),
                ("time_in_model_decode", first_token, finished),
                ("time_in_model_inference", scheduled, finished),
            ):
                if since is not None and until is not None:
                    attributes[f"gen_ai.latency.{name}"] = max(0.0, until - since)
            span.set_attributes(attributes)
        span.end()
