"""Sampling parameters of one request, validated when they are built."""

import enum
import json
import math
from collections.abc import Sized
from typing import Any

import msgspec

from spindle.shared.errors import InvalidRequestError
from spindle.shared.json_depth import check_json_value, load_json_text

MAX_LOGPROBS = 20
"""The most top log-probabilities a request may ask for, per generated or prompt token (vLLM's default limit)."""

MAX_SPECULATIVE_TOKENS = 16
"""The most draft tokens a request may ask to verify per step: past a few, a CPU step costs more than it saves."""

MAX_STOP_STRINGS = 64
"""The most stop strings a request may give. Each is searched for in every new piece of text (where it may end),
so a request's cost per token grows with their number; OpenAI takes 4, and 64 leaves room for any real use."""

MAX_STOP_STRING_LENGTH = 256
"""The longest a stop string may be, in characters: as many characters less one are held back from a stream until
they cannot begin a stop string any more, and each search spans them."""

MAX_STOP_TOKEN_IDS = 1024
"""The most ``stop_token_ids`` a request may give (kept as a set, so a token's check does not grow with them)."""

MAX_LOGIT_BIAS = 1024
"""The most ``logit_bias`` entries a request may give: each is added to its rows' logits at every step. OpenAI takes
300; 1024 leaves room to ban or favour whole families of tokens."""

MAX_ALLOWED_TOKEN_IDS = 16_384
"""The most ``allowed_token_ids`` a request may give: enough for a whole class of tokens (digits, a script, a
domain's words) of a large vocabulary, while a request stays a few tens of kilobytes."""

MAX_BAD_WORDS = 128
"""The most ``bad_words`` a request may give: each one's token sequences are compared with the end of the output at
every step, so a step's cost grows with them (vLLM's model runner takes as many)."""

MAX_BAD_WORD_LENGTH = 256
"""The longest a bad word may be, in characters: its tokens, but the last, are compared with the output's end at every
step."""


MAX_LOGITS_PROCESSORS = 8
"""The most logits processors a request may select."""


class LogitsProcessorSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A logits processor the server registered, selected by name, with the keyword arguments it is built with.

    The backend refuses an unknown name or arguments the class refuses, naming
    ``sampling_params.logits_processors[i]`` (:mod:`spindle.backend.logits_processors`).

    Attributes:
        name: the processor's registered name (``no_repeat_ngram`` is Spindle's own).
        args: its keyword arguments, a JSON object (nested at most
            :data:`~spindle.shared.json_depth.MAX_JSON_DEPTH` levels).

    """

    name: str
    args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidRequestError("sampling_params.logits_processors", "a logits processor needs a name")
        check_json_value(self.args, "sampling_params.logits_processors")


class StructuredOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on what a completion may be; set exactly one field.

    At each step only the tokens that keep the output a valid prefix of the language can be sampled, and the
    completion ends (finish reason ``stop``) once the language allows nothing more. The backend compiles the spec
    with xgrammar, once per distinct spec; one that does not compile refuses the request with an
    :class:`~spindle.shared.errors.InvalidRequestError` for ``sampling_params.structured_output.<field>`` carrying
    the compiler's message. Only the shape is checked here: which field is set, and that a schema is JSON nested at
    most :data:`~spindle.shared.json_depth.MAX_JSON_DEPTH` levels deep.

    Attributes:
        json_schema: a JSON schema, as JSON text or a dict: the output is a JSON value valid against it.
        json_object: any JSON object.
        regex: a regular expression the whole output matches.
        grammar: a grammar in EBNF (xgrammar's dialect, GBNF-like, with a ``root`` rule).
        choice: the output is one of these strings, exactly.
        structural_tag: an xgrammar structural tag, as JSON text or a dict (vLLM's ``structural_tag``): the
            ``{"type": "structural_tag", "format": {...}}`` form, or the older ``{"structures": [{"begin", "schema",
            "end"}], "triggers": [...]}``, in which free text may call structures that start at a trigger (tool calls
            written inline: ``<function=get_weather>{...}</function>``).
        close_at_max_tokens: near its length limit (``max_tokens``, or the context), the completion writes the
            shortest text that completes the grammar (``"}`` in a JSON string value; ``,"b":0}`` when a required
            property is missing), then ends, so that a ``length`` finish still parses; ``False`` lets the limit cut
            it wherever it falls.

    """

    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: str | dict[str, Any] | None = None
    close_at_max_tokens: bool = True

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "sampling_params.structured_output",
                f"StructuredOutput needs exactly one of {', '.join(_CONSTRAINTS)}; got "
                + (", ".join(given) if given else "none"),
            )
        if self.json_schema is not None:
            self.json_schema, schema = _json_text(self.json_schema, _JSON_SCHEMA_FIELD, "the JSON schema")
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(
                    _JSON_SCHEMA_FIELD, f"a JSON schema is an object or a boolean, not {type(schema).__name__}"
                )
        if self.structural_tag is not None:
            field = "sampling_params.structured_output.structural_tag"
            self.structural_tag, tag = _json_text(self.structural_tag, field, field)
            if not isinstance(tag, dict):
                raise InvalidRequestError(field, f"{field} must be a JSON object, not {type(tag).__name__}")
            if "format" not in tag and "structures" not in tag:
                raise InvalidRequestError(field, f"{field} needs a 'format' (or, in the older form, 'structures')")
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise InvalidRequestError(f"sampling_params.structured_output.{name}", f"the {name} is empty")
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise InvalidRequestError(
                "sampling_params.structured_output.choice", "choice needs at least one string, and no empty one"
            )

    @property
    def kind(self) -> str:
        """The name of the field that is set (``"json_schema"``, ``"regex"``, ...)."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


def _json_text(value: str | dict[str, Any], field: str, what: str) -> tuple[str, Any]:
    """JSON given as a dict or as text, checked to nest at most ``MAX_JSON_DEPTH`` levels: its text and its value.

    Raises:
        InvalidRequestError: for ``field``: nested too deep, or text that is not JSON (``what`` names it).

    """
    if isinstance(value, dict):
        check_json_value(value, field)
        return json.dumps(value), value
    return value, load_json_text(value, field, what)


_JSON_SCHEMA_FIELD = "sampling_params.structured_output.json_schema"


class RequestOutputKind(enum.IntEnum):
    """What each output of a request carries, as vLLM's ``RequestOutputKind`` (``SamplingParams.output_kind``)."""

    CUMULATIVE = 0
    """Everything so far: the text and tokens since the start."""
    DELTA = 1
    """Only what is new since the previous output."""
    FINAL_ONLY = 2
    """One output, when the request finishes."""


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample the completion(s) of one prompt; the fields mean what they mean in vLLM.

    Every value is checked at construction (every float must be finite); a bad one raises
    :class:`~spindle.shared.errors.InvalidRequestError` (a :class:`ValueError`) for the field
    ``sampling_params.<name>``, naming the value given and the allowed range. The struct is a msgspec struct so
    that it crosses the frontend/backend socket as msgpack.

    Attributes:
        n: number of completions returned for the prompt.
        temperature: softmax temperature; ``0`` means greedy (argmax) decoding.
        top_p: keep the smallest set of tokens whose probabilities add up to ``top_p``.
        top_k: keep the ``top_k`` most likely tokens; ``0`` or ``-1`` keeps all.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely token's.
        presence_penalty: subtracted from the logit of every token that already appears in the output.
        frequency_penalty: subtracted from a token's logit once per time it appears in the output.
        repetition_penalty: divides positive (multiplies negative) logits of tokens seen in the prompt
            or the output; ``1`` disables it.
        seed: seed of this request's own random generator, so its samples do not depend on the batch.
        stop: strings that end the completion; the text ends before the stop string. At most
            :data:`~spindle.shared.sampling_params.MAX_STOP_STRINGS`, each of at most
            :data:`~spindle.shared.sampling_params.MAX_STOP_STRING_LENGTH` characters.
        stop_token_ids: token ids that end the completion (kept in ``token_ids``); a list or set of at most
            :data:`~spindle.shared.sampling_params.MAX_STOP_TOKEN_IDS` ids, kept as a ``frozenset``.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        ignore_eos: keep generating after the end-of-sequence token.
        max_tokens: most tokens to generate; ``None`` means up to the model's context length.
        min_tokens: tokens to generate before eos or ``stop_token_ids`` may end the completion.
        logprobs: number of top log-probabilities returned per generated token (plus the sampled one).
        prompt_logprobs: number of top log-probabilities returned per prompt token.
        logit_bias: token id to a bias added to its logit before sampling; at most
            :data:`~spindle.shared.sampling_params.MAX_LOGIT_BIAS` entries.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: put spaces around special tokens in the text.
        cache_salt: isolates the prefix cache: cached KV blocks are shared only between requests with the same
            salt (give each tenant its own); ``None`` shares with every other unsalted request.
        num_speculative_tokens: up to this many draft tokens per step by prompt lookup (n-gram speculation:
            continue the longest recent n-gram found earlier in the prompt or output), all verified in one forward
            pass. Exact: greedy output is unchanged and sampled output keeps its distribution; it pays when the
            output copies from the input (summaries, edits, code). 0 (the default) turns it off.
        structured_output: constrain the output to a JSON schema, any JSON object, a regex, a grammar or a list of
            choices (:class:`StructuredOutput`); logprobs are then those of the constrained distribution.
        allowed_token_ids: only these token ids may be sampled (the others' logits are masked before anything else,
            so logprobs are those of the restricted distribution, and greedy decoding takes the best allowed token);
            at most :data:`~spindle.shared.sampling_params.MAX_ALLOWED_TOKEN_IDS`, each in the vocabulary.
        bad_words: words that are never generated. Each is tokenized as it is and with a leading space (where that
            tokenizes differently), and at every step the last token of such a token sequence is masked when the
            output ends with the sequence's other tokens: a one-token word is never sampled and a longer one never
            completed. At most :data:`~spindle.shared.sampling_params.MAX_BAD_WORDS` non-blank words of at most
            :data:`~spindle.shared.sampling_params.MAX_BAD_WORD_LENGTH` characters.
        bad_words_token_ids: the token sequences of ``bad_words``, which the frontend fills in (replacing any value
            given) for the backend, which sees token ids only.
        truncate_prompt_tokens: keep only the last ``k`` prompt tokens (``k >= 1``), after tokenization and any chat
            template; ``-1`` keeps the last ``max_model_len``. The output's ``prompt_token_ids`` are those kept.
        best_of: generate this many completions and return the ``n`` of them with the highest cumulative
            log-probability, best first (vLLM's); at least ``n``, and above ``n`` only when sampling (greedy
            completions would be the same). Above ``n``, the request has one output, when it finishes, and
            ``cumulative_logprob`` is set whether or not ``logprobs`` was asked.
        logits_processors: processors the server registered, by name, with their arguments
            (:class:`LogitsProcessorSpec`), applied in order to every row of the request after the token restrictions
            and before the logit bias; at most :data:`~spindle.shared.sampling_params.MAX_LOGITS_PROCESSORS`.
        detokenize: turn the tokens into text; ``False`` leaves every output's ``text`` empty and saves the
            decoding (token ids only, as vLLM's), and takes no stop strings, which need the text.
        output_kind: what each of the request's outputs carries in the Python engines (:class:`RequestOutputKind`,
            as vLLM's): everything so far, only what is new, or one output at the end; the same as ``delta=True``
            and ``final_only=True`` of ``LLMEngine.add_request`` (either one set there wins). gRPC and HTTP
            streams are made of deltas whatever it says.

    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: frozenset[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    num_speculative_tokens: int = 0
    structured_output: StructuredOutput | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    logits_processors: list[LogitsProcessorSpec] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(name, value, math.isfinite(value), "a finite number")
        _check("n", self.n, self.n >= 1, "an integer >= 1")
        _check("best_of", self.best_of, self.best_of is None or self.best_of >= self.n, "None or an integer >= n")
        _check_size("logits_processors", self.logits_processors, MAX_LOGITS_PROCESSORS, "processors")
        _check("detokenize", self.detokenize, self.detokenize or not self.stop, "True when stop strings are given")
        _check(
            "best_of",
            self.best_of,
            self.best_of is None or self.best_of == self.n or self.temperature > 0,
            "n (or None) when decoding greedily (temperature 0): its completions would all be the same",
        )
        _check("temperature", self.temperature, self.temperature >= 0, "a number >= 0 (0 is greedy)")
        _check("top_p", self.top_p, 0 < self.top_p <= 1, "a number in (0, 1]")
        _check("top_k", self.top_k, self.top_k >= -1, "-1, 0 (both disable it) or an integer >= 1")
        _check("min_p", self.min_p, 0 <= self.min_p <= 1, "a number in [0, 1]")
        _check("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "a number in [-2, 2]")
        _check("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "a number in [-2, 2]")
        _check("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty <= 2, "a number in (0, 2]")
        _check("seed", self.seed, self.seed is None or 0 <= self.seed < 2**63, "None or an integer in [0, 2**63)")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        _check("stop", self.stop, all(s for s in stops or []), "None, a non-empty string or a list of them")
        _check_size("stop", stops, MAX_STOP_STRINGS, "stop strings")
        _check_longest("stop", stops, MAX_STOP_STRING_LENGTH, "string")
        self.stop = stops
        _check(
            "cache_salt",
            self.cache_salt,
            self.cache_salt is None or self.cache_salt != "",
            "None or a non-empty string",
        )
        _check_size("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, "token ids")
        _check("stop_token_ids", self.stop_token_ids, all(t >= 0 for t in self.stop_token_ids or []), "token ids >= 0")
        if self.stop_token_ids is not None:
            self.stop_token_ids = frozenset(self.stop_token_ids)  # checked for every generated token
        _check(
            "max_tokens", self.max_tokens, self.max_tokens is None or self.max_tokens >= 1, "None or an integer >= 1"
        )
        _check(
            "min_tokens",
            self.min_tokens,
            self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "an integer in [0, max_tokens]",
        )
        _check(
            "logprobs",
            self.logprobs,
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(
            "prompt_logprobs",
            self.prompt_logprobs,
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"None or an integer in [0, {MAX_LOGPROBS}]",
        )
        _check(
            "num_speculative_tokens",
            self.num_speculative_tokens,
            0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            f"an integer in [0, {MAX_SPECULATIVE_TOKENS}]",
        )
        _check_size("logit_bias", self.logit_bias, MAX_LOGIT_BIAS, "entries")
        _check(
            "logit_bias",
            self.logit_bias,
            all(t >= 0 and -100 <= b <= 100 for t, b in (self.logit_bias or {}).items()),
            "token ids >= 0 mapped to biases in [-100, 100]",
        )
        _check_size("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS, "token ids")
        _check(
            "allowed_token_ids",
            self.allowed_token_ids,
            self.allowed_token_ids is None or bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0,
            "None or a non-empty list of token ids >= 0",
        )
        _check_size("bad_words", self.bad_words, MAX_BAD_WORDS, "words")
        _check(
            "bad_words",
            self.bad_words,
            not isinstance(self.bad_words, str) and all(w.strip() for w in self.bad_words or []),
            "None or a list of words that are not blank",
        )
        _check_longest("bad_words", self.bad_words, MAX_BAD_WORD_LENGTH, "word")
        _check(
            "truncate_prompt_tokens",
            self.truncate_prompt_tokens,
            self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
            "None, -1 (the model's context length) or an integer >= 1",
        )

    @property
    def greedy(self) -> bool:
        """Whether the request decodes greedily (temperature 0)."""
        return self.temperature == 0

    @property
    def keeps_best_of(self) -> bool:
        """Whether ``best_of`` asks for more completions than ``n``: ``best_of`` run, the best ``n`` of them kept."""
        return self.best_of is not None and self.best_of > self.n


_FLOAT_FIELDS = tuple(field.name for field in msgspec.structs.fields(SamplingParams) if field.type is float)


def _check(field: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise InvalidRequestError(
            f"sampling_params.{field}", f"SamplingParams.{field}={value!r} is invalid: it must be {allowed}"
        )


def _check_size(field: str, value: Sized | None, limit: int, what: str) -> None:
    """Refuse a collection of more than ``limit`` items (without writing them all into the message)."""
    if value is not None and len(value) > limit:
        raise InvalidRequestError(
            f"sampling_params.{field}",
            f"SamplingParams.{field} has {len(value)} {what}, more than the limit of {limit}",
        )


def _check_longest(field: str, strings: list[str] | None, limit: int, what: str) -> None:
    """Refuse a list with a string of more than ``limit`` characters (quoting only its start)."""
    longest = max(strings or [""], key=len)
    if len(longest) > limit:
        raise InvalidRequestError(
            f"sampling_params.{field}",
            f"SamplingParams.{field} has a {what} of {len(longest)} characters ({longest[:20]!r}...), longer than "
            f"the limit of {limit}",
        )
