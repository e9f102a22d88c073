"""Checks and tokenizes prompts and chat conversations before they reach the engine core."""

from dataclasses import dataclass
from typing import Any

from spindle.frontend.tokenizer import Tokenizer
from spindle.shared import PromptInputs, SamplingParams
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

    """

    prompt: str | None
    prompt_token_ids: list[int]
    multi_modal_data: dict[str, Any] | None = None


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

    def process(self, inputs: PromptInputs, params: SamplingParams) -> ProcessedPrompt:
        """Check one prompt and tokenize it if it is text.

        Args:
            inputs: a string, ``{"prompt": str}`` or ``{"prompt_token_ids": list[int]}``, each dict optionally with
                ``multi_modal_data``.
            params: the request's sampling parameters (``max_tokens`` must fit after the prompt).

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
        self._check_request(len(token_ids), params)
        return ProcessedPrompt(prompt, token_ids, multi_modal_data)

    def process_chat(
        self, messages: list[dict[str, Any]], params: SamplingParams, add_generation_prompt: bool = True
    ) -> ProcessedPrompt:
        """Check a conversation, render it with the model's chat template and tokenize it.

        The template already writes the special tokens (bos included), so the tokenizer adds none.

        Args:
            messages: the conversation, a non-empty list of dicts with str ``role`` and ``content``.
            params: the request's sampling parameters (``max_tokens`` must fit after the prompt).
            add_generation_prompt: end with the header that starts an assistant turn.

        Returns:
            The rendered prompt text and its token ids.

        Raises:
            InvalidRequestError: a message is malformed, the model has no chat template, the template rejected the
                conversation, or the prompt does not leave room for ``max_tokens``.

        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(
                "messages", "messages must be a non-empty list of {'role': str, 'content': str} dicts"
            )
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidRequestError(
                    f"messages[{index}]", f"messages[{index}] must be a dict with 'role' and 'content', not {message!r}"
                )
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise InvalidRequestError(
                        f"messages[{index}].{key}", f"messages[{index}] needs a str {key!r}, got {message.get(key)!r}"
                    )
        try:
            prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as error:  # no chat template, or the template refused the conversation
            raise InvalidRequestError("messages", str(error)) from error
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        self._check_request(len(token_ids), params)
        return ProcessedPrompt(prompt, token_ids)

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
