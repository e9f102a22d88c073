"""The OpenAI API's bodies: requests into the engine's types, the engine's outputs into OpenAI's objects, errors.

A request's sampling fields become a ``spindle.v1`` ``SamplingParams`` message, so that the gRPC server's own
checks (:meth:`~spindle.frontend.grpc.servicer.SpindleServicer.check_limits`) and mapping
(:func:`~spindle.frontend.grpc.mapping.sampling_params_from_proto`) apply as they are. Errors name their field as the
gRPC API does (``sampling_params.top_p``); :func:`error_body` gives the request's own parameter (``top_p``).
"""

import base64
import json
import struct
import time
import uuid
from typing import Any

import grpc

from spindle.frontend.grpc.servicer import status_for
from spindle.shared import CompletionOutput, EmbeddingRequestOutput, Logprob, PromptInputs, RequestOutput
from spindle.shared.errors import InvalidRequestError, NotFoundError, OutputProcessingError
from spindle.v1 import spindle_pb2

SAMPLING_FIELDS: dict[str, str] = {
    "n": "int",
    "temperature": "float",
    "top_p": "float",
    "top_k": "int",
    "min_p": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "repetition_penalty": "float",
    "seed": "int",
    "stop": "stop",
    "stop_token_ids": "ids",
    "include_stop_str_in_output": "bool",
    "ignore_eos": "bool",
    "max_tokens": "int",
    "min_tokens": "int",
    "logit_bias": "bias",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "cache_salt": "str",
    "allowed_token_ids": "ids",
    "bad_words": "strs",
    "truncate_prompt_tokens": "int",
    "best_of": "int",
    "logits_processors": "list",
}
"""The sampling parameters both generation routes take (OpenAI's and vLLM's extras), each with its JSON kind."""

COMMON_FIELDS = frozenset(
    {"model", "stream", "stream_options", "user", "priority", "response_format", "close_at_max_tokens"}
)
"""The other fields both generation routes take."""

COMPLETION_FIELDS = frozenset(SAMPLING_FIELDS) | COMMON_FIELDS | {"prompt", "logprobs", "echo"}
"""Every field ``/v1/completions`` takes; any other is refused."""
CHAT_FIELDS = (
    frozenset(SAMPLING_FIELDS)
    | COMMON_FIELDS
    | {
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "add_generation_prompt",
    }
)
"""Every field ``/v1/chat/completions`` takes; any other is refused."""
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "priority"})
"""Every field ``/v1/embeddings`` takes; any other is refused."""

_KINDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "stop": "a string or a list of strings",
    "ids": "a list of token ids",
    "strs": "a list of strings",
    "bias": "an object of token ids to numbers",
    "object": "an object",
    "list": "a list",
}

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}
"""Each status code :func:`~spindle.frontend.grpc.servicer.status_for` gives, as an HTTP status and OpenAI type."""


class RequestError(Exception):
    """A request refused before it reaches the engine, with its HTTP status and OpenAI error fields.

    Args:
        status: the HTTP status.
        message: what is wrong and how to fix it.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request parameter at fault, if one is.
        code: OpenAI's error code (``invalid_api_key``, ``model_not_found``, ...), if one applies.

    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


def openai_param(field: str, renames: dict[str, str] | None = None) -> str:
    """The request parameter that holds the gRPC API's ``field`` (``sampling_params.top_p`` is ``top_p``).

    ``renames`` maps the names of a route's parameters where they differ (chat's ``max_completion_tokens``).
    """
    name = field.removeprefix("sampling_params.")
    root = name.split(".", 1)[0].split("[", 1)[0]
    if root == "structured_output":
        return "response_format"
    if root in ("prompt", "inputs"):
        return "prompt" if root == "prompt" else "input"
    if root in ("lora_name", "pooling_params"):
        return "model" if root == "lora_name" else name.removeprefix("pooling_params.")
    if root == "tool_choice":
        return root
    return (renames or {}).get(name, name)


def error_body(error: Exception, renames: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of what a request raised (:func:`status_for` chooses, as for gRPC).

    An unknown adapter (``lora_name``) is OpenAI's ``404 model_not_found`` on ``model``.
    """
    if isinstance(error, RequestError):
        return error.status, error.body
    code, message, violations = status_for(error)
    status, kind = _HTTP_STATUS.get(code, (500, "server_error"))
    param = openai_param(violations[0].field, renames) if violations else None
    error_code = None
    if isinstance(error, NotFoundError) and param == "model":
        error_code = "model_not_found"
    elif status == 429:
        error_code = "rate_limit_exceeded"
    elif status == 500 and not isinstance(error, OutputProcessingError):
        error_code = "internal_error"
    return status, {"error": {"message": message, "type": kind, "param": param, "code": error_code}}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value: object, kind: str) -> bool:
    match kind:
        case "int":
            return _is_int(value)
        case "float":
            return _is_int(value) or isinstance(value, float)
        case "bool":
            return isinstance(value, bool)
        case "str":
            return isinstance(value, str)
        case "stop":
            return isinstance(value, str) or isinstance(value, list) and all(isinstance(s, str) for s in value)
        case "ids":
            return isinstance(value, list) and all(_is_int(t) for t in value)
        case "strs":
            return isinstance(value, list) and all(isinstance(s, str) for s in value)
        case "bias":
            return isinstance(value, dict) and all(_is_int(b) or isinstance(b, float) for b in value.values())
        case "object":
            return isinstance(value, dict)
        case _:
            return isinstance(value, list)


