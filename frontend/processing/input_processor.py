"""Checks and tokenizes prompts and chat conversations before they reach the engine core.

A vision-language model's prompt holds one placeholder per image, its image token (``<image>``), in the images'
order; each placeholder is expanded into the image's full run of image tokens (one per embedding of the image), and
the images are preprocessed into :class:`~spindle.shared.protocol.ImageInput` pixels at their runs.
"""

import asyncio
import base64
import binascii
import dataclasses
import itertools
import json
import reprlib
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from spindle.frontend.processing.image_processor import ImageProcessor
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.frontend.processing.tools import ChatTools
from spindle.shared import PromptInputs, SamplingParams, ToolCall
from spindle.shared.errors import InvalidRequestError
from spindle.shared.json_depth import check_json_text, check_json_value
from spindle.shared.protocol import EMBEDS_PLACEHOLDER, ImageInput, PromptEmbeds

OFF_LOOP_CHARACTERS = 16_384
"""Text longer than this is tokenized in a worker thread by the ``*_async`` methods, not on the event loop.

A thread hop costs tens of microseconds; tokenizing 16k characters about a millisecond, and a prompt of megabytes
seconds, which would stall every stream the loop serves.
"""

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")
_ALLOWED_KEYS = frozenset((*_PROMPT_KEYS, "multi_modal_data"))
_CONTENT_PARTS = (
    "{'type': 'text', 'text': str}, {'type': 'image', 'image': PIL image or bytes} or "
    "{'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}"
)


@dataclasses.dataclass
class ProcessedPrompt:
    """A checked prompt, ready for the engine core.

    Attributes:
        prompt: the prompt text, when the prompt was given as text.
        prompt_token_ids: the prompt's token ids, each image placeholder expanded to the image's run of tokens.
        images: the prompt's preprocessed images in prompt order, each at its run of image tokens (a vision-language
            model only).
        tools: a chat request's tools and tool choice, ``None`` when it has none (or chose ``"none"``).
        prompt_embeds: the embeddings of a prompt given as embeddings (its token ids are then placeholders).

    """

    prompt: str | None
    prompt_token_ids: list[int]
    images: list[ImageInput] = dataclasses.field(default_factory=list)
    tools: ChatTools | None = None
    prompt_embeds: PromptEmbeds | None = None


