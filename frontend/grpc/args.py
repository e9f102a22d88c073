"""The gRPC server's settings, :class:`ServerConfig`, and the ``spindle serve`` flags that set them."""

import argparse
import dataclasses

from spindle.shared.config import add_settings_args


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
        metrics_port: serve Prometheus metrics over HTTP at ``/metrics`` on this port; unset serves none, ``0``
            picks a free port (see :doc:`observability`).
        metrics_host: interface the metrics port listens on (``0.0.0.0`` for a scraper outside the container).
        otlp_traces_endpoint: export a trace span per request over OTLP/gRPC to this collector (e.g.
            ``http://otel-collector:4317``); unset traces nothing and never imports OpenTelemetry.

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
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        for name in ("max_message_bytes", "max_queued_requests", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port} is not a TCP port (0 to 65535)")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per :class:`ServerConfig` field (:func:`~spindle.shared.config.add_settings_args`)."""
    add_settings_args(parser, ServerConfig)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Build the :class:`ServerConfig` from flags added by :func:`add_server_args`."""
    return ServerConfig(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ServerConfig)})
