"""The shortest way to close a constrained output: what a sequence about to reach its length limit writes instead.

A JSON value cut by ``max_tokens`` does not parse, though the request finished cleanly. So as a constrained
sequence nears its limit, :class:`~spindle.backend.structured_output.StructuredOutputManager` asks
:class:`GrammarCloser` how many tokens the grammar needs to be complete from where the output stands (``"}`` in a
string value of a flat object; ``,"b":0}`` when a required property is missing) and, once that is about all the
room left, forces those tokens instead of sampling.

The search walks the grammar one character at a time with the matcher itself (accept a character's token, roll it
back), depth first, trying closers before everything else: ``"`` ``}`` ``]`` ``)``, then the separators a required
part needs (``,`` ``:``), digits, other punctuation, letters, and openers and whitespace last, so that it ends
strings and numbers at once and opens nothing it need not (a string that must hold more characters gets ``a``).
A grammar whose next character is outside ASCII (a choice of non-ASCII words) takes the first token it allows
there. The characters found are then written in as few tokens of the vocabulary as they can be (``"}`` is often
one token).
"""

import string
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from xgrammar import GrammarMatcher, TokenizerInfo

PREFERENCE = '"}]),:' + string.digits + ".;-_!?@#$%&*+=/\\|<>~^`'" + string.ascii_letters + "{[( \n\t"
"""The characters the search tries, in order: see the module's docstring."""

OPENERS = b",{["
"""The characters that open a new element, object or array: a sequence near its limit samples no token holding one
(other than its closing's next token)."""

MAX_CHARACTERS = 256
"""The longest closing the search looks for, in characters."""

MAX_TRIES = 5000
"""Characters the search may try (accepted or not) before it gives up (~5 ms): closing then is not attempted. It
gives up at once on reaching :data:`MAX_CHARACTERS`."""


class GrammarCloser:
    """Finds, for a matcher, a short token sequence after which its grammar is complete.

    Args:
        tokenizer_info: xgrammar's table of the model's vocabulary (the one the grammars were compiled for).

    Attributes:
        openers: the bitmask of the tokens that hold one of :data:`OPENERS`.

    """

    def __init__(self, tokenizer_info: "TokenizerInfo") -> None:
        self.texts = [bytes(text) for text in tokenizer_info.decoded_vocab]
        special = set(tokenizer_info.special_token_ids)
        self.tokens: dict[bytes, int] = {}
        for token_id, text in enumerate(self.texts):
            if token_id not in special and text:
                self.tokens.setdefault(text, token_id)
        self.characters = [self.tokens[c.encode()] for c in PREFERENCE if c.encode() in self.tokens]
        self.character_set = set(self.characters)
        self.letter, self.brace = self.tokens.get(b"a"), self.tokens.get(b"}")
        self.longest = max(map(len, self.tokens), default=1)
        self.vocab_size = tokenizer_info.vocab_size
        self.openers = _bitmask(
            [token_id for token_id, text in enumerate(self.texts) if any(c in text for c in OPENERS)], self.vocab_size
        )

    def closing(self, matcher: "GrammarMatcher") -> list[int] | None:
        """The tokens after which ``matcher``'s grammar is complete (``[]`` when it is now); ``None`` if none found.

        The matcher is left as it was.
        """
        path = self._search(matcher)
        if path is None:
            return None
        tokens = self._fewest_tokens(b"".join(self.texts[token_id] for token_id in path))
        return tokens if tokens is not None and _completes(matcher, tokens) else path

    def _search(self, matcher: "GrammarMatcher") -> list[int] | None:
        """The closing the search finds, a token a character (tried on ``matcher`` and rolled back)."""
        path: list[int] = []
        tries = 0

        def extend() -> bool:
            nonlocal tries
            if matcher.is_completed():
                return True
            if len(path) >= MAX_CHARACTERS:
                tries = MAX_TRIES  # too long a closing: give up at once rather than backtrack through it
                return False
            for token_id in self._candidates(matcher):
                if tries >= MAX_TRIES:
                    return False
                tries += 1
                if matcher.accept_token(token_id):
                    path.append(token_id)
                    if extend():
                        return True
                    path.pop()
                    matcher.rollback(1)
            return False

        found = extend()
        matcher.rollback(len(path))
        return path if found else None

    def _candidates(self, matcher: "GrammarMatcher") -> Iterator[int]:
        """The tokens to try next: the characters in order, then the first other token the grammar allows.

        Where ``"`` does not end the text but both ``a`` and ``}`` would continue it (a JSON string that needs more
        characters), ``a`` comes right after it: a string is filled with letters, not with the closers after ``"``.
        """
        first, *rest = self.characters
        yield first
        if self.letter is not None and _accepts(matcher, self.letter) and _accepts(matcher, self.brace):
            yield self.letter
            rest.remove(self.letter)
        yield from rest
        import xgrammar

        mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        for word in mask[0].nonzero().flatten().tolist():
            bits = int(mask[0, word]) & 0xFFFFFFFF
            while bits:
                token_id = word * 32 + (bits & -bits).bit_length() - 1
                if token_id not in self.character_set:
                    yield token_id
                    return
                bits &= bits - 1

    def _fewest_tokens(self, text: bytes) -> list[int] | None:
        """``text`` written in the fewest tokens of the vocabulary (``None`` if some byte has no token)."""
        # fewest[end]: how few tokens write text[:end], and the last of them.
        fewest: list[tuple[int, int] | None] = [(0, -1)] + [None] * len(text)
        for end in range(1, len(text) + 1):
            for start in range(max(0, end - self.longest), end):
                token_id = self.tokens.get(text[start:end])
                before, current = fewest[start], fewest[end]
                if token_id is not None and before is not None and (current is None or before[0] + 1 < current[0]):
                    fewest[end] = (before[0] + 1, token_id)
        if fewest[-1] is None:
            return None
        tokens, end = [], len(text)
        while end:
            token_id = fewest[end][1]
            tokens.append(token_id)
            end -= len(self.texts[token_id])
        return tokens[::-1]


def _bitmask(token_ids: list[int], vocab_size: int) -> "torch.Tensor":
    """The int32 bitmask (xgrammar's layout: bit ``t % 32`` of word ``t // 32``) with the bits of ``token_ids`` set."""
    import numpy as np
    import torch

    words = np.zeros((vocab_size + 31) // 32, dtype=np.uint32)
    ids = np.asarray(token_ids, dtype=np.int64)
    np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return torch.from_numpy(words.view(np.int32))


def _accepts(matcher: "GrammarMatcher", token_id: int | None) -> bool:
    """Whether ``matcher`` accepts ``token_id`` next (tried and rolled back)."""
    if token_id is None or not matcher.accept_token(token_id):
        return False
    matcher.rollback(1)
    return True


def _completes(matcher: "GrammarMatcher", tokens: list[int]) -> bool:
    """Whether ``matcher`` accepts ``tokens`` and is complete after them (rolled back either way)."""
    accepted = 0
    for token_id in tokens:
        if not matcher.accept_token(token_id):
            break
        accepted += 1
    complete = accepted == len(tokens) and matcher.is_completed()
    matcher.rollback(accepted)
    return complete