class InputProcessor:
    """Turns user prompts into token ids, rejecting what the model cannot take with an actionable error.

    Every refusal is an :class:`~spindle.shared.errors.InvalidRequestError` (a :class:`ValueError`) that names the
    request field at fault as the gRPC API names it (``prompt.token_ids[3]``, ``messages[0].content``, ...).

    Args:
        tokenizer: the model's tokenizer.
        max_model_len: the most tokens (prompt plus completion) one sequence may hold.
        vocab_size: the model's vocabulary size; token ids must be below it.
        image_processor: a vision-language model's image processor; ``None`` for a text-only model, whose prompts
            may carry no images.

    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        image_processor: ImageProcessor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.image_processor = image_processor

    def process(self, inputs: PromptInputs, params: SamplingParams | None) -> ProcessedPrompt:
        """Check one prompt, tokenize it if it is text, and expand and preprocess its images.

        A text prompt's every image token (``<image>``) is one image's placeholder. In a token-id prompt, a run of
        one image token is a placeholder, and so is a run already as long as an image's tokens.

        Args:
            inputs: a string, ``{"prompt": str}``, ``{"prompt_token_ids": list[int]}`` or ``{"prompt_embeds":
                array}`` (``[tokens, hidden_size]`` floats, whose token ids become placeholders), the first two
                optionally with ``multi_modal_data``: ``{"image": image}`` or ``{"image": [image, ...]}`` (one per
                placeholder, in order), an image being a PIL image or encoded image bytes (see
                :meth:`~spindle.frontend.processing.image_processor.ImageProcessor.preprocess`).
            params: the request's sampling parameters (``max_tokens`` must fit after the prompt); ``None`` for an
                embedding request, whose prompt may fill the context since nothing is generated after it.

        Returns:
            The prompt text (``None`` for token ids), its token ids with the placeholders expanded (only the last
            ``truncate_prompt_tokens`` of them when ``params`` ask so), and its images.

        Raises:
            InvalidRequestError: the prompt is malformed, empty, has token ids outside the vocabulary, does not leave
                room for ``max_tokens`` in the context (its placeholders expanded), carries multimodal data the model
                cannot take, has not one placeholder per image, or an image is not decodable or too large; or
                ``params`` name token ids outside the vocabulary, or would truncate a prompt with images.

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
                "prompt",
                f"a prompt dict needs exactly one of 'prompt', 'prompt_token_ids' and 'prompt_embeds', got {given}",
            )
        if "prompt_embeds" in inputs:
            return self._embeds_prompt(inputs, params)
        images = self._prompt_images(inputs.get("multi_modal_data"))
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
        prompt_field = "prompt.text" if prompt is not None else "prompt.token_ids"
        token_ids, offsets = self._expand_placeholders(
            token_ids, len(images), ("prompt.multi_modal_data", prompt_field), runs=prompt is None
        )
        if params is not None:
            token_ids = self._prepare_request(token_ids, offsets, params)
        elif len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"the prompt has {len(token_ids)} tokens, more than the model's context of "
                f"max_model_len={self.max_model_len} tokens: shorten it",
            )
        return ProcessedPrompt(prompt, token_ids, self._preprocess(images, offsets))

    def _embeds_prompt(self, inputs: dict[str, Any], params: SamplingParams | None) -> ProcessedPrompt:
        """A prompt of embeddings: ``[tokens, hidden]`` floats (a batch dimension of one allowed), finite.

        Its token ids are placeholders; the backend checks the width against the model's hidden size.
        """
        if "multi_modal_data" in inputs:
            raise InvalidRequestError("prompt.multi_modal_data", "a prompt of embeddings takes no multi_modal_data")
        field = "prompt.prompt_embeds"
        try:
            embeds = np.asarray(inputs["prompt_embeds"])
        except (TypeError, ValueError, RuntimeError) as error:  # a tensor on a GPU, or one numpy has no dtype for
            raise InvalidRequestError(field, f"prompt_embeds does not convert to a numpy array: {error}") from error
        if embeds.ndim == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.dtype.kind != "f" or embeds.ndim != 2 or not embeds.size:
            raise InvalidRequestError(
                field,
                f"prompt_embeds must be a non-empty float array of [tokens, hidden_size], not {embeds.dtype} of "
                f"shape {list(embeds.shape)}",
            )
        if not np.isfinite(embeds).all():
            raise InvalidRequestError(field, "prompt_embeds has values that are not finite (NaN or infinity)")
        if params is not None and params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            embeds = embeds[-keep:]
        token_ids = [EMBEDS_PLACEHOLDER] * len(embeds)
        if params is not None:
            token_ids = self._prepare_request(token_ids, [], params)
        elif len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(token_ids)} embeddings, more than max_model_len={self.max_model_len}"
            )
        return ProcessedPrompt(None, token_ids, prompt_embeds=PromptEmbeds.from_array(embeds))

    async def process_async(self, inputs: PromptInputs, params: SamplingParams | None) -> ProcessedPrompt:
        """:meth:`process` for an event loop: in a worker thread for a vision-language model or a long text.

        Decoding and resizing an image takes from milliseconds to a few hundred of them (a large JPEG), and
        tokenizing a long text as long, either of which would stall every stream the loop serves; short text prompts
        are processed on the loop, as a thread hop would cost more than tokenizing them.
        """
        text = inputs if isinstance(inputs, str) else inputs.get("prompt") if isinstance(inputs, dict) else None
        return await self._off_loop(self.process, len(text) if isinstance(text, str) else 0, inputs, params)

    async def process_chat_async(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = "auto",
    ) -> ProcessedPrompt:
        """:meth:`process_chat` for an event loop: off the loop for a vision-language model or a long conversation.

        (:meth:`process_async` says why.)
        """
        text = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
        return await self._off_loop(
            self.process_chat, text, messages, params, add_generation_prompt, tools, tool_choice
        )

    async def _off_loop(
        self, method: Callable[..., ProcessedPrompt], text_length: int, *args: object
    ) -> ProcessedPrompt:
        """``method(*args)`` in a worker thread for a vision-language model or a long text, else on the loop."""
        if self.image_processor is None and text_length <= OFF_LOOP_CHARACTERS:
            return method(*args)
        return await asyncio.to_thread(method, *args)

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
        ``None`` content (usual beside tool calls) as ``""``, a content of parts as ``{"type": "text", "text"}`` and
        ``{"type": "image"}`` parts for a vision-language model (the template writes each image's placeholder), as
        the text parts joined by newlines for a text-only one. The images are taken in the conversation's order, one
        for each placeholder of the rendered prompt.

        Args:
            messages: the conversation, a non-empty list of dicts with str ``role`` and ``content``; the content may
                be a list of parts instead, ``{"type": "text", "text": str}``, ``{"type": "image", "image": image}``
                (a PIL image or encoded image bytes) or OpenAI's ``{"type": "image_url", "image_url": {"url":
                "data:image/png;base64,..."}}`` (data URLs only: the server fetches nothing). An assistant turn may
                carry ``tool_calls`` (OpenAI's form, the flat ``{"id", "name", "arguments"}``, or
                :class:`~spindle.shared.ToolCall` objects; arguments as JSON text or a dict), a tool turn a
                ``tool_call_id``.
            params: the request's sampling parameters (``max_tokens`` must fit after the prompt).
            add_generation_prompt: end with the header that starts an assistant turn.
            tools: the functions the model may call (see :mod:`spindle.frontend.processing.tools`).
            tool_choice: ``"auto"``, ``"none"``, ``"required"`` or a tool's name (see
                :meth:`~spindle.frontend.processing.tools.ChatTools.from_request`).

        Returns:
            The rendered prompt text and its token ids (the last ``truncate_prompt_tokens`` of them when ``params``
            ask so), and the request's
            :class:`~spindle.frontend.processing.tools.ChatTools` (which constrain its sampling parameters and parse its
            replies).

        Raises:
            InvalidRequestError: a message or tool is malformed, the tool choice is not possible, the model has no
                chat template, the template rejected the conversation, the prompt does not leave room for
                ``max_tokens``, an image part is given to a text-only model or is not decodable or too large, or the
                rendered prompt has not one placeholder per image; or ``params`` are refused as by :meth:`process`.

        """
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError(
                "messages", "messages must be a non-empty list of {'role': str, 'content': str} dicts"
            )
        takes_images = self.image_processor is not None
        images: list[tuple[str, object]] = []
        checked = []
        for index, message in enumerate(messages):
            checked_message, message_images = _check_message(index, message, takes_images)
            checked.append(checked_message)
            images += message_images
        messages = checked
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
        token_ids, offsets = self._expand_placeholders(token_ids, len(images), ("messages",), runs=False)
        token_ids = self._prepare_request(token_ids, offsets, params)
        return ProcessedPrompt(prompt, token_ids, self._preprocess(images, offsets), chat_tools)

    def _prompt_images(self, multi_modal_data: object) -> list[tuple[str, object]]:
        """The images of a prompt's ``multi_modal_data``, each with the field that names it (not decoded yet)."""
        if multi_modal_data is None:
            return []
        if self.image_processor is None:
            raise InvalidRequestError(
                "prompt.multi_modal_data", "this model takes text only: remove 'multi_modal_data' from the prompt"
            )
        if not isinstance(multi_modal_data, dict) or multi_modal_data.keys() != {"image"}:
            given = (
                f"the keys {sorted(map(str, multi_modal_data))}"
                if isinstance(multi_modal_data, dict)
                else f"a {type(multi_modal_data).__name__}"
            )
            raise InvalidRequestError(
                "prompt.multi_modal_data",
                f"this model takes images only: multi_modal_data must be {{'image': an image or a list of images}}, "
                f"got {given}",
            )
        images = multi_modal_data["image"]
        images = images if isinstance(images, list | tuple) else [images]
        return [(f"prompt.multi_modal_data[{index}]", image) for index, image in enumerate(images)]

    def _expand_placeholders(
        self, token_ids: list[int], num_images: int, fields: tuple[str, ...], runs: bool
    ) -> tuple[list[int], list[int]]:
        """``token_ids`` with each image placeholder expanded to an image's run of tokens, and the runs' offsets.

        Every image token is a placeholder, or with ``runs`` (token-id prompts) every run of image tokens, which must
        be one token or a full image's. There must be ``num_images`` placeholders, else the error names ``fields``.
        """
        if self.image_processor is None:
            return token_ids, []
        image_token_id, length = self.image_processor.image_token_id, self.image_processor.num_image_tokens
        expanded: list[int] = []
        offsets: list[int] = []
        position = 0
        for token_id, group in itertools.groupby(token_ids):
            count = len(list(group))
            if token_id != image_token_id:
                expanded += [token_id] * count
            elif runs and count not in (1, length):
                raise InvalidRequestError(
                    f"prompt.token_ids[{position}]",
                    f"prompt_token_ids[{position}:{position + count}] is a run of {count} image tokens "
                    f"({image_token_id}): an image's placeholder is 1 image token or all {length} of the image's",
                )
            else:
                for _ in range(1 if runs else count):
                    offsets.append(len(expanded))
                    expanded += [image_token_id] * length
            position += count
        if len(offsets) != num_images:
            token = self.tokenizer.id_to_text(image_token_id)
            raise InvalidRequestError(
                fields[0],
                f"the prompt has {len(offsets)} image placeholders ({token}) but {num_images} images were given: "
                f"put one {token} where each image goes, in the images' order",
                also=fields[1:],
            )
        return expanded, offsets

    def _preprocess(self, images: list[tuple[str, object]], offsets: list[int]) -> list[ImageInput]:
        """Each ``(field, image)`` decoded and preprocessed, at its placeholder's offset."""
        if not images:  # also every text-only model's prompt: their images were refused
            return []
        length = self.image_processor.num_image_tokens
        return [
            ImageInput.from_pixels(self.image_processor.preprocess(image, field), offset, length)
            for (field, image), offset in zip(images, offsets, strict=True)
        ]

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

    def _prepare_request(self, token_ids: list[int], offsets: list[int], params: SamplingParams) -> list[int]:
        """The prompt's tokens, truncated as ``params`` ask; checks ``params`` and fills in their bad words' tokens.

        ``offsets`` are where the prompt's image runs start: a prompt with images is not cut.
        """
        keep = params.truncate_prompt_tokens
        keep = self.max_model_len if keep == -1 else keep
        if keep is not None and len(token_ids) > keep:
            if offsets:
                raise InvalidRequestError(
                    "sampling_params.truncate_prompt_tokens",
                    f"truncate_prompt_tokens={params.truncate_prompt_tokens} would cut the prompt of "
                    f"{len(token_ids)} tokens, and a prompt with images is not truncated (the cut could split an "
                    "image's tokens): shorten the prompt instead",
                )
            token_ids = token_ids[-keep:]
        params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        self._check_request(len(token_ids), params)
        return token_ids

    def _bad_words_token_ids(self, bad_words: list[str] | None) -> list[list[int]] | None:
        """The token sequences of ``bad_words``, as vLLM makes them.

        Each word, its leading spaces stripped, is tokenized as it is and with one leading space (where that tokenizes
        otherwise), so that it is banned at the start of the output and after a space alike.
        """
        if not bad_words:
            return None
        sequences = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences += [plain] if spaced == plain else [plain, spaced]
        outside = sorted({t for sequence in sequences for t in sequence if t >= self.vocab_size})
        if outside:
            raise InvalidRequestError(
                "sampling_params.bad_words",
                f"SamplingParams.bad_words tokenize to token ids {outside} outside the model's vocabulary of "
                f"{self.vocab_size} tokens: the model cannot generate them anyway, so leave those words out",
            )
        return sequences

    def _check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        for field in ("logit_bias", "stop_token_ids", "allowed_token_ids"):
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