def field(body: dict[str, Any], name: str, kind: str) -> Any:
    """The value of ``name`` in ``body`` (``None`` when absent or null), refused when it is not of ``kind``.

    Raises:
        InvalidRequestError: the value is not of ``kind`` (one of the keys of ``_KINDS``).

    """
    value = body.get(name)
    if value is not None and not _matches(value, kind):
        raise InvalidRequestError(name, f"{name} must be {_KINDS[kind]}, got {json.dumps(value)[:60]}")
    return value


def check_fields(body: object, allowed: frozenset[str]) -> dict[str, Any]:
    """``body`` as a request object with none but ``allowed`` fields (nothing a client sends is silently dropped).

    Raises:
        RequestError: the body is not a JSON object, or has another field (``400``, naming it).

    """
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(
            400,
            f"unrecognized request argument supplied: {unknown[0]} (this route takes {', '.join(sorted(allowed))})",
            param=unknown[0],
        )
    return body


def sampling_message(body: dict[str, Any], names: dict[str, str] | None = None) -> spindle_pb2.SamplingParams:
    """The ``spindle.v1`` sampling parameters that ``body`` sets, each checked for its JSON kind.

    ``names`` maps a parameter to the body's name for it where a route names it otherwise (chat's
    ``max_completion_tokens``). ``response_format`` becomes the structured output constraint, and
    ``close_at_max_tokens`` (spindle's extension) whether it closes at the length limit.

    Raises:
        InvalidRequestError: a value of the wrong kind or outside the message's range (naming the parameter).

    """
    message = spindle_pb2.SamplingParams()
    for name, kind in SAMPLING_FIELDS.items():
        given = (names or {}).get(name, name)
        value = field(body, given, kind)
        if value is None:
            continue
        try:
            if name == "stop":
                message.stop.extend([value] if isinstance(value, str) else value)
            elif kind in ("ids", "strs"):
                getattr(message, name).extend(value)
            elif name == "logit_bias":
                message.logit_bias.update({int(token): bias for token, bias in value.items()})
            elif name == "logits_processors":
                message.logits_processors.extend(_logits_processor(entry, given) for entry in value)
            else:
                setattr(message, name, value)
        except (ValueError, TypeError, OverflowError) as error:
            raise InvalidRequestError(given, f"{given}={json.dumps(value)[:60]} is out of range: {error}") from error
    response_format = field(body, "response_format", "object")
    if response_format is not None:
        constraint = _structured_output(response_format)
        if constraint is not None:
            message.structured_output.CopyFrom(constraint)
    close = field(body, "close_at_max_tokens", "bool")
    if close is not None:
        if not message.HasField("structured_output"):
            raise InvalidRequestError(
                "close_at_max_tokens", "close_at_max_tokens needs a response_format of json_object or json_schema"
            )
        message.structured_output.close_at_max_tokens = close
    return message


