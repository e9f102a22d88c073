"""A small synchronous client of a Spindle gRPC server, for ``spindle generate`` / ``spindle chat`` and other services.

Example::

    with SpindleClient("localhost:50051") as client:
        for response in client.generate("The capital of France is", max_tokens=16, temperature=0):
            print(response.choices[0].text if response.choices else "", end="", flush=True)
"""

import json
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spindle.v1 import spindle_pb2, spindle_pb2_grpc

# The leading bytes of each image format the server decodes, and its MIME type.
_IMAGE_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)


def image_item(data: bytes) -> spindle_pb2.MultiModalItem:
    """An encoded image as a ``MultiModalItem``, its MIME type read from its leading bytes.

    Raises:
        ValueError: the bytes are not a PNG, JPEG, WebP, GIF or BMP file.

    """
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return spindle_pb2.MultiModalItem(mime_type="image/webp", data=data)
    for signature, mime_type in _IMAGE_SIGNATURES:
        if data.startswith(signature):
            return spindle_pb2.MultiModalItem(mime_type=mime_type, data=data)
    raise ValueError(f"not a PNG, JPEG, WebP, GIF or BMP image: it starts with {bytes(data[:12])!r}")


def _chat_message(message: dict[str, Any]) -> spindle_pb2.ChatMessage:
    """A conversation's message as the proto's: tool calls converted, a list of parts as ``parts``."""
    fields = {**message, "tool_calls": [_tool_call(c) for c in message.get("tool_calls") or []]}
    if isinstance(fields.get("content"), list):
        fields["parts"] = [
            spindle_pb2.ContentPart(image=image_item(part["image"]))
            if part["type"] == "image"
            else spindle_pb2.ContentPart(text=part["text"])
            for part in fields.pop("content")
        ]
    return spindle_pb2.ChatMessage(**fields)


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
        self,
        prompt: str | list[int],
        request_id: str = "",
        *,
        priority: int = 0,
        lora_name: str = "",
        images: Sequence[bytes] = (),
        **params: Any,
    ) -> Iterator[spindle_pb2.GenerateResponse]:
        """Stream a completion of text or token ids; ``params`` are sampling parameter fields.

        ``priority`` orders the request on a server with ``--scheduling-policy priority`` (lower runs first).
        ``lora_name`` names the LoRA adapter to generate with (:meth:`list_lora_adapters`); empty is the base model.
        ``images`` are encoded images (PNG, JPEG, WebP, GIF or BMP files' bytes) for a vision-language model, one for
        each of the prompt's image placeholders (``<image>``), in order.

        Raises:
            ValueError: an image's bytes are of none of those formats.

        """
        message = _prompt(prompt)
        message.multi_modal_data.extend(image_item(data) for data in images)
        request = spindle_pb2.GenerateRequest(
            request_id=request_id,
            prompt=message,
            sampling_params=sampling_params(**params),
            priority=priority,
            lora_name=lora_name,
        )
        return self.stub.Generate(request, timeout=self.timeout, metadata=self.metadata)

    def beam_search(
        self,
        prompt: str | list[int],
        beam_width: int,
        max_tokens: int,
        request_id: str = "",
        *,
        lora_name: str = "",
        **fields: Any,
    ) -> spindle_pb2.GenerateResponse:
        """The ``beam_width`` most likely completions of a prompt, best first, as ``LLM.beam_search`` finds them.

        ``fields`` are the other ``BeamSearchParams`` message fields (``ignore_eos``, ``length_penalty``,
        ``early_stopping``). The server answers with one message, when the search ends, whose choices are the beams.
        """
        search = spindle_pb2.BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, **fields)
        request = spindle_pb2.GenerateRequest(
            request_id=request_id, prompt=_prompt(prompt), beam_search=search, lora_name=lora_name
        )
        (response,) = self.stub.Generate(request, timeout=self.timeout, metadata=self.metadata)
        return response

    def chat(
        self,
        messages: list[dict[str, Any]],
        request_id: str = "",
        *,
        tools: list[dict[str, Any] | spindle_pb2.Tool] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        priority: int = 0,
        lora_name: str = "",
        **params: Any,
    ) -> Iterator[spindle_pb2.GenerateResponse]:
        """Stream the model's reply to a conversation of ``{"role": ..., "content": ...}`` dicts.

        Args:
            messages: the conversation; a message's ``content`` is text, or a list of parts for a vision-language
                model, ``{"type": "text", "text": str}`` and ``{"type": "image", "image": bytes}`` (an encoded image,
                as :meth:`generate` takes them); an assistant turn may carry ``tool_calls`` (``ToolCall`` messages, as
                a response's choices carry them, objects with ``id``, ``name`` and ``arguments``, or dicts in
                OpenAI's form or flat, arguments as JSON text or a dict), a tool turn a ``tool_call_id``.
            request_id: a client-chosen id (for :meth:`abort`); the server makes one when empty.
            tools: functions the model may call: ``Tool`` messages, or dicts in OpenAI's form
                (``{"type": "function", "function": {"name", "description", "parameters"}}``) or bare, the
                parameters a JSON schema as a dict or JSON text.
            tool_choice: ``"auto"``, ``"none"``, ``"required"``, a tool's name, or OpenAI's
                ``{"type": "function", "function": {"name": ...}}``; unset is ``"auto"``.
            priority: the scheduling priority, as in :meth:`generate`.
            lora_name: the LoRA adapter to generate with, as in :meth:`generate`.
            **params: sampling parameter fields.

        """
        request = spindle_pb2.ChatRequest(
            request_id=request_id,
            messages=[_chat_message(m) for m in messages],
            sampling_params=sampling_params(**params),
            tools=[_tool(t) for t in tools or []],
            tool_choice=_tool_choice(tool_choice),
            priority=priority,
            lora_name=lora_name,
        )
        return self.stub.Chat(request, timeout=self.timeout, metadata=self.metadata)

    def embed(
        self,
        inputs: str | list[int] | Sequence[str | list[int]],
        request_id: str = "",
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        priority: int = 0,
    ) -> spindle_pb2.EmbedResponse:
        """The embeddings of one input or a list of them (text, or token ids), in one call.

        Args:
            inputs: a text, a list of token ids, or a list of texts and token-id lists.
            request_id: a client-chosen id; the server makes one when empty.
            pooling: ``"last"``, ``"mean"`` or ``"cls"``; ``None`` is the model's default (``last``).
            normalize: scale each embedding to unit L2 norm; ``None`` is the server's default (on).
            dimensions: keep the first ``dimensions`` values (then normalize); ``None`` keeps them all.
            priority: the scheduling priority, as in :meth:`generate`.

        Returns:
            The ``EmbedResponse`` message, with input ``i``'s embedding in ``embeddings[i].values``.

        Raises:
            ValueError: ``pooling`` is not one of those.

        """
        if pooling not in _POOLING_TYPES:
            raise ValueError(f"pooling={pooling!r} is not one of None, 'last', 'mean', 'cls'")
        batch = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else list(inputs)
        optional = {"normalize": normalize, "dimensions": dimensions}
        pooling_params = spindle_pb2.PoolingParams(
            pooling=_POOLING_TYPES[pooling], **{name: value for name, value in optional.items() if value is not None}
        )
        request = spindle_pb2.EmbedRequest(
            request_id=request_id,
            inputs=[_prompt(item) for item in batch],
            pooling_params=pooling_params,
            priority=priority,
        )
        return self.stub.Embed(request, timeout=self.timeout, metadata=self.metadata)

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

    def watch_load(self, interval: float | None = None) -> Iterator[spindle_pb2.LoadReport]:
        """Stream the server's load reports: one at once, then one on each change and at least every ``interval``.

        Args:
            interval: the most seconds between two reports, from 0.05 to 60; ``None`` is the server's default (1).

        Returns:
            The stream of ``LoadReport`` messages, which lasts until it is cancelled (``cancel()``, or the call's
            deadline) or the server drains.

        """
        request = spindle_pb2.WatchLoadRequest()
        if interval is not None:
            request.interval.FromNanoseconds(round(interval * 1e9))
        return self.stub.WatchLoad(request, timeout=self.timeout, metadata=self.metadata)

    def load_lora_adapter(self, name: str, path: str) -> spindle_pb2.LoraAdapter:
        """Load the LoRA adapter directory ``path`` (relative to the server's ``--lora-dir``) under ``name``.

        The server must run with ``--allow-runtime-lora`` (else ``FAILED_PRECONDITION``); a path outside its adapter
        directory is ``INVALID_ARGUMENT``, a name taken ``ALREADY_EXISTS``.
        """
        request = spindle_pb2.LoadLoraAdapterRequest(name=name, path=path)
        return self.stub.LoadLoraAdapter(request, timeout=self.timeout, metadata=self.metadata).adapter

    def unload_lora_adapter(self, name: str) -> None:
        """Unload the adapter ``name`` (``NOT_FOUND`` when unknown); streams using it finish with it."""
        request = spindle_pb2.UnloadLoraAdapterRequest(name=name)
        self.stub.UnloadLoraAdapter(request, timeout=self.timeout, metadata=self.metadata)

    def list_lora_adapters(self) -> list[spindle_pb2.LoraAdapter]:
        """The adapters requests may name."""
        request = spindle_pb2.ListLoraAdaptersRequest()
        return list(self.stub.ListLoraAdapters(request, timeout=self.timeout, metadata=self.metadata).adapters)

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