def _check_message(index: int, message: object, takes_images: bool) -> tuple[dict[str, Any], list[tuple[str, object]]]:
    """A copy of one chat message as templates take it, and its images with their fields (see :func:`_check_parts`).

    Raises for what no template could render.
    """
    field = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(
            field, f"{field} must be a dict with 'role' and 'content', not {reprlib.repr(message)}"
        )
    if not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"{field}.role", f"{field} needs a str 'role', got {message.get('role')!r}")
    content, tool_calls = message.get("content"), message.get("tool_calls")
    # OpenAI's clients send an assistant turn that only calls tools with a null content.
    if not isinstance(content, str | list) and not (content is None and tool_calls):
        raise InvalidRequestError(
            f"{field}.content",
            f"{field} needs a str 'content', got {reprlib.repr(content)}: give text, or a list of parts",
        )
    checked = {key: value for key, value in message.items() if value is not None}
    images: list[tuple[str, object]] = []
    if isinstance(content, list):
        checked["content"], images = _check_parts(index, content, takes_images)
    else:
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
    return checked, images


def _check_parts(
    index: int, parts: list[object], takes_images: bool
) -> tuple[str | list[dict[str, str]], list[tuple[str, object]]]:
    """Message ``index``'s content parts as the chat template takes them, and its images with their fields.

    A vision-language model's template gets the parts as ``{"type": "text", "text"}`` and ``{"type": "image"}``; a
    text-only model's (which expects a str) the text parts joined by newlines, and image parts are refused. The
    fields are ``messages[i].parts[j]``, as the gRPC API names a part.
    """
    rendered: list[dict[str, str]] = []
    images: list[tuple[str, object]] = []
    for number, part in enumerate(parts):
        field = f"messages[{index}].parts[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            rendered.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url") and not takes_images:
            raise InvalidRequestError(field, f"this model takes text only: {field} is an image part")
        elif kind == "image" and "image" in part:
            images.append((field, part["image"]))
            rendered.append({"type": "image"})
        elif kind == "image_url":
            images.append((field, _data_url_image(field, part.get("image_url"))))
            rendered.append({"type": "image"})
        else:
            raise InvalidRequestError(field, f"{field} must be {_CONTENT_PARTS}, not {reprlib.repr(part)}")
    if not takes_images:
        return "\n".join(part["text"] for part in rendered), []
    return rendered, images


