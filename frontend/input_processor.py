"""Checks and tokenizes prompts and chat conversations before they reach the engine core."""

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from spindle.frontend.tokenizer import Tokenizer
from spindle.frontend.tools import ChatTools
from spindle.shared import PromptInputs, SamplingParams, ToolCall
from spindle.shared.errors import InvalidRequestError

_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_ALLOWED_KEYS = frozenset((*_PROMPT_KEYS, "multi_modal_data"))


@dataclass
class ProcessedPrompt:
    """A checked prompt, ready for the engine core.

    Attributes:
        prompt: the prompt text, when the prompt was given as text.
        prompt_token_ids: the prompt's token ids.
        multi_modal_data: the prompt's images, audio, ... (only for a multimodal model).
        tools: a chat request's tools and tool choice, ``None`` when it has none (or chose ``"none"``).

    """

    prompt: str | None
    prompt_token_ids: list[int]
    multi_modal_data: dict[str, Any] | None = None
    tools: ChatTools | None = None


class InputProcessor:
    """Turns user prompts into token ids, rejecting what the model cannot take with an actionable error.

    Every refusal is an :class:`~spindle.shared.errors.InvalidRequestError` (a :class:`ValueError`) that names the
    request field at fault as the gRPC API names it (``prompt.token_ids[3]``, ``messages[0].content``, ...).

    Args:
        tokenizer: the model's tokenizer.
        max_model_len: the most tokens (prompt plus completion) one sequence may hold.
        vocab_size: the model's vocabulary size; token ids must be below it.
        supports_multimodal: whether prompts may carry ``multi_modal_data``.

    """

    def __init__(
        self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, supports_multimodal: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.supports_multimodal = supports_multimodal

    def process(self, inputs: PromptInputs, params: SamplingParams | None) -> ProcessedPrompt:
        """Check one prompt and tokenize it if it is text.

        Args:
            inputs: a string, ``{"prompt": str}`` or ``{"prompt_token_ids": list[int]}``, each dict optionally with
                ``multi_modal_data``.
            params: the request's sampling parameters (``max_tokens`` must fit after the prompt); ``None`` for an
                embedding request, whose prompt may fill the context since nothing is generated after it.

        Returns:
            The prompt text (``None`` for token ids) and its token ids.

        Raises:
            InvalidRequestError: the prompt is malformed, empty, has token ids outside the vocabulary, does not leave
                room for ``max_tokens`` in the context, or carries multimodal data the model cannot take.

        """
        if isinstance(inputs, str):
            inputs = {"prompt": inputs}
        if not isinstance(inputs, dict):
            raise InvalidRequestError(
                "prompt",
                f"a prompt must be a str, {{'prompt': str}} or {{'prompt_token_ids': list[int]}}, "
                f"not {type(inputs).__name__}",
            )
        unknown = sorted(map(str, inputs.keys() - _ALLOWED_KEYS))
        if unknown:
            raise InvalidRequestError(
                "prompt", f"unknown prompt keys {unknown}: the allowed keys are {sorted(_ALLOWED_KEYS)}"
            )
        given = [key for key in _PROMPT_KEYS if key in inputs]
        if len(given) != 1:
            raise InvalidRequestError(
                "prompt", f"a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids', got {given}"
            )
        multi_modal_data = inputs.get("multi_modal_data")
        if multi_modal_data is not None and not self.supports_multimodal:
            raise InvalidRequestError(
                "prompt.multi_modal_data", "this model takes text only: remove 'multi_modal_data' from the prompt"
            )
        if "prompt" in inputs:
            prompt = inputs["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt.text", f"'prompt' must be a str, not {type(prompt).__name__}")
            token_ids = self.tokenizer.encode(prompt)
        else:
            prompt = None
            token_ids = self._check_token_ids(inputs["prompt_token_ids"])
        if not token_ids:
            raise InvalidRequestError("prompt", "the prompt is empty: give at least one character or token id")
        if params is not None:
            self._check_request(len(token_ids), params)
        elif len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(token_ids)} tokens, more than the model's context of "
                f"max_model_len={self.max_model_len} tokens: shorten it",
            )
        return ProcessedPrompt(prompt, token_ids, multi_modal_data)

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
    ) -> ProcessedPrompt:
        """Check a conversation and its tools, render it with the model's chat template and tokenize it.

        The template already writes the special tokens (bos included), so the tokenizer adds none. It receives the
        tools in OpenAI's form as ``tools`` (``None`` without tools or under ``tool_choice="none"``), and the
        messages as Hugging Face templates expect them: an assistant turn's ``tool_calls`` as
        ``{"id", "type": "function", "function": {"name", "arguments"}}`` with the arguments decoded into a dict, a
        ``None`` content (usual beside tool calls) as ``""``.

        Args:
            messages: the conversation, a non-empty list of dicts with str ``role`` and ``content``; an assistant
                turn may carry ``tool_calls`` (OpenAI's form, the flat ``{"id", "name", "arguments"}``, or
                :class:`~spindle.shared.ToolCall` objects; arguments as JSON text or a dict), a tool turn a
                ``tool_call_id``.
            params: the request's sampling parameters (``max_tokens`` must fit after the prompt).
            add_generation_prompt: end with the header that starts an assistant turn.
            tools: the functions the model may call (see :mod:`spindle.frontend.tools`).
            tool_choice: ``"auto"``, ``"none"``, ``"required"`` or a tool's name (see
                :meth:`~spindle.frontend.tools.ChatTools.from_request`).

        Returns:
            The rendered prompt text and its token ids, and the request's :class:`~spindle.frontend.tools.ChatTools`
            (which constrain its sampling parameters and parse its replies).

        Raises:
            InvalidRequestError: a message or tool is malformed, the tool choice is not possible, the model has no
                chat template, the template rejected the conversation, or the prompt does not leave room for
                ``max_tokens``.

        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(
                "messages", "messages must be a non-empty list of {'role': str, 'content': str} dicts"
            )
        messages = [_check_message(index, message) for index, message in enumerate(messages)]
        chat_tools = ChatTools.from_request(tools, tool_choice, params)
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=None if chat_tools is None else chat_tools.tools,
            )
        except ValueError as error:  # no chat template, or the template refused the conversation
            raise InvalidRequestError("messages", str(error)) from error
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        self._check_request(len(token_ids), params)
        return ProcessedPrompt(prompt, token_ids, tools=chat_tools)

    def _check_token_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, list):
            raise InvalidRequestError(
                "prompt.token_ids", f"'prompt_token_ids' must be a list of ints, not {type(token_ids).__name__}"
            )
        for position, token_id in enumerate(token_ids):
            # bool is an int subclass, but True as a token id is a caller's bug.
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidRequestError(
                    f"prompt.token_ids[{position}]", f"prompt_token_ids[{position}] = {token_id!r} is not an int"
                )
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt.token_ids[{position}]",
                    f"prompt_token_ids[{position}] = {token_id} is outside the vocabulary: "
                    f"token ids must be in [0, {self.vocab_size})",
                )
        return list(token_ids)

    def _check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        for field in ("logit_bias", "stop_token_ids"):
            outside = sorted(t for t in getattr(params, field) or () if t >= self.vocab_size)
            if outside:
                raise InvalidRequestError(
                    f"sampling_params.{field}",
                    f"SamplingParams.{field} names token ids {outside} outside the vocabulary: "
                    f"token ids must be in [0, {self.vocab_size})",
                )
        max_tokens = params.max_tokens
        if max_tokens is None:
            if num_prompt_tokens >= self.max_model_len:
                raise InvalidRequestError(
                    "prompt",
                    f"the prompt has {num_prompt_tokens} tokens, which leaves no room to generate in the "
                    f"model's context of max_model_len={self.max_model_len} tokens: shorten the prompt",
                )
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            room = self.max_model_len - num_prompt_tokens
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {num_prompt_tokens} tokens and max_tokens={max_tokens}, together "
                f"{num_prompt_tokens + max_tokens}, more than max_model_len={self.max_model_len}: shorten the prompt"
                + (f" or lower max_tokens to at most {room}" if room >= 1 else ""),
                also=["sampling_params.max_tokens"],
            )


def refer_to_input(error: InvalidRequestError, index: int) -> InvalidRequestError:
    """``error``, raised for a prompt, as the error of the ``index``-th prompt of a batch (the ``Embed`` RPC's inputs).

    Its ``prompt`` fields become ``inputs[index]`` ones: with ``index=2``, ``prompt.token_ids[3]`` is
    ``inputs[2].token_ids[3]``.
    """

    def rename(field: str) -> str:
        return f"inputs[{index}]" + field.removeprefix("prompt") if field.startswith("prompt") else field

    return InvalidRequestError(rename(error.field), error.reason, also=[rename(f) for f in error.fields[1:]])


def _check_message(index: int, message: object) -> dict[str, Any]:
    """A copy of one chat message as templates take it; raises for what no template could render."""
    field = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(field, f"{field} must be a dict with 'role' and 'content', not {message!r}")
    if not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"{field}.role", f"{field} needs a str 'role', got {message.get('role')!r}")
    content, tool_calls = message.get("content"), message.get("tool_calls")
    # OpenAI's clients send an assistant turn that only calls tools with a null content.
    if not isinstance(content, str) and not (content is None and tool_calls):
        raise InvalidRequestError(f"{field}.content", f"{field} needs a str 'content', got {content!r}")
    checked = {key: value for key, value in message.items() if value is not None}
    checked["content"] = content or ""
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise InvalidRequestError(
                f"{field}.tool_calls", f"{field}'s tool_calls must be a list, not {type(tool_calls).__name__}"
            )
        checked["tool_calls"] = [
            _check_tool_call(f"{field}.tool_calls[{number}]", call) for number, call in enumerate(tool_calls)
        ]
    if not isinstance(message.get("tool_call_id", ""), str):
        raise InvalidRequestError(
            f"{field}.tool_call_id", f"{field}'s tool_call_id must be a str, got {message['tool_call_id']!r}"
        )
    return checked


def _check_tool_call(field: str, call: object) -> dict[str, Any]:
    """One tool call of an assistant turn in OpenAI's form, its arguments a dict (as Hugging Face templates use)."""
    if isinstance(call, ToolCall):
        call = msgspec.structs.asdict(call)
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise InvalidRequestError(
            field,
            f"{field} must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}, "
            f"{{'id': str, 'name': str, 'arguments': str}} or a ToolCall, not {call!r}",
        )
    name, arguments, call_id = function.get("name"), function.get("arguments", {}), call.get("id", "")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{field}.name", f"{field} needs a non-empty str name, got {name!r}")
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{field}.id", f"{field}'s id must be a str, got {call_id!r}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise InvalidRequestError(
                f"{field}.arguments", f"{field}'s arguments are not JSON ({error}): {arguments!r}"
            ) from error
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{field}.arguments", f"{field}'s arguments must be a JSON object, got {arguments!r}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
