"""Speculative decoding by prompt lookup: draft tokens from the sequence itself, verified exactly by the model.

A sequence that asks for ``num_speculative_tokens`` gets, before each step, the tokens that followed the most
recent earlier occurrence of its last ``n`` tokens (``n`` from :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`): when
the output copies from the prompt, as summaries, edits and code do, those are the tokens it is about to write. The
step computes the last token and the drafts in one pass (like a short prefill chunk), and
:func:`accepted_tokens` keeps what the model would have produced itself.

:class:`DraftProposer` owns speculation's state: it proposes each step's drafts (the scheduler fits them into the
budget and the runner verifies them) and counts the drafts verified and accepted. A step's drafts live in its
:class:`~spindle.backend.scheduler_output.SchedulerOutput` alone; the scheduler gives back the rejected ones' cache
slots when it applies the step's output.

A draft is not free: verifying it adds a token to the step. Where a step reads the weights from memory (one stream on
a CPU with VNNI, or on a GPU) a few more tokens cost almost nothing, but where the projections are compute-bound (a
batch, or one stream on an AVX2 CPU: bench/results/single_stream.md) a rejected draft costs as much as a token. So
by default each step verifies only the drafts that pay for themselves (:meth:`DraftProposer.worth_verifying`): it
weighs each draft's chance of being accepted, learned per sequence (:class:`Acceptance`), against the step's seconds
by its token count, learned from the steps run (:class:`StepCosts`), and keeps the drafts that give the most
expected tokens per second.
"""

import bisect
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from spindle.backend.sequence import Sequence
    from spindle.backend.structured_output import StructuredOutputManager

MAX_NGRAM = 4
"""The longest suffix looked up: a longer match predicts better, so lookup starts there."""

MIN_NGRAM = 2
"""The shortest suffix looked up. A single token recurs too often to predict what follows it, and on a CPU a
rejected draft is not free (SmolLM2's int4 projections: 7.7 ms for one token, 9.2 for four)."""


def propose(token_ids: list[int], num_tokens: int) -> list[int]:
    """Up to ``num_tokens`` draft tokens: what followed the latest earlier occurrence of the longest suffix n-gram.

    Args:
        token_ids: the sequence so far (prompt and output).
        num_tokens: the most drafts wanted.

    Returns:
        The drafts, possibly fewer than asked or none (no earlier occurrence of even a :data:`MIN_NGRAM` suffix).

    """
    if num_tokens <= 0 or len(token_ids) <= MIN_NGRAM:
        return []
    tokens = np.asarray(token_ids)
    for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
        # Windows that start early enough to be followed by at least one token, the suffix itself excluded.
        windows = sliding_window_view(tokens[:-1], n)
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start : start + num_tokens].tolist()
    return []


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step emits: the drafts the model agreed with, then its own token where it first disagreed.

    ``sampled[i]`` is the token the sampler drew at draft position ``i`` (``len(drafts) + 1`` of them, the last
    after every draft), each with the sequence's own sampling rules, as if the drafts before it were output. The
    draft distribution is a point mass, so accepting draft ``x`` exactly when the sampler drew ``x`` accepts it with
    probability ``p(x)``, and the sampler's other outcomes are distributed as ``p`` without ``x``: the residual
    distribution of speculative sampling. Greedy rows draw the argmax, so greedy output is that of plain decoding.
    """
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[: i + 1]
    return sampled[: len(drafts) + 1]


COST_SMOOTHING = 0.2
"""The newest step's weight in :class:`StepCosts`' running average of a token count's seconds."""

ACCEPTANCE_PRIOR = 0.8
"""The chance assumed that a draft is accepted, once the drafts before it were, before any draft was verified:
optimistic, so that drafting is tried (and its worth measured) rather than ruled out by a guess."""

PRIOR_WEIGHT = 4.0
"""How many verified drafts the prior is worth in an estimate of acceptance: a sequence's own few steps soon
outweigh the engine's rate, which soon outweighs :data:`ACCEPTANCE_PRIOR`."""

EXPLORE_EVERY = 64
"""Every this many steps with drafts, the sequence whose drafts have the best chance verifies all of its drafts,
whatever the estimates say, so that the counts the drafter stopped choosing stay measured: a count timed once on a
slow step (another process's burst, a collection) would otherwise never be tried again. It costs one sequence's
drafts every 64 steps."""


