"""Incremental detokenization of one completion, with stop strings and streaming deltas."""

from tokenizers.decoders import DecodeStream

from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared import SamplingParams

# Prompt tokens the decode stream starts from, so that the first generated token decodes as it would after the
# prompt (SentencePiece-style decoders drop a word's leading space at the very start of a text). vLLM uses 5 too.
_PROMPT_CONTEXT_TOKENS = 5

# What tokenizers' DecodeStream raises when decoding a window of invalid UTF-8 changes text it already returned.
_INVALID_PREFIX_ERROR = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns the tokens of one completion into text as they are generated, and finds its stop strings.

    Decoding goes through ``tokenizers.decoders.DecodeStream``, which holds a token back while it ends in an
    incomplete UTF-8 character, so emoji and CJK characters split over several byte tokens come out whole. The
    stream starts from the prompt's last tokens, so the first generated token gets the leading space it has after
    the prompt.

    When special tokens are kept (``skip_special_tokens=False``) and ``spaces_between_special_tokens`` is on (its
    default), each special token is a piece of its own, the text between them is decoded separately and the
    pieces are joined with spaces, as Hugging Face's slow tokenizers and vLLM do; otherwise the text is exactly
    ``tokenizer.decode`` of the output tokens.

    Args:
        tokenizer: the model's tokenizer.
        params: the request's sampling parameters (stop strings and special-token flags).
        prompt_token_ids: the prompt the completion continues.

    Attributes:
        output_text: the completion's text so far, cut at the stop string once one matched.

    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._backend = tokenizer.backend
        self._skip_special_tokens = params.skip_special_tokens
        self._stops: list[str] = list(params.stop or [])
        # A stop string that new text completes ends in one of its characters: only those ending in one are searched.
        self._stops_by_last_char: dict[str, list[tuple[int, str]]] = {}
        for order, stop in enumerate(self._stops):
            self._stops_by_last_char.setdefault(stop[-1], []).append((order, stop))
        self._include_stop = params.include_stop_str_in_output
        # Text that could still turn out to be the start of a stop string is not streamed yet; with
        # include_stop_str_in_output the text is only ever cut after a stop string, so nothing is held.
        self._holdback = max(map(len, self._stops)) - 1 if self._stops and not self._include_stop else 0
        self._spaced_special_ids = (
            frozenset(tokenizer.all_special_ids)
            if not params.skip_special_tokens and params.spaces_between_special_tokens
            else frozenset()
        )
        tail = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        # A spaced special token starts a new piece, so only the prompt's text after its last one is context.
        specials = [position for position, token_id in enumerate(tail) if token_id in self._spaced_special_ids]
        self._stream = self._new_stream(tail[specials[-1] + 1 :] if specials else tail)
        self._has_previous_piece = bool(prompt_token_ids)
        self._space_pending = bool(prompt_token_ids) and prompt_token_ids[-1] in self._spaced_special_ids
        self._sent = 0
        self.output_text = ""

    @property
    def has_stop_strings(self) -> bool:
        """Whether the request has stop strings, which need the text as it grows."""
        return bool(self._stops)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode newly generated tokens, append their text and check the stop strings.

        Args:
            new_token_ids: the tokens generated since the last call.

        Returns:
            The stop string that now occurs in the text, or ``None``. When one matched, :attr:`output_text` has been
            cut right before it (right after it with ``include_stop_str_in_output``), and the earliest match wins.

        """
        previous_length = len(self.output_text)
        self.output_text += "".join(self._decode(token_id) for token_id in new_token_ids)
        if len(self.output_text) == previous_length:
            return None
        match = self._find_stop(previous_length)
        if match is None:
            return None
        start, _, stop = match
        self.output_text = self.output_text[: start + len(stop) if self._include_stop else start]
        return stop

    def _find_stop(self, previous_length: int) -> tuple[int, int, str] | None:
        """The earliest stop string (the first given, of those that start there) that ends after ``previous_length``.

        Only a match that ends in the new text is new: older text has been searched already. So each stop string
        that ends in a new character is searched for in the text's tail alone, from where it would start if it ended
        at the first new character: the work per token does not grow with the text.

        Returns:
            Where it starts, its place in the request's stop strings, and the string; ``None`` when none matches.

        """
        match = None
        for char in set(self.output_text[previous_length:]):
            for order, stop in self._stops_by_last_char.get(char, ()):
                start = self.output_text.find(stop, max(0, previous_length - len(stop) + 1))
                if start != -1 and (match is None or (start, order) < match[:2]):
                    match = (start, order, stop)
        return match

    def get_delta(self, finished: bool = False) -> str:
        """Return the text not returned yet.

        While unfinished, the last ``max(len(stop)) - 1`` characters are held back because they may still become a
        stop string (not with ``include_stop_str_in_output``, where no returned text can be taken back).

        Args:
            finished: the completion has ended, so release everything.

        Returns:
            The new text, possibly empty.

        """
        end = len(self.output_text) if finished else len(self.output_text) - self._holdback
        if end <= self._sent:
            return ""
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta

    def _decode(self, token_id: int) -> str:
        """Decode one token into the text it adds (possibly empty while a character is incomplete)."""
        if token_id in self._spaced_special_ids:
            text = self._backend.id_to_token(token_id)
            if self._has_previous_piece:
                text = " " + text
            self._stream = self._new_stream([])
            self._space_pending = True
        else:
            text = self._step(token_id) or ""
            if text and self._space_pending:
                text = " " + text
                self._space_pending = False
        self._has_previous_piece = True
        return text

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as error:
            if not str(error).startswith(_INVALID_PREFIX_ERROR):
                raise
            # Invalid UTF-8 from byte-fallback tokens can decode differently once more bytes follow, which breaks
            # the stream's prefix check; restart it at this token (the invalid bytes would only be U+FFFD).
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, token_id)

    def _new_stream(self, context: list[int]) -> DecodeStream:
        """Start a decode stream after ``context``.

        Context tokens that end in an incomplete character are stepped into the stream rather than given as its
        prefix: the character they begin belongs to the output that completes it.
        """
        skip = self._skip_special_tokens
        complete = len(context)
        while complete and self._backend.decode(context[:complete], skip_special_tokens=skip).endswith("\ufffd"):
            complete -= 1
        stream = DecodeStream(ids=context[:complete], skip_special_tokens=skip)
        if complete < len(context):
            stream.step(self._backend, context[complete:])
        return stream
