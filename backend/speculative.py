"""Speculative decoding by prompt lookup: draft tokens from the sequence itself, verified exactly by the model.

A sequence that asks for ``num_speculative_tokens`` gets, before each step, the tokens that followed the most
recent earlier occurrence of its last ``n`` tokens (``n`` from :data:`MAX_NGRAM` down to :data:`MIN_NGRAM`): when
the output copies from the prompt, as summaries, edits and code do, those are the tokens it is about to write. The
step computes the last token and the drafts in one pass (like a short prefill chunk), and
:func:`accepted_tokens` keeps what the model would have produced itself.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
