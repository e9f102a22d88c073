"""Between ``spindle.v1`` messages and the engine's types: requests in, response messages out.

Nothing here knows the server's limits or status codes; a value the engine cannot take raises
:class:`~spindle.shared.errors.InvalidRequestError` naming its field, as everywhere else.
"""

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from spindle.frontend.processing.input_processor import refer_to_input
from spindle.frontend.processing.tools import MAX_PARAMETERS_DEPTH
from spindle.shared import (
    CompletionOutput,
    EmbeddingRequestOutput,
    FinishReason,
    Logprob,
    PoolingParams,
    PromptInputs,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from spindle.shared.beam_search import BeamSearchParams
from spindle.shared.errors import InvalidRequestError
from spindle.shared.json_depth import check_json_text, load_json_text
from spindle.shared.lora import LoraAdapterInfo, LoRARequest
from spindle.shared.sampling_params import LogitsProcessorSpec, StructuredOutput
from spindle.v1 import spindle_pb2

_FINISH_REASONS = {
    FinishReason.STOP: spindle_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: spindle_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: spindle_pb2.FINISH_REASON_ABORT,
}
"""The engine's finish reasons as the proto enum."""

_TOOL_CHOICE_MODES = {
    spindle_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: "auto",
    spindle_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    spindle_pb2.TOOL_CHOICE_MODE_NONE: "none",
    spindle_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}
"""The proto's tool choice modes as the engine takes them."""


def _proto_value(message: Any, field: FieldDescriptor) -> tuple[bool, Any]:
    """Whether the field was given, and its value as a Python keyword argument takes it.

    A field without presence is given when it is not empty or zero (zero is the SamplingParams default of each).
    """
    value = getattr(message, field.name)
    if field.has_presence:  # proto3 ``optional``: unset means the default, not zero
        return message.HasField(field.name), value
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return bool(value), dict(value)
    if field.is_repeated:
        return bool(value), list(value)
    return value != field.default_value, value


def sampling_params_from_proto(
    message: spindle_pb2.SamplingParams, defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """Build (and so validate) :class:`~spindle.shared.SamplingParams` from every field of the proto message.

    The fields are read from the message's descriptor, so a field added to the proto reaches the SamplingParams
    attribute of the same name (a test checks that each one has one): an ``optional`` field when it is set, any
    other when it is not empty or zero. A field the message leaves out takes its value in ``defaults`` (the server's,
    from the model's generation config: :mod:`~spindle.frontend.processing.generation_config`), or else the
    SamplingParams default. So ``top_k`` and ``min_p``, which have no presence, cannot be set to 0 under a server
    default (``top_k=-1`` keeps every token too).

    Raises:
        InvalidRequestError: a value is out of range (the field is ``sampling_params.<name>``).

    """
    kwargs = dict(defaults or {})
    for field in message.DESCRIPTOR.fields:
        given, value = _proto_value(message, field)
        if given:
            kwargs[field.name] = value
    if "structured_output" in kwargs:
        kwargs["structured_output"] = structured_output_from_proto(message.structured_output)
    if message.logits_processors:
        kwargs["logits_processors"] = [logits_processor_from_proto(m) for m in message.logits_processors]
    return SamplingParams(**kwargs)


_EARLY_STOPPING: dict[int, bool | str] = {
    spindle_pb2.EARLY_STOPPING_UNSPECIFIED: False,
    spindle_pb2.EARLY_STOPPING_HEURISTIC: False,
    spindle_pb2.EARLY_STOPPING_FIRST_FINISHED: True,
    spindle_pb2.EARLY_STOPPING_NEVER: "never",
}
"""The proto's early stopping rules as :class:`~spindle.shared.beam_search.BeamSearchParams` takes them."""


def beam_search_params_from_proto(message: spindle_pb2.BeamSearchParams) -> BeamSearchParams:
    """Build (and so validate) :class:`~spindle.shared.beam_search.BeamSearchParams` from the message.

    Raises:
        InvalidRequestError: a value is out of range (the field is ``beam_search_params.<name>``).

    """
    return BeamSearchParams(
        beam_width=message.beam_width,
        max_tokens=message.max_tokens,
        ignore_eos=message.ignore_eos,
        length_penalty=message.length_penalty if message.HasField("length_penalty") else 1.0,
        early_stopping=_EARLY_STOPPING.get(message.early_stopping, False),
    )


def logits_processor_from_proto(message: spindle_pb2.LogitsProcessor) -> LogitsProcessorSpec:
    """The :class:`~spindle.shared.sampling_params.LogitsProcessorSpec` of the message, its JSON arguments parsed.

    Raises:
        InvalidRequestError: the arguments are not a JSON object (field ``sampling_params.logits_processors``).

    """
    field = "sampling_params.logits_processors"
    args = load_json_text(message.args_json, field, "args_json") if message.args_json else {}
    if not isinstance(args, dict):
        raise InvalidRequestError(field, f"args_json must be a JSON object, not {type(args).__name__}")
    return LogitsProcessorSpec(name=message.name, args=args)


def structured_output_from_proto(message: spindle_pb2.StructuredOutput) -> StructuredOutput:
    """The :class:`~spindle.shared.sampling_params.StructuredOutput` of the message's one ``kind``.

    Raises:
        InvalidRequestError: no kind is set, or ``json_object`` is false.

    """
    field = "sampling_params.structured_output"
    close = message.close_at_max_tokens if message.HasField("close_at_max_tokens") else True
    match message.WhichOneof("kind"):
        case None:
            raise InvalidRequestError(
                field, f"{field} is empty: set one of json_schema, json_object, regex, grammar, choice, structural_tag"
            )
        case "json_object" if not message.json_object:
            raise InvalidRequestError(f"{field}.json_object", "json_object must be true when set")
        case "choice":
            return StructuredOutput(choice=list(message.choice.choices), close_at_max_tokens=close)
        case kind:
            return StructuredOutput(**{kind: getattr(message, kind)}, close_at_max_tokens=close)


def prompt_inputs_from_proto(prompt: spindle_pb2.Prompt) -> PromptInputs:
    """The :data:`~spindle.shared.PromptInputs` of a ``Prompt`` message (text or token ids, and any images).

    The images of ``prompt.multi_modal_data`` become ``multi_modal_data={"image": [bytes, ...]}``, in order.

    Raises:
        InvalidRequestError: neither ``prompt.text`` nor ``prompt.token_ids`` is set, or an item of
            ``prompt.multi_modal_data`` is not an image (``prompt.multi_modal_data[i]``).

    """
    kind = prompt.WhichOneof("input")
    if kind is None:
        raise InvalidRequestError("prompt", "the prompt is empty: set prompt.text, prompt.token_ids or prompt.embeds")
    if kind == "embeds":
        return {"prompt_embeds": _embeds_array(prompt.embeds)}
    inputs: dict[str, Any] = (
        {"prompt": prompt.text} if kind == "text" else {"prompt_token_ids": list(prompt.token_ids.ids)}
    )
    if prompt.multi_modal_data:
        images = [
            _image_bytes(item, f"prompt.multi_modal_data[{index}]")
            for index, item in enumerate(prompt.multi_modal_data)
        ]
        inputs["multi_modal_data"] = {"image": images}
    return inputs


def _embeds_array(embeds: spindle_pb2.PromptEmbeds) -> np.ndarray:
    """A ``PromptEmbeds`` message's values as a ``[tokens, hidden_size]`` float32 array.

    Raises:
        InvalidRequestError: the shape is not two positive sizes, or the data is not that many float32 values.

    """
    shape = list(embeds.shape)
    if len(shape) != 2 or min(shape) < 1 or len(embeds.data) != 4 * shape[0] * shape[1]:
        raise InvalidRequestError(
            "prompt.embeds",
            f"prompt.embeds has shape {shape} and {len(embeds.data)} bytes: it needs [tokens, hidden_size] and "
            "4 bytes (little-endian float32) per value",
        )
    return np.frombuffer(embeds.data, dtype="<f4").reshape(shape)


def _image_bytes(item: spindle_pb2.MultiModalItem, field: str) -> bytes:
    """The encoded image of a ``MultiModalItem``; raises naming ``field`` when its MIME type is not ``image/*``."""
    if not item.mime_type.lower().startswith("image/"):
        raise InvalidRequestError(
            field, f"{field} has mime_type {item.mime_type!r}: only images (image/png, image/jpeg, ...) are taken"
        )
    return item.data


def messages_from_proto(request: spindle_pb2.ChatRequest) -> list[dict[str, Any]]:
    """A ``ChatRequest``'s conversation as the engine takes it: tool calls in OpenAI's form, arguments as JSON text.

    A message's ``parts`` become its content, a list of ``{"type": "text", "text"}`` and ``{"type": "image",
    "image": bytes}`` parts.

    Raises:
        InvalidRequestError: a message has both ``content`` and ``parts`` (``messages[i].content``), or a part is
            empty or an image with another MIME type than ``image/*`` (``messages[i].parts[j]``).

    """
    messages = []
    for index, message in enumerate(request.messages):
        converted: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.parts:
            if message.content:
                raise InvalidRequestError(
                    f"messages[{index}].content",
                    f"messages[{index}] has both content and parts: put its text in a text part, or send no parts",
                )
            converted["content"] = [
                _content_part(part, f"messages[{index}].parts[{number}]") for number, part in enumerate(message.parts)
            ]
        if message.tool_calls:
            converted["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            converted["tool_call_id"] = message.tool_call_id
        messages.append(converted)
    return messages


def _content_part(part: spindle_pb2.ContentPart, field: str) -> dict[str, Any]:
    """A ``ContentPart`` as a chat message's content part; raises naming ``field`` for an empty or non-image one."""
    match part.WhichOneof("part"):
        case "text":
            return {"type": "text", "text": part.text}
        case "image":
            return {"type": "image", "image": _image_bytes(part.image, field)}
        case _:
            raise InvalidRequestError(field, f"{field} is empty: set its text or its image")


def tools_from_proto(request: spindle_pb2.ChatRequest) -> list[dict[str, Any]] | None:
    """A ``ChatRequest``'s tools in OpenAI's form, their parameters decoded; ``None`` when it has none.

    Raises:
        InvalidRequestError: a tool's parameters are not JSON, or nest deeper than
            :data:`~spindle.frontend.processing.tools.MAX_PARAMETERS_DEPTH` levels (``tools[i].parameters``).

    """
    tools = []
    for index, tool in enumerate(request.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters.strip():
            check_json_text(tool.parameters, f"tools[{index}].parameters", MAX_PARAMETERS_DEPTH)
            try:
                function["parameters"] = json.loads(tool.parameters)
            except ValueError as error:
                raise InvalidRequestError(
                    f"tools[{index}].parameters", f"tools[{index}].parameters is not JSON: {error}"
                ) from error
        tools.append({"type": "function", "function": function})
    return tools or None


def tool_choice_from_proto(request: spindle_pb2.ChatRequest) -> str | dict[str, Any]:
    """A ``ChatRequest``'s tool choice: ``"auto"`` (also when unset), ``"none"``, ``"required"`` or a named tool.

    Raises:
        InvalidRequestError: the mode is not one of the enum's values (``tool_choice.mode``).

    """
    choice = request.tool_choice
    match choice.WhichOneof("choice"):
        case "function_name":
            # The dict form, so that a tool named "auto" or "none" is not taken for a mode.
            return {"type": "function", "function": {"name": choice.function_name}}
        case "mode" if choice.mode not in _TOOL_CHOICE_MODES:
            raise InvalidRequestError("tool_choice.mode", f"tool_choice.mode={choice.mode} is not a ToolChoiceMode")
        case "mode":
            return _TOOL_CHOICE_MODES[choice.mode]
        case _:
            return "auto"


def lora_request_from_proto(request: spindle_pb2.GenerateRequest | spindle_pb2.ChatRequest) -> LoRARequest | None:
    """The adapter a request names in ``lora_name``: by name only (a caller never gives a path here); empty is none.

    Raises:
        InvalidRequestError: ``lora_name`` is only whitespace.

    """
    return LoRARequest(request.lora_name) if request.lora_name else None


def lora_adapter_to_proto(adapter: LoraAdapterInfo) -> spindle_pb2.LoraAdapter:
    """The ``LoraAdapter`` message describing a loaded adapter."""
    return spindle_pb2.LoraAdapter(
        name=adapter.name, path=adapter.path, rank=adapter.rank, target_modules=adapter.target_modules
    )


def _position_logprobs(logprobs: dict[int, Logprob] | None) -> spindle_pb2.PositionLogprobs:
    return spindle_pb2.PositionLogprobs(
        tokens=[
            spindle_pb2.TokenLogprob(token_id=token_id, logprob=lp.logprob, rank=lp.rank or 0, text=lp.decoded_token)
            for token_id, lp in (logprobs or {}).items()
        ]
    )


def _completion_delta(completion: CompletionOutput, finish_reason: FinishReason | None) -> spindle_pb2.CompletionDelta:
    delta = spindle_pb2.CompletionDelta(
        index=completion.index,
        text=completion.text,
        token_ids=completion.token_ids,
        logprobs=[_position_logprobs(lp) for lp in completion.logprobs or []],
        finish_reason=_FINISH_REASONS.get(finish_reason, spindle_pb2.FINISH_REASON_UNSPECIFIED),
    )
    if completion.cumulative_logprob is not None:
        delta.cumulative_logprob = completion.cumulative_logprob
    if completion.reasoning_content is not None:
        delta.reasoning_content = completion.reasoning_content
    if finish_reason is not None and isinstance(completion.stop_reason, str):
        delta.stop_string = completion.stop_reason
    elif finish_reason is not None and isinstance(completion.stop_reason, int):
        delta.stop_token_id = completion.stop_reason
    delta.tool_calls.extend(  # each call in the message where it is whole
        spindle_pb2.ToolCall(id=call.id, name=call.name, arguments=call.arguments)
        for call in completion.tool_calls or []
    )
    return delta


class ResponseBuilder:
    """Turns one request's delta-mode ``RequestOutput`` stream into ``GenerateResponse`` messages.

    Each finished completion's end is reported once (finished completions keep appearing in later outputs), the
    prompt log-probabilities once, and the usage with the last message.
    """

    def __init__(self) -> None:
        self.reported_finished: set[int] = set()
        self.completion_tokens = 0
        self.sent_prompt_logprobs = False

    def build(self, output: RequestOutput) -> spindle_pb2.GenerateResponse:
        """The message for one delta-mode output of the request."""
        response = spindle_pb2.GenerateResponse(request_id=output.request_id, finished=output.finished)
        for completion in output.outputs:
            finish = completion.finish_reason if completion.index not in self.reported_finished else None
            if completion.token_ids or completion.text or completion.reasoning_content or finish is not None:
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
            response.timings.CopyFrom(request_timings(output.metrics))
        return response


def request_timings(metrics: RequestMetrics) -> spindle_pb2.RequestTimings:
    """A finished request's :class:`~spindle.shared.RequestMetrics` as the seconds each part of its life took.

    A request that ended before it was scheduled or gave a token (aborted, refused) has zeros for what it did not
    reach.
    """
    arrival = metrics.arrival_time
    finished = metrics.finished_time if metrics.finished_time is not None else arrival
    scheduled, first_token = metrics.first_scheduled_time, metrics.first_token_time
    return spindle_pb2.RequestTimings(
        arrival_time=arrival,
        queue_seconds=max(0.0, scheduled - arrival) if scheduled is not None else 0.0,
        time_to_first_token_seconds=first_token - arrival if first_token is not None else 0.0,
        decode_seconds=finished - first_token if first_token is not None else 0.0,
        total_seconds=finished - arrival,
    )


_POOLING_TYPES = {
    spindle_pb2.POOLING_TYPE_UNSPECIFIED: None,
    spindle_pb2.POOLING_TYPE_LAST: "last",
    spindle_pb2.POOLING_TYPE_MEAN: "mean",
    spindle_pb2.POOLING_TYPE_CLS: "cls",
}
"""The proto's pooling types as :class:`~spindle.shared.PoolingParams` takes them (unspecified: the model's)."""


def embed_inputs_from_proto(request: spindle_pb2.EmbedRequest) -> list[PromptInputs]:
    """The :data:`~spindle.shared.PromptInputs` of each of an ``EmbedRequest``'s inputs, in order.

    Raises:
        InvalidRequestError: there are no inputs (``inputs``), or one is empty (``inputs[i]``).

    """
    if not request.inputs:
        raise InvalidRequestError("inputs", "the request has no inputs: give at least one prompt to embed")
    inputs = []
    for index, prompt in enumerate(request.inputs):
        try:
            inputs.append(prompt_inputs_from_proto(prompt))
        except InvalidRequestError as error:
            raise refer_to_input(error, index) from None
    return inputs


def pooling_params_from_proto(message: spindle_pb2.PoolingParams) -> PoolingParams:
    """Build (and so validate) :class:`~spindle.shared.PoolingParams`; unset fields keep their defaults.

    Raises:
        InvalidRequestError: the pooling type is not one of the enum's values, or ``dimensions`` is below 1
            (``pooling_params.<name>``).

    """
    if message.pooling not in _POOLING_TYPES:
        raise InvalidRequestError(
            "pooling_params.pooling", f"pooling_params.pooling={message.pooling} is not a PoolingType"
        )
    kwargs: dict[str, Any] = {"pooling": _POOLING_TYPES[message.pooling]}
    for name in ("normalize", "dimensions"):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    return PoolingParams(**kwargs)


def embed_response(request_id: str, outputs: list[EmbeddingRequestOutput]) -> spindle_pb2.EmbedResponse:
    """The ``EmbedResponse`` of an ``Embed`` call: the embeddings in input order and the prompt tokens they took."""
    embeddings = [
        spindle_pb2.Embedding(values=output.outputs.embedding, prompt_tokens=len(output.prompt_token_ids))
        for output in outputs
    ]
    usage = spindle_pb2.Usage(
        prompt_tokens=sum(e.prompt_tokens for e in embeddings),
        cached_tokens=sum(output.num_cached_tokens for output in outputs),
    )
    return spindle_pb2.EmbedResponse(request_id=request_id, embeddings=embeddings, usage=usage)