def _prompt(prompt: str | list[int]) -> spindle_pb2.Prompt:
    if isinstance(prompt, str):
        return spindle_pb2.Prompt(text=prompt)
    return spindle_pb2.Prompt(token_ids=spindle_pb2.TokenIds(ids=prompt))


def _json_text(value: str | dict[str, Any] | None) -> str:
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def _tool(tool: dict[str, Any] | spindle_pb2.Tool) -> spindle_pb2.Tool:
    if isinstance(tool, spindle_pb2.Tool):
        return tool
    function = tool.get("function", tool)
    return spindle_pb2.Tool(
        name=function["name"],
        description=function.get("description") or "",
        parameters=_json_text(function.get("parameters")),
    )


def _tool_call(call: Any) -> spindle_pb2.ToolCall:
    if not isinstance(call, dict):  # a response's ToolCall message, or the Python API's ToolCall
        return spindle_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
    function = call.get("function", call)
    return spindle_pb2.ToolCall(
        id=call.get("id") or "", name=function["name"], arguments=_json_text(function.get("arguments"))
    )


def _tool_choice(choice: str | dict[str, Any] | None) -> spindle_pb2.ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, dict):
        return spindle_pb2.ToolChoice(function_name=choice.get("function", choice)["name"])
    mode = _TOOL_CHOICE_MODES.get(choice)
    return spindle_pb2.ToolChoice(function_name=choice) if mode is None else spindle_pb2.ToolChoice(mode=mode)


_TOOL_CHOICE_MODES = {
    "auto": spindle_pb2.TOOL_CHOICE_MODE_AUTO,
    "none": spindle_pb2.TOOL_CHOICE_MODE_NONE,
    "required": spindle_pb2.TOOL_CHOICE_MODE_REQUIRED,
}

_POOLING_TYPES = {
    None: spindle_pb2.POOLING_TYPE_UNSPECIFIED,
    "last": spindle_pb2.POOLING_TYPE_LAST,
    "mean": spindle_pb2.POOLING_TYPE_MEAN,
    "cls": spindle_pb2.POOLING_TYPE_CLS,
}
