"""A small synchronous client of a Spindle gRPC server, for ``spindle generate`` / ``spindle chat`` and other services.

Example::

    with SpindleClient("localhost:50051") as client:
        for response in client.generate("The capital of France is", max_tokens=16, temperature=0):
            print(response.choices[0].text if response.choices else "", end="", flush=True)
"""

from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spindle.v1 import spindle_pb2, spindle_pb2_grpc


def sampling_params(**fields: Any) -> spindle_pb2.SamplingParams:
    """Build the ``SamplingParams`` message from ``spindle.SamplingParams`` field names; ``None`` leaves unset."""
    fields = {name: value for name, value in fields.items() if value is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    return spindle_pb2.SamplingParams(**fields)


class SpindleClient:
    """A channel to one server, with one method per RPC.

    Args:
        address: ``host:port`` of the server.
        api_key: sent as ``authorization: Bearer <api_key>`` when given.
        tls_ca: PEM file of the certificate authority to trust; when given the channel uses TLS.
        timeout: default deadline of each call in seconds (``None``: no deadline).

    """

    def __init__(
        self,
        address: str = "localhost:50051",
        api_key: str | None = None,
        tls_ca: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if tls_ca is None:
            self.channel = grpc.insecure_channel(address)
        else:
            with open(tls_ca, "rb") as file:
                self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(file.read()))
        self.stub = spindle_pb2_grpc.SpindleServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout

    def generate(
        self, prompt: str | list[int], request_id: str = "", **params: Any
    ) -> Iterator[spindle_pb2.GenerateResponse]:
        """Stream a completion of text or token ids; ``params`` are sampling parameter fields."""
        message = spindle_pb2.Prompt(text=prompt) if isinstance(prompt, str) else spindle_pb2.Prompt()
        if not isinstance(prompt, str):
            message.token_ids.ids.extend(prompt)
        request = spindle_pb2.GenerateRequest(
            request_id=request_id, prompt=message, sampling_params=sampling_params(**params)
        )
        return self.stub.Generate(request, timeout=self.timeout, metadata=self.metadata)

    def chat(
        self, messages: list[dict[str, str]], request_id: str = "", **params: Any
    ) -> Iterator[spindle_pb2.GenerateResponse]:
        """Stream the model's reply to a conversation of ``{"role": ..., "content": ...}`` dicts."""
        request = spindle_pb2.ChatRequest(
            request_id=request_id,
            messages=[spindle_pb2.ChatMessage(**m) for m in messages],
            sampling_params=sampling_params(**params),
        )
        return self.stub.Chat(request, timeout=self.timeout, metadata=self.metadata)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``."""
        request = spindle_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, timeout=self.timeout, metadata=self.metadata).token_ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids``."""
        request = spindle_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self.stub.Detokenize(request, timeout=self.timeout, metadata=self.metadata).text

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight; whether one had that id."""
        request = spindle_pb2.AbortRequest(request_id=request_id)
        return self.stub.Abort(request, timeout=self.timeout, metadata=self.metadata).aborted

    def model_info(self) -> spindle_pb2.GetModelInfoResponse:
        """What model the server serves."""
        return self.stub.GetModelInfo(spindle_pb2.GetModelInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def server_info(self) -> spindle_pb2.GetServerInfoResponse:
        """The server's version, uptime and load."""
        request = spindle_pb2.GetServerInfoRequest()
        return self.stub.GetServerInfo(request, timeout=self.timeout, metadata=self.metadata)

    def health(self, service: str = "") -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``, ...) of ``service`` (``""``: the whole server)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout or 5.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def __enter__(self) -> "SpindleClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
