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
"""

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


class DraftProposer:
    """Proposes the drafts of the decoding sequences that speculate, and keeps the acceptance counts.

    Args:
        max_model_len: the context length: a step never computes a draft past it.
        structured_output: trims a constrained sequence's drafts to what its grammar accepts.

    Attributes:
        num_draft_tokens: the drafts verified since start-up.
        num_accepted_draft_tokens: those the model agreed with.

    """

    def __init__(self, max_model_len: int, structured_output: "StructuredOutputManager") -> None:
        self.max_model_len = max_model_len
        self.structured_output = structured_output
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0

    def propose(self, running: Iterable["Sequence"]) -> dict[int, list[int]]:
        """By ``seq_id``, the drafts of each decoding sequence that asks for ``num_speculative_tokens`` and finds some.

        Never past ``max_tokens`` or the context: a step emits up to one token more than its drafts.
        """
        drafts = {}
        for seq in running:
            wanted = seq.params.num_speculative_tokens
            if wanted and len(seq) - seq.num_computed_tokens == 1:
                wanted = min(wanted, seq.tokens_left(self.max_model_len) - 1)
                proposed = self.structured_output.allowed_drafts(seq.seq_id, propose(seq.token_ids, wanted))
                if proposed:
                    drafts[seq.seq_id] = proposed
        return drafts

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Count one sequence's verified drafts, ``num_accepted`` of them accepted."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_draft_tokens += num_accepted
