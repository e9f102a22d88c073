"""The gRPC server's settings, :class:`ServerConfig`, and the ``spindle serve`` flags that set them."""

import argparse
import dataclasses

from spindle.frontend.processing.generation_config import default_sampling_params, parse_override
from spindle.frontend.processing.tokenizer import load_chat_template
from spindle.shared.config import add_settings_args
from spindle.shared.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_SPECULATIVE_TOKENS,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

CEILINGS = {
    "max_stop_strings": MAX_STOP_STRINGS,
    "max_stop_string_length": MAX_STOP_STRING_LENGTH,
    "max_stop_token_ids": MAX_STOP_TOKEN_IDS,
    "max_logit_bias": MAX_LOGIT_BIAS,
}
"""The per-request limits a server may lower, each with the ceiling ``SamplingParams`` sets for every caller."""


@dataclasses.dataclass
class ServerConfig:
    """How the gRPC server listens and what it accepts.

    Attributes:
        host: interface to listen on (``0.0.0.0`` in a container).
        port: TCP port; ``0`` picks a free one (:meth:`GrpcServer.start` returns it).
        api_key: when set, every call but health checks needs ``authorization: Bearer <api_key>`` metadata (or the
            admin key); an empty key is refused, never taken for "no key".
        admin_api_key: the key that ``LoadLoraAdapter`` and ``UnloadLoraAdapter`` need (``authorization: Bearer
            <admin_api_key>``), which every other call takes too. Unset, those two calls are refused
            (``PERMISSION_DENIED``) on a server with an ``api_key``, and open on a server without one.
        tls_cert: PEM certificate chain file; with ``tls_key``, the server speaks TLS only.
        tls_key: PEM private key file.
        max_message_bytes: largest request or response message.
        max_queued_requests: most requests accepted but not yet streaming (waiting for the backend to schedule
            them), each input of an ``Embed`` call one; one more is refused with ``RESOURCE_EXHAUSTED``.
        max_embed_inputs: most inputs of one ``Embed`` call (256); more is ``INVALID_ARGUMENT``. A call can never
            hold more than ``max_queued_requests`` inputs anyway, as each one waits in the queue.
        max_streams_per_connection: most ``Generate``, ``Chat`` and ``Embed`` calls one client connection may have
            open at once (128, as nginx allows per HTTP/2 connection); one more is refused with
            ``RESOURCE_EXHAUSTED``, so that one client cannot fill the queue alone.
        max_watchers: most ``WatchLoad`` and health ``Watch`` streams open at once, over all clients (256); one
            more is refused with ``RESOURCE_EXHAUSTED``.
        tokenizer_threads: threads that run ``Tokenize`` and ``Detokenize`` off the event loop, so that a long one
            stalls no stream (4); calls beyond them wait, and beyond ``max_queued_requests`` waiting are refused
            with ``RESOURCE_EXHAUSTED``.
        max_unread_outputs: outputs a stream may hold for a client that does not read them (256); the stream
            stops taking outputs from the engine while that many wait.
        unread_timeout: seconds a stream may stay full (``max_unread_outputs`` unread) before its request is
            aborted in the backend, freeing its KV cache (60).
        max_n: largest ``n`` (completions per request).
        max_tokens_limit: largest ``max_tokens``; ``0`` allows up to the model's context length.
        max_stop_strings: most stop strings per request; at most
            :data:`~spindle.shared.sampling_params.MAX_STOP_STRINGS`, which ``SamplingParams`` allows anyone.
        max_stop_string_length: longest stop string, in characters; at most
            :data:`~spindle.shared.sampling_params.MAX_STOP_STRING_LENGTH`.
        max_stop_token_ids: most stop token ids per request; at most
            :data:`~spindle.shared.sampling_params.MAX_STOP_TOKEN_IDS`.
        max_logit_bias: most ``logit_bias`` entries per request; at most
            :data:`~spindle.shared.sampling_params.MAX_LOGIT_BIAS`.
        grace_period: seconds that streams in flight may take to finish after SIGTERM.
        metrics_port: serve Prometheus metrics over HTTP at ``/metrics`` on this port; unset serves none, ``0``
            picks a free port (see :doc:`observability`).
        metrics_host: interface the metrics port listens on (``0.0.0.0`` for a scraper outside the container).
        http_port: serve the OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``, ...) on this
            port, beside gRPC, with the same key and limits; unset serves none, ``0`` picks a free port (see
            :doc:`http`).
        http_host: interface the HTTP API listens on (``0.0.0.0`` in a container).
        otlp_traces_endpoint: export a trace span per request over OTLP/gRPC to this collector (e.g.
            ``http://otel-collector:4317``); unset traces nothing and never imports OpenTelemetry.
        served_model_name: the names the server answers to, as vLLM's flag: ``GetModelInfo`` reports the first, and
            an HTTP request's ``model`` must be one of them (or a LoRA adapter's name); unset, the model's name.
        chat_template: a chat template to use instead of the model's: a file, or the jinja2 text itself (a value
            that names no file, as in vLLM).
        generation_config: where the defaults of requests that leave ``temperature``, ``top_p``, ``top_k``,
            ``min_p``, ``repetition_penalty`` or ``max_tokens`` unset come from: ``auto`` (the model's
            ``generation_config.json``, its ``max_new_tokens`` as ``max_tokens``), ``vllm`` (none: Spindle's own
            defaults) or a directory holding a ``generation_config.json``.
        override_generation_config: a JSON object of ``generation_config.json`` fields that replace those the
            generation config gives, e.g. ``'{"temperature": 0.5}'``.
        num_speculative_tokens: the ``num_speculative_tokens`` of requests that leave it unset (prompt-lookup
            speculation, exact): ``0`` speculates for no request that does not ask for it.

    """

    host: str = "127.0.0.1"
    port: int = 50051
    api_key: str | None = None
    admin_api_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = 4 * 2**20
    max_queued_requests: int = 256
    max_embed_inputs: int = 256
    max_streams_per_connection: int = 128
    max_watchers: int = 256
    tokenizer_threads: int = 4
    max_unread_outputs: int = 256
    unread_timeout: float = 60.0
    max_n: int = 16
    max_tokens_limit: int = 0
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_length: int = MAX_STOP_STRING_LENGTH
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_logit_bias: int = MAX_LOGIT_BIAS
    grace_period: float = 30.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    otlp_traces_endpoint: str | None = None
    served_model_name: list[str] | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    override_generation_config: str | None = None
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) == "":  # e.g. SPINDLE_API_KEY set from a missing secret: never serve open
                flag, variable = "--" + name.replace("_", "-"), "SPINDLE_" + name.upper()
                raise ValueError(f"{flag} (or {variable}) is set but empty: give the key, or unset it")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("--admin-api-key must differ from --api-key, or every client would be an admin")
        for name in (
            "max_message_bytes",
            "max_queued_requests",
            "max_n",
            "max_embed_inputs",
            "max_streams_per_connection",
            "max_watchers",
            "tokenizer_threads",
            "max_unread_outputs",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name, ceiling in CEILINGS.items():
            if not 1 <= getattr(self, name) <= ceiling:
                raise ValueError(f"{name}={getattr(self, name)} must be in [1, {ceiling}] (SamplingParams' own limit)")
        if self.unread_timeout <= 0:
            raise ValueError(f"unread_timeout={self.unread_timeout} must be > 0")
        for name in ("metrics_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} is not a TCP port (0 to 65535)")
        names = self.served_model_name
        if names is not None and not (names and all(name.strip() for name in names)):
            raise ValueError(f"served_model_name={self.served_model_name} must be one or more non-empty names")
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)  # the text from here on
        # The model's own file comes with the backend's handshake; the override and a directory are checked now.
        default_sampling_params(self.generation_config, {}, parse_override(self.override_generation_config))
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be in [0, {MAX_SPECULATIVE_TOKENS}]"
            )


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per :class:`ServerConfig` field (:func:`~spindle.shared.config.add_settings_args`)."""
    add_settings_args(parser, ServerConfig)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the :class:`ServerConfig` from flags added by :func:`add_server_args`."""
    return ServerConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ServerConfig)})
