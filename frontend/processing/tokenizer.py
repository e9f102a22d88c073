"""The tokenizer of a Hugging Face model directory, read with ``tokenizers`` and ``jinja2`` only.

The frontend process must not import torch or transformers, so this module reads the files that
``transformers`` writes (``tokenizer.json``, ``tokenizer_config.json``, the chat template files,
``generation_config.json`` and ``config.json``) itself and reproduces what ``transformers`` does with them.
"""

import json
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

# The named special tokens transformers exposes to chat templates (``bos_token``, ``eos_token``, ...).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Encodes text, decodes token ids and renders chat templates for one model.

    Build it with :meth:`from_dir`. Decoding never applies ``clean_up_tokenization_spaces``: transformers 5
    skips it for BPE tokenizers, and an incremental detokenizer could not reproduce it anyway.

    Args:
        backend: the ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``.
        chat_template: the jinja2 chat template, ``None`` when the model has none.
        special_tokens: the named special tokens (``bos_token``, ``eos_token``, ...) as strings.
        extra_eos_token_ids: end-of-sequence ids beyond the tokenizer's ``eos_token`` (from the generation config).

    Attributes:
        special_tokens: the named special tokens, which chat templates see as variables.
        eos_token_ids: every id that ends a sequence, the tokenizer's ``eos_token`` first.
        bos_token_id: the id of ``bos_token``, ``None`` when the model has none.
        all_special_ids: the added tokens marked special: those ``skip_special_tokens`` leaves out.

    """

    def __init__(
        self,
        backend: BackendTokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        extra_eos_token_ids: list[int] | None = None,
    ) -> None:
        self._backend = backend
        self._chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        self.special_tokens = dict(special_tokens or {})
        eos_id = self._special_token_id("eos_token")
        eos_ids = ([] if eos_id is None else [eos_id]) + list(extra_eos_token_ids or [])
        # dict.fromkeys drops duplicates and keeps the tokenizer's own eos first.
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_ids))
        self.bos_token_id: int | None = self._special_token_id("bos_token")
        self.all_special_ids: list[int] = sorted(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load the tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json``, whose post-processor alone decides whether encoding adds a bos (transformers 5
        likewise ignores ``add_bos_token`` / ``add_eos_token`` next to a ``tokenizer.json``); the named special
        tokens and the chat template from ``tokenizer_config.json`` (or the older ``special_tokens_map.json``); a
        chat template in ``chat_template.jinja`` (how transformers 5 saves it) or ``chat_template.json`` (older
        processors) takes precedence over one in ``tokenizer_config.json``; extra eos ids come from
        ``generation_config.json`` and ``config.json`` (an int or a list).

        Args:
            path: the model directory.

        Returns:
            The loaded tokenizer.

        Raises:
            FileNotFoundError: the directory has no ``tokenizer.json``.

        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json: only tokenizers-library (fast) tokenizers load")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        legacy_map = _read_json(path / "special_tokens_map.json")
        special_tokens = {}
        for name in _SPECIAL_TOKEN_NAMES:
            token = _token_content(config.get(name, legacy_map.get(name)))
            if token is not None:
                special_tokens[name] = token
        extra_eos: list[int] = []
        for file_name in ("generation_config.json", "config.json"):
            eos = _read_json(path / file_name).get("eos_token_id")
            if isinstance(eos, int):
                extra_eos.append(eos)
            elif eos is not None:
                extra_eos.extend(eos)
        return cls(backend, _read_chat_template(path, config), special_tokens, extra_eos)

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> "Tokenizer":
        """Load a tokenizer from the contents of a model directory's tokenizer files.

        The backend's handshake carries them, so the frontend needs no disk shared with the backend.
        """
        with tempfile.TemporaryDirectory(prefix="spindle-tokenizer-") as directory:
            for name, content in files.items():
                (Path(directory) / Path(name).name).write_bytes(content)
            return cls.from_dir(directory)

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """The number of tokens, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template: the model's, or one that overrides it."""
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The jinja2 chat template conversations are rendered with; ``None`` when there is none."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str) -> None:
        """Render conversations with ``template`` instead of the model's (``--chat-template``), compiled at once.

        Raises:
            ValueError: ``template`` is not a jinja2 template.

        """
        self._chat_template, self._compiled_template = template, _compile_chat_template(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text``.

        Args:
            text: the text.
            add_special_tokens: add the tokens the model's post-processor adds (such as a leading bos).

        Returns:
            The token ids.

        """
        # encode_batch releases the GIL (encode holds it: 2 s for a megabyte), so a long text stalls no other thread.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text.

        Args:
            ids: the token ids.
            skip_special_tokens: leave out added tokens marked special.

        Returns:
            The text.

        """
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Look up the vocabulary entries (raw token strings, such as ``"Ġworld"``) of ``ids``.

        Raises:
            ValueError: an id is not in the vocabulary.

        """
        tokens = [self._backend.id_to_token(token_id) for token_id in ids]
        if None in tokens:
            unknown = [token_id for token_id, token in zip(ids, tokens, strict=True) if token is None]
            raise ValueError(f"token ids {unknown} are not in the vocabulary of {self.vocab_size} tokens")
        return tokens

    def id_to_text(self, token_id: int) -> str:
        """Decode one token (special tokens included), as a logprob's ``decoded_token`` shows it."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation with the model's chat template, as transformers does.

        The template sees ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (``None`` unless
        given), the named special tokens (``bos_token``, ``eos_token``, ...) and ``kwargs``, which override them.

        Args:
            messages: the conversation, dicts with at least ``role`` and ``content``.
            add_generation_prompt: end with the header that starts an assistant turn.
            **kwargs: more template variables.

        Returns:
            The rendered prompt text (not tokenized; it usually contains the bos token already).

        Raises:
            ValueError: the model has no chat template, or the template rejected the conversation.

        """
        if self._chat_template is None:
            raise ValueError(
                "this model's tokenizer has no chat template (no chat_template in tokenizer_config.json, "
                "chat_template.jinja or chat_template.json): send a plain prompt instead of chat messages"
            )
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            if self._compiled_template is None:
                self._compiled_template = _template_environment().from_string(self._chat_template)
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected the conversation: {error}") from error

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts transformers' ``{% generation %}...{% endgeneration %}`` marker and renders its body unchanged.

    Transformers uses the marker to build assistant-token masks for training; serving only needs the text, but
    templates that contain it must still parse.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the block into a call that returns its body."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _template_environment() -> ImmutableSandboxedEnvironment:
    """Build a sandboxed jinja2 environment with the helpers transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters (<, >, &), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


JINJA_CHARACTERS = "{}\n"
"""Characters of any chat template (a jinja2 tag or a line break), which no file path names in practice."""


def load_chat_template(path_or_text: str) -> str:
    """The chat template ``--chat-template`` gives: a file's contents, or the value itself when it is no file.

    As vLLM does: a value that names no file is taken for inline jinja2 text, unless it has none of
    :data:`JINJA_CHARACTERS`, when it is most likely a mistyped path. The template is compiled, so that a bad one
    is refused at start-up, not at the first chat request.

    Raises:
        ValueError: the value names no file and looks like a path, the file cannot be read, or the template does not
            parse.

    """
    path = Path(path_or_text)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # too long for a path, or a NUL character in it: inline text
        is_file = False
    if is_file:
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"--chat-template {path_or_text!r}: the file cannot be read: {error}") from error
    elif any(character in path_or_text for character in JINJA_CHARACTERS):
        template = path_or_text
    else:
        raise ValueError(
            f"--chat-template {path_or_text!r} is no file, and it does not look like a jinja2 template either: "
            "give the path of a template file, or the template's text"
        )
    _compile_chat_template(template)
    return template


def _compile_chat_template(template: str) -> jinja2.Template:
    """``template`` compiled in the chat templates' environment; raises ``ValueError`` when it does not parse."""
    try:
        return _template_environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"the chat template does not parse as jinja2 (line {error.lineno}): {error}") from error


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    # Older configs store special tokens as serialized AddedToken dicts.
    return value.get("content") if isinstance(value, dict) else value


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(path / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        # Several named templates: serving renders plain conversations, so it uses the default one.
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template