def _logits_processor(entry: object, given: str) -> spindle_pb2.LogitsProcessor:
    """A ``{"name": ..., "args": {...}}`` entry of ``logits_processors`` as its message."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or set(entry) - {"name", "args"}:
        raise InvalidRequestError(given, f'each of {given} must be {{"name": str, "args": object}}')
    args = entry.get("args") or {}
    if not isinstance(args, dict):
        raise InvalidRequestError(given, f"{given}' args must be an object")
    return spindle_pb2.LogitsProcessor(name=entry["name"], args_json=json.dumps(args))


def _structured_output(response_format: dict[str, Any]) -> spindle_pb2.StructuredOutput | None:
    """The constraint of a ``response_format``: none for ``text``, any JSON object, or a JSON schema."""
    match response_format.get("type"):
        case "text":
            return None
        case "json_object":
            return spindle_pb2.StructuredOutput(json_object=True)
        case "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(
                    "response_format", "response_format.json_schema needs a 'schema' (a JSON schema object)"
                )
            return spindle_pb2.StructuredOutput(json_schema=json.dumps(schema))
        case kind:
            raise InvalidRequestError(
                "response_format", f"response_format.type must be text, json_object or json_schema, not {kind!r}"
            )


def prompts(value: object, name: str) -> list[PromptInputs]:
    """The prompts of a ``prompt`` or ``input``: a string, a list of them, token ids, or a list of token id lists.

    Raises:
        InvalidRequestError: ``value`` is none of these (an empty list neither).

    """
    if isinstance(value, str):
        return [{"prompt": value}]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [{"prompt": item} for item in value]
        if all(_is_int(item) for item in value):
            return [{"prompt_token_ids": value}]
        if all(isinstance(item, list) and item and all(_is_int(t) for t in item) for item in value):
            return [{"prompt_token_ids": item} for item in value]
    raise InvalidRequestError(
        name, f"{name} must be a string, a list of strings, a list of token ids or a list of token id lists"
    )


def new_id(prefix: str) -> str:
    """A response id: ``prefix``, a dash and 32 random hex digits (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput], completion_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` of finished requests (one per prompt) that generated ``completion_tokens`` in all."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(output.num_cached_tokens for output in outputs)},
    }


def _token_text(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def completion_logprobs(completion: CompletionOutput, offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` of a delta: tokens, their logprobs, each top dict, text offsets.

    ``offset`` is where the delta's text starts in the choice's text.
    """
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
        chosen = position[token_id]
        result["tokens"].append(_token_text(chosen))
        result["token_logprobs"].append(chosen.logprob)
        # Two tokens may read alike (bytes of one character): the chosen one's entry is the one kept.
        top = {_token_text(lp): lp.logprob for lp in position.values()}
        result["top_logprobs"].append(top | {_token_text(chosen): chosen.logprob})
        result["text_offset"].append(offset)
        offset += len(_token_text(chosen))
    return result


def chat_logprobs(completion: CompletionOutput, top: int) -> dict[str, Any]:
    """The chat ``logprobs`` of a delta: per token, its text, logprob, bytes and the ``top`` most likely tokens."""

    def entry(lp: Logprob) -> dict[str, Any]:
        text = _token_text(lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
        ranked = sorted((lp for lp in position.values() if lp.rank is not None), key=lambda lp: lp.rank)
        content.append(entry(position[token_id]) | {"top_logprobs": [entry(lp) for lp in ranked[:top]]})
    return {"content": content}


def stop_reason(completion: CompletionOutput) -> int | str | None:
    """The stop string or token id that ended a finished completion (vLLM's ``stop_reason``), else ``None``."""
    return completion.stop_reason if completion.finish_reason is not None else None


def embedding_value(values: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or ``base64`` of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()
    return values


def embeddings_response(model: str, outputs: list[EmbeddingRequestOutput], encoding_format: str) -> dict[str, Any]:
    """The ``/v1/embeddings`` response of the inputs' outputs, in input order."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    data = [
        {"object": "embedding", "index": index, "embedding": embedding_value(output.outputs.embedding, encoding_format)}
        for index, output in enumerate(outputs)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def now() -> int:
    """The ``created`` time of a response: seconds since the epoch."""
    return int(time.time())