class StepCosts:
    """The seconds of a step by the number of tokens it computes: a running average per count, from the steps run.

    A count never measured is estimated from the measured ones: between two, on the line through them; above them all,
    at the largest one's seconds (a guess that errs cheap, so that the drafter tries such a step and so measures it);
    below them all, at the smallest one's.
    """

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.counts: list[int] = []  # the measured counts, sorted

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Learn from a step of ``num_tokens`` tokens that took ``seconds``."""
        known = self.seconds.get(num_tokens)
        if known is None:
            bisect.insort(self.counts, num_tokens)
        self.seconds[num_tokens] = seconds if known is None else known + COST_SMOOTHING * (seconds - known)

    def estimates(self, first: int, last: int) -> np.ndarray | None:
        """The estimated seconds of steps of ``first`` to ``last`` tokens; None until one of at most ``last`` ran."""
        if not self.counts or self.counts[0] > last:
            return None
        # The measured counts that bound the range, and those within it.
        start = max(bisect.bisect_right(self.counts, first) - 1, 0)
        counts = self.counts[start : bisect.bisect_left(self.counts, last) + 1]
        return np.interp(np.arange(first, last + 1), counts, [self.seconds[n] for n in counts])


class Acceptance:
    """How often drafts are accepted, as a chance per draft given that the drafts before it were.

    A sequence's estimate is its own record with the engine's rate as a prior worth :data:`PRIOR_WEIGHT` drafts (a
    summary copies its input, a story does not); the engine's, its record with :data:`ACCEPTANCE_PRIOR` as the prior.
    A draft is *tried* when every draft before it in its step was accepted.
    """

    def __init__(self) -> None:
        self.accepted = 0
        self.tried = 0
        self.by_seq: dict[int, tuple[int, int]] = {}

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """Count a step's verified drafts of ``seq_id``, ``num_accepted`` of them accepted."""
        tried = num_accepted + (num_accepted < num_drafts)
        accepted, seq_tried = self.by_seq.get(seq_id, (0, 0))
        self.by_seq[seq_id] = (accepted + num_accepted, seq_tried + tried)
        self.accepted += num_accepted
        self.tried += tried

    def rate(self, seq_id: int) -> float:
        """The chance that a draft of ``seq_id`` is accepted, given the drafts before it were."""
        engine = (self.accepted + PRIOR_WEIGHT * ACCEPTANCE_PRIOR) / (self.tried + PRIOR_WEIGHT)
        accepted, tried = self.by_seq.get(seq_id, (0, 0))
        return (accepted + PRIOR_WEIGHT * engine) / (tried + PRIOR_WEIGHT)

    def forget(self, seq_id: int) -> None:
        """Drop the record of ``seq_id`` (the engine's rate keeps its drafts)."""
        self.by_seq.pop(seq_id, None)


class DraftProposer:
    """Proposes the drafts of the decoding sequences that speculate, and keeps the acceptance counts.

    Args:
        max_model_len: the context length: a step never computes a draft past it.
        structured_output: trims a constrained sequence's drafts to what its grammar accepts.
        adaptive: verify only the drafts that pay for themselves (:meth:`worth_verifying`); False: every proposal
            up to its sequence's ``num_speculative_tokens``.

    Attributes:
        num_draft_tokens: the drafts verified since start-up.
        num_accepted_draft_tokens: those the model agreed with.

    """

    def __init__(self, max_model_len: int, structured_output: "StructuredOutputManager", adaptive: bool = True) -> None:
        self.max_model_len = max_model_len
        self.structured_output = structured_output
        self.adaptive = adaptive
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.costs = StepCosts()
        self.acceptance = Acceptance()
        self.steps_with_drafts = 0

    def propose(self, running: Iterable["Sequence"]) -> dict[int, list[int]]:
        """By ``seq_id``, the drafts of each decoding sequence that asks for ``num_speculative_tokens`` and finds some.

        Never past ``max_tokens`` or the context: a step emits up to one token more than its drafts. Adaptive, only
        those worth verifying.
        """
        drafts, decodes = {}, 0
        for seq in running:
            if len(seq) - seq.num_computed_tokens != 1:
                continue
            decodes += 1
            wanted = seq.params.num_speculative_tokens
            if wanted:
                wanted = min(wanted, seq.tokens_left(self.max_model_len) - 1)
                proposed = self.structured_output.allowed_drafts(seq.seq_id, propose(seq.token_ids, wanted))
                if proposed:
                    drafts[seq.seq_id] = proposed
        if not self.adaptive or not drafts:
            return drafts
        return self.worth_verifying(drafts, decodes)

    def worth_verifying(self, drafts: dict[int, list[int]], num_decodes: int) -> dict[int, list[int]]:
        """The first drafts of each sequence that give a step of ``num_decodes`` decodes the most tokens per second.

        The ``i``-th draft of a sequence is accepted with the chance ``rate ** i`` (:class:`Acceptance`); drafts are
        taken best chance first, and the step keeps as many as maximise ``(num_decodes + their chances) / seconds``,
        its seconds those of a step of ``num_decodes`` tokens plus the drafts (:class:`StepCosts`). Every
        :data:`EXPLORE_EVERY` calls, the best chance's sequence keeps all of its drafts.
        """
        self.steps_with_drafts += 1
        rates = {seq_id: self.acceptance.rate(seq_id) for seq_id in drafts}
        chances = sorted(
            ((rates[seq_id] ** i, seq_id) for seq_id, d in drafts.items() for i in range(1, len(d) + 1)), reverse=True
        )
        costs = self.costs.estimates(num_decodes, num_decodes + len(chances))
        if costs is None:  # no step measured yet: try them all
            return drafts
        best, expected = 0, float(num_decodes)
        best_rate = expected / costs[0]
        for m, (chance, _) in enumerate(chances, 1):
            expected += chance
            if expected / costs[m] > best_rate:
                best, best_rate = m, expected / costs[m]
        counts = Counter(seq_id for _, seq_id in chances[:best])
        if self.steps_with_drafts % EXPLORE_EVERY == 0:
            counts[chances[0][1]] = len(drafts[chances[0][1]])
        return {seq_id: d[: counts[seq_id]] for seq_id, d in drafts.items() if counts[seq_id]}

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Learn from a step that computed ``num_tokens`` tokens in ``seconds``."""
        self.costs.observe(num_tokens, seconds)

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """Count one sequence's verified drafts, ``num_accepted`` of them accepted."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted
        self.acceptance.record(seq_id, num_drafts, num_accepted)

    def forget(self, seq_id: int) -> None:
        """Drop what was learned of a sequence that finished."""
        self.acceptance.forget(seq_id)
