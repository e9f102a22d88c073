"""Prompt inputs accepted by every engine: a string, a text prompt or a token-id prompt.

A vision-language model's prompt dict carries its images as ``multi_modal_data``: ``{"image": image}`` or
``{"image": [image, ...]}``, an image being a PIL image or encoded image bytes (PNG, JPEG, ...), one for each image
placeholder of the prompt, in order.
"""

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt given as text; the frontend tokenizes it. Each image token (``<image>``) is one image's placeholder."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt given as token ids, passed to the model unchanged but for its image placeholders.

    A placeholder is a run of image tokens, one token long (the frontend expands it to the image's count) or
    already as long as the image's count.
    """

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]


class EmbedsPrompt(TypedDict):
    """A prompt given as its input embeddings, ``[tokens, hidden_size]`` floats (vLLM's ``prompt_embeds``).

    A numpy array or anything ``numpy.asarray`` reads (a CPU ``torch.Tensor``; bfloat16 must be cast first), with a
    batch dimension of one or not: the model runs them in place of its token embeddings, as it would those of the
    tokens they stand for. Text models only.
    """

    prompt_embeds: Any


PromptInputs = str | TextPrompt | TokensPrompt | EmbedsPrompt
"""One prompt: a plain string, a :class:`TextPrompt`, a :class:`TokensPrompt` or an :class:`EmbedsPrompt`."""