def _data_url_image(field: str, image_url: object) -> bytes:
    """The image bytes of an ``image_url`` part's base64 ``data:`` URL; other URLs are refused (nothing is fetched)."""
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str):
        raise InvalidRequestError(
            field, f"{field} needs an 'image_url' of {{'url': str}}, got {reprlib.repr(image_url)}"
        )
    header, comma, data = url.partition(",")
    scheme = header.partition(":")[0].lower()
    if scheme in ("http", "https"):
        raise InvalidRequestError(
            field,
            f"{field} is an {scheme} URL, and the server fetches nothing: send the image inline, as a data URL "
            "(data:image/png;base64,...) or as image bytes",
        )
    media_type = header[len("data:") :].lower()
    if scheme != "data" or not comma or not media_type.startswith("image/") or not media_type.endswith(";base64"):
        raise InvalidRequestError(
            field, f"{field}'s url must be a base64 image data URL (data:image/png;base64,...), got {url[:40]!r}"
        )
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise InvalidRequestError(field, f"{field}'s data URL is not valid base64: {error}") from error


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
        check_json_text(arguments, f"{field}.arguments")
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise InvalidRequestError(
                f"{field}.arguments", f"{field}'s arguments are not JSON ({error}): {arguments!r}"
            ) from error
    else:
        check_json_value(arguments, f"{field}.arguments")
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"{field}.arguments", f"{field}'s arguments must be a JSON object, got {arguments!r}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
