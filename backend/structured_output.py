"""Structured output with xgrammar: grammars compiled off the step loop, a matcher per sequence, a bitmask per step.

:class:`StructuredOutputManager` owns all of structured output's state: the compiles under way, the refusals of
specs that do not compile, and each constrained sequence's ``GrammarMatcher``. A constrained request's spec
(:class:`~spindle.shared.sampling_params.StructuredOutput`) is compiled in a worker process
(:class:`~spindle.backend.grammar_compiler.GrammarCompilePool`: bounded in time, a crash there refuses the request,
not the engine) while the engine keeps stepping the other requests; its sequences wait (the scheduler passes them
over) until the grammar is ready. Compiled grammars are cached by spec, so a schema that many requests share
compiles once; so are refusals, those of a compile that ran out of time or crashed for :data:`REFUSAL_TTL` only.
Each step, while the device runs the forward pass, the manager fills the bitmask of the tokens each constrained
sequence may sample next (one bit per token) and the sampler masks the others out of the logits; the scheduler then
feeds it the tokens chosen, and ends the sequence when its grammar is complete.

A sequence near its length limit (``max_tokens`` or the context) closes its structure instead of being cut: once
the shortest completion of its grammar (:class:`~spindle.backend.grammar_closer.GrammarCloser`) and twice
:data:`CLOSING_MARGIN` take the tokens left, it may sample no token that opens something new (a ``,``, ``{`` or
``[``: a new element would lengthen the closing past the room); once the closing takes all but the margin, the
bitmask allows only that completion's tokens, then eos, so a length finish still parses
(``StructuredOutput.close_at_max_tokens=False`` opts out).

A reasoning model's request (``EngineRequest.grammar_after``) thinks freely first: its sequences sample with no mask
until their output writes the end of the thinking block, and the grammar constrains what follows.

xgrammar imports torch, and building its tokenizer table takes seconds, so nothing here is loaded before the first
constrained request arrives (on the compile pool's thread).
"""

import json
import logging
import math
import time
from collections import OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spindle.backend.grammar_closer import MAX_CHARACTERS, GrammarCloser
from spindle.backend.grammar_compiler import CompileAbandonedError, GrammarCompilePool
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError, RequestRefusedError
from spindle.shared.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarMatcher

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
"""Distinct specs whose compiled grammar (or compile error) is kept; the least recently used goes first."""

CLOSING_MARGIN = 8
"""Tokens of room kept beyond a sequence's shortest closing: it closes once that closing takes all but these of the
tokens left, so a sampled token that lengthens the closing by up to this many still leaves room for it."""

CLOSING_RECHECK = 16
"""Tokens between two searches for a sequence's closing while the limit is still far from it."""

REFUSAL_TTL = 600.0
"""Seconds a spec whose compile ran out of time or crashed its worker stays refused at once, with no new compile:
a client sending the same hostile spec again cannot keep the workers busy, and a spec that only met a busy machine
is tried again ten minutes later."""


@dataclass
class _Cached:
    """A spec's compile, under way or done, and until when (``time.monotonic()``) its outcome is trusted."""

    future: "Future[CompiledGrammar]"
    expires: float = math.inf


@dataclass
class _Limit:
    """A constrained sequence's room before its length limit, and the closing it writes once it must close.

    Attributes:
        tokens_left: the tokens the sequence may still emit.
        check_at: search for its closing again once ``tokens_left`` is this or fewer.
        closing: once it closes, the tokens of its closing still to emit, then eos (``None`` before).

    """

    tokens_left: int
    check_at: int
    closing: list[int] | None = None


@dataclass
class GrammarBitmask:
    """The tokens allowed at each sampled row of the constrained sequences of one step.

    Attributes:
        bitmask: ``[rows, ceil(vocab / 32)]`` int32 on the CPU: bit ``t % 32`` of word ``t // 32`` is set when token
            ``t`` is allowed.
        first_row: by ``seq_id``, the sequence's first row; a sequence with ``d`` drafts has ``d + 1`` rows, row ``i``
            for the token after its first ``i`` drafts.

    """

    bitmask: torch.Tensor
    first_row: dict[int, int]


