"""Prompt inputs accepted by every engine: a string, a text prompt or a token-id prompt."""

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt given as text; the frontend tokenizes it."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt given as token ids, passed to the model unchanged."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]


PromptInputs = str | TextPrompt | TokensPrompt
"""One prompt: a plain string, a :class:`TextPrompt` or a :class:`TokensPrompt`."""