class StructuredOutputManager:
    """Compiles specs to grammars in worker processes (with a cache), keeps each sequence's matcher, fills bitmasks.

    Args:
        model_dir: the model directory, whose tokenizer files xgrammar reads to map grammar bytes to token ids.
        vocab_size: the model's vocabulary (rows of the lm head): the width of the bitmask.
        eos_token_ids: the tokens that end a sequence; a matcher accepts them once its grammar is complete.
        compile_workers: worker processes that compile specs (started at the first constrained request).
        compile_timeout: seconds one compile may take before its request is refused.

    """

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        eos_token_ids: list[int],
        compile_workers: int = 2,
        compile_timeout: float = 10.0,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.compiler = GrammarCompilePool(
            model_dir, vocab_size, self.eos_token_ids, workers=compile_workers, timeout=compile_timeout
        )
        self._grammars: OrderedDict[tuple[str, str], _Cached] = OrderedDict()
        # Request id -> (its grammar being compiled, its sequences' ids); then each sequence's matcher.
        self._compiling: dict[str, tuple[Future[CompiledGrammar], list[int]]] = {}
        self._matchers: dict[int, GrammarMatcher] = {}
        # By seq_id, the output a resumed sequence had generated: its matcher accepts it before the sequence runs.
        self._replays: dict[int, list[int]] = {}
        # By seq_id, the room left to each sequence that closes its structure at its limit.
        self._limits: dict[int, _Limit] = {}
        # By seq_id, the sequences still thinking: the tokens that end their thinking, and their last tokens.
        self._thinking: dict[int, tuple[list[int], deque[int]]] = {}
        self._closer: GrammarCloser | None = None

    def add_request(
        self,
        request_id: str,
        seq_ids: list[int],
        spec: StructuredOutput,
        replay: dict[int, list[int]] | None = None,
        tokens_left: dict[int, int] | None = None,
        after: list[int] | None = None,
    ) -> None:
        """Start compiling a request's spec; its sequences wait until :meth:`collect` finds it compiled.

        ``replay`` holds, by ``seq_id``, the output of each sequence of a resumed request that had generated some;
        ``tokens_left``, the tokens each sequence may still emit, when the spec closes at the limit; ``after``, the
        tokens that end a reasoning model's thinking, which the grammar constrains the output after.
        """
        self._compiling[request_id] = (self.compile(spec), seq_ids)
        self._replays.update(replay or {})
        if after:
            self._thinking.update({seq_id: (after, deque(maxlen=len(after))) for seq_id in seq_ids})
        if spec.close_at_max_tokens:
            check_at = MAX_CHARACTERS + 2 * CLOSING_MARGIN  # no closing is longer: no search before
            self._limits.update({seq_id: _Limit(left, check_at) for seq_id, left in (tokens_left or {}).items()})

    def remove_request(self, request_id: str, seq_ids: list[int]) -> None:
        """Forget a request (finished or aborted): its compile, if under way, and its sequences' matchers."""
        self._compiling.pop(request_id, None)
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)
            self._replays.pop(seq_id, None)
            self._limits.pop(seq_id, None)
            self._thinking.pop(seq_id, None)

    def is_compiling(self, request_id: str) -> bool:
        """Whether the request's grammar is not compiled yet (its sequences may not run)."""
        return request_id in self._compiling

    def collect(self) -> list[tuple[str, RequestRefusedError]]:
        """Give the sequences of each request whose grammar has compiled their matchers; the others' refusals.

        A resumed sequence's matcher accepts its output so far first. A refused request (its spec does not compile,
        or a resumed output does not follow it) is forgotten here; its sequences are the caller's to drop.
        """
        refused = []
        for request_id, (future, seq_ids) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                error = self._start_matchers(future.result(), seq_ids)
            if error is not None:
                assert isinstance(error, RequestRefusedError)
                refused.append((request_id, error))
        return refused

    def _start_matchers(self, grammar: "CompiledGrammar", seq_ids: list[int]) -> InvalidRequestError | None:
        """Give each sequence its matcher, past its replayed output; why not, if an output does not follow it."""
        matchers = {seq_id: self.matcher(grammar) for seq_id in seq_ids}
        if self._closer is None and any(seq_id in self._limits for seq_id in seq_ids):
            self._closer = GrammarCloser(grammar.tokenizer_info)
        replays = {seq_id: self._after_thinking(seq_id, self._replays.pop(seq_id, [])) for seq_id in seq_ids}
        for seq_id, matcher in matchers.items():
            if not all(matcher.accept_token(token_id) for token_id in replays[seq_id]) or matcher.is_terminated():
                return InvalidRequestError(
                    "resumed", "a resumed completion's output does not follow its grammar, or completes it"
                )
        self._matchers.update(matchers)
        return None

    def _after_thinking(self, seq_id: int, output: list[int]) -> list[int]:
        """The part of ``output`` that the sequence's grammar constrains: what follows the end of its thinking."""
        for i, token_id in enumerate(output):
            if seq_id not in self._thinking:
                return output[i:]
            self._think(seq_id, token_id)
        return []

    def _think(self, seq_id: int, token_id: int) -> None:
        """Follow a thinking sequence's token; once its output ends the thinking block, its grammar applies."""
        end, last = self._thinking[seq_id]
        last.append(token_id)
        if list(last) == end:
            del self._thinking[seq_id]

    def wait_for_compile(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a compile under way to end (at once when none is)."""
        if self._compiling:
            wait([future for future, _ in self._compiling.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def is_constrained(self, seq_id: int) -> bool:
        """Whether the sequence samples under a grammar (compiled, and past its thinking)."""
        return seq_id in self._matchers and seq_id not in self._thinking

    def follows(self, seq_id: int) -> bool:
        """Whether :meth:`advance` must see the sequence's tokens: it has a grammar, now or after its thinking."""
        return seq_id in self._matchers

    def allowed_drafts(self, seq_id: int, drafts: list[int]) -> list[int]:
        """The leading ``drafts`` that the sequence's grammar accepts (all of them for an unconstrained sequence).

        Drafts it forbids would be rejected anyway, and the bitmask rows after them would be those of a dead end. Near
        its limit a sequence gets none: its closing is searched for, and written, a token a step.
        """
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return drafts
        if seq_id in self._thinking:
            return self._thinking_drafts(seq_id, drafts)
        limit = self._limits.get(seq_id)
        if limit is not None:
            drafts = drafts[: max(0, limit.tokens_left - limit.check_at - 1)] if limit.closing is None else []
        accepted = 0
        for token_id in drafts:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
        matcher.rollback(accepted)
        return drafts[:accepted]

    def _thinking_drafts(self, seq_id: int, drafts: list[int]) -> list[int]:
        """The drafts of a thinking sequence short of the last token that would end its thinking.

        The token after the last draft is sampled in the same step, with no mask: were the thinking to end at a
        draft, that token would escape the grammar.
        """
        end, last = self._thinking[seq_id]
        window = deque(last, maxlen=len(end))
        for i, token_id in enumerate(drafts):
            window.append(token_id)
            if list(window) == end:
                return drafts[:i]
        return drafts

    def advance(self, request_id: str, seq_id: int, token_id: int) -> bool:
        """Feed a sampled token to the sequence's matcher; whether the sequence must end there.

        It ends when its grammar is complete, or when the token does not continue it: only a token outside the mask
        gets that far (``min_tokens`` held back eos where the grammar allowed nothing else, or every allowed token had
        a logit of -inf); the output so far is a valid prefix, so it stops there. A token of a sequence still thinking
        only brings it nearer the end of its thinking.
        """
        matcher = self._matchers[seq_id]
        limit = self._limits.get(seq_id)
        if limit is not None:
            limit.tokens_left -= 1
            if limit.closing and limit.closing[0] == token_id:
                limit.closing.pop(0)
            elif limit.closing:  # something else was sampled (min_tokens held eos back): search again
                limit.closing, limit.check_at = None, limit.tokens_left
        if seq_id in self._thinking:
            self._think(seq_id, token_id)
            return False
        if not matcher.accept_token(token_id):
            logger.warning(
                "Token %d does not continue the grammar: ending the completion",
                token_id,
                extra={"request_id": request_id},
            )
            return True
        return matcher.is_terminated()

    def bitmask(self, scheduled: SchedulerOutput) -> GrammarBitmask | None:
        """The tokens allowed at each row that the step's constrained sequences sample (``None`` without any).

        A sequence with drafts gets a row per draft, each filled after accepting the drafts before it; they are
        rolled back after, as the scheduler accepts the tokens the step really emits.
        """
        if not scheduled.grammar_seq_ids:
            return None
        import xgrammar

        drafts = [scheduled.spec_token_ids.get(seq_id, []) for seq_id in scheduled.grammar_seq_ids]
        mask = xgrammar.allocate_token_bitmask(len(drafts) + sum(map(len, drafts)), self.vocab_size)
        first_row, row = {}, 0
        for seq_id, seq_drafts in zip(scheduled.grammar_seq_ids, drafts, strict=True):
            matcher = self._matchers[seq_id]
            first_row[seq_id] = row
            closing = self._closing_token(seq_id, matcher)
            if closing is not None:  # near the limit: the closing's token, and (unless forced) what opens nothing
                token_id, forced = closing
                if forced:
                    mask[row] = 0
                else:
                    assert self._closer is not None
                    matcher.fill_next_token_bitmask(mask, row)
                    mask[row] &= ~self._closer.openers
                mask[row, token_id // 32] |= _int32(1 << token_id % 32)
                row += 1
                continue
            for i in range(len(seq_drafts) + 1):
                matcher.fill_next_token_bitmask(mask, row + i)
                if i < len(seq_drafts):
                    matcher.accept_token(seq_drafts[i])
            matcher.rollback(len(seq_drafts))
            row += len(seq_drafts) + 1
        return GrammarBitmask(mask, first_row)

    def _closing_token(self, seq_id: int, matcher: "GrammarMatcher") -> tuple[int, bool] | None:
        """The next token of the sequence's closing, and whether it must be the one sampled; ``None`` while far off.

        Searched for (:class:`~spindle.backend.grammar_closer.GrammarCloser`) once the tokens left are within the
        longest closing it finds (:data:`~spindle.backend.grammar_closer.MAX_CHARACTERS`) and twice the margin, then
        every :data:`CLOSING_RECHECK` tokens (four times that after a search that found none), then every step once
        its closing and :data:`CLOSING_MARGIN` twice over take all the room left: the sequence is near, it opens
        nothing more. Once the closing takes all but :data:`CLOSING_MARGIN`, its tokens are emitted one a step,
        then eos.
        """
        limit = self._limits.get(seq_id)
        if limit is None:
            return None
        if limit.closing is None and limit.tokens_left <= limit.check_at:
            assert self._closer is not None
            closing = self._closer.closing(matcher)
            if closing is None:  # too long, or not found: the search is costly, so not again soon
                limit.check_at = limit.tokens_left - 4 * CLOSING_RECHECK
            else:
                ending = closing + self.eos_token_ids[:1]
                if len(closing) + CLOSING_MARGIN >= limit.tokens_left:
                    limit.closing = ending
                else:
                    near = len(closing) + 2 * CLOSING_MARGIN
                    limit.check_at = max(near, limit.tokens_left - CLOSING_RECHECK)
                    return (ending[0], False) if limit.tokens_left <= near and ending else None
        return (limit.closing[0], True) if limit.closing else None

    def compile(self, spec: StructuredOutput) -> "Future[CompiledGrammar]":
        """The compiled grammar of ``spec``, now or later: a finished future when it is cached.

        The future's exception, when the spec does not compile, is an
        :class:`~spindle.shared.errors.InvalidRequestError` for ``sampling_params.structured_output.<kind>`` with the
        compiler's message (a :class:`~spindle.backend.grammar_compiler.CompileAbandonedError` when the compile ran
        out of time or crashed its worker: cached for :data:`REFUSAL_TTL`); when xgrammar cannot load the model's
        tokenizer or the workers cannot start, an :class:`~spindle.shared.errors.EngineUnavailableError` (not
        cached).
        """
        key = (spec.kind, _spec_text(spec))
        cached = self._grammars.get(key)
        if cached is not None and cached.future.done() and time.monotonic() >= cached.expires:
            cached = None
        if cached is None:
            cached = _Cached(self.compiler.submit(*key))
            cached.future.add_done_callback(lambda future, cached=cached: _set_expiry(cached, future))
            self._grammars[key] = cached
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return cached.future

    def matcher(self, grammar: "CompiledGrammar") -> "GrammarMatcher":
        """A fresh matcher of ``grammar`` for one sequence, at the start of its output."""
        import xgrammar

        return xgrammar.GrammarMatcher(grammar, override_stop_tokens=self.eos_token_ids)

    def shutdown(self) -> None:
        """Stop the compile workers (a compile under way is killed); the engine constrains nothing after it."""
        self.compiler.shutdown()


def _set_expiry(cached: _Cached, future: "Future[CompiledGrammar]") -> None:
    """Bound how long a finished compile's outcome is trusted.

    A grammar or a compile error for good, an abandoned compile for :data:`REFUSAL_TTL`, an unavailable backend not
    at all (the next request tries again).
    """
    error = future.exception()
    if isinstance(error, CompileAbandonedError):
        cached.expires = time.monotonic() + REFUSAL_TTL
    elif isinstance(error, EngineUnavailableError):
        cached.expires = -math.inf


def _int32(word: int) -> int:
    """A 32-bit mask word as the bitmask's int32 holds it (bit 31 is the sign)."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _spec_text(spec: StructuredOutput) -> str:
    """The spec as the compiler takes it: a schema, a regex or an EBNF grammar (choices become one)."""
    if spec.json_object:
        return '{"type": "object"}'
    if spec.choice is not None:
        # JSON string literals are valid EBNF ones (the same escapes); non-ASCII text stays as it is.
        return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
    value = getattr(spec, spec.kind)
    assert isinstance(value, str)  # a dict schema became JSON text when the spec was built
    return value
