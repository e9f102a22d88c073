"""Embeddings: a prompt's final-norm hidden states pooled into one vector, chunk by chunk as the prompt is prefilled.

An embedding sequence (``seq.pooling`` set) is prefilled like any prompt, in chunks that share steps with other
requests. After each chunk the runner updates the sequence's pooling state (:func:`pool`): the running float32 sum of
its hidden states for ``mean``, the first position's for ``cls``, the latest position's for ``last``. The chunk that
completes the prompt turns the state into the embedding (:func:`finalize`); nothing is sampled, and the engine core
then ends the sequence, which frees its blocks.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from spindle.backend.sequence import Sequence
from spindle.shared.pooling_params import PoolingParams


@dataclass
class PooledStep:
    """What one step's chunks did for the embedding sequences in it.

    Attributes:
        states: by ``seq_id``, the pooling state of each sequence whose prompt is not complete yet (float32
            ``[hidden_size]`` on the model's device): the engine core keeps it as ``seq.pooling_state`` for the next
            chunk.
        finished: the sequences whose prompt this step completed.
        embeddings: their embeddings, row for row: float32 ``[dimensions]`` on the model's device.

    """

    states: dict[int, torch.Tensor] = field(default_factory=dict)
    finished: list[Sequence] = field(default_factory=list)
    embeddings: list[torch.Tensor] = field(default_factory=list)


def accumulate(pooling: str, state: torch.Tensor | None, chunk: torch.Tensor, start: int) -> torch.Tensor:
    """The pooling state after a chunk of hidden states ``[n, hidden_size]`` starting at prompt position ``start``.

    A chunk at position 0 starts afresh, whatever ``state`` holds (a preempted sequence is recomputed from the start).
    ``mean`` and ``cls`` see every position, as their sequences skip the prefix cache; ``last`` only needs the
    chunk that ends the prompt, which is always computed.

    Args:
        pooling: ``"last"``, ``"mean"`` or ``"cls"``.
        state: the state after the previous chunk (None before the first).
        chunk: the chunk's hidden states.
        start: the position of the chunk's first token.

    """
    if pooling == "mean":
        total = chunk.sum(dim=0, dtype=torch.float32)
        return total if start == 0 or state is None else state + total
    if pooling == "cls" and start > 0 and state is not None:
        return state
    # A copy: the hidden states of a decode-sized step are a CUDA graph's output, overwritten by its next replay.
    row = chunk[0] if pooling == "cls" else chunk[-1]
    return row.to(torch.float32, copy=True)


def finalize(state: torch.Tensor, params: PoolingParams, num_tokens: int) -> torch.Tensor:
    """The embedding of a complete prompt of ``num_tokens`` tokens from its pooling state.

    ``mean`` divides the sum by the number of tokens; the vector is then cut to ``params.dimensions`` and, with
    ``params.normalize``, scaled to unit L2 norm (after the cut, so that a truncated embedding has unit norm too).
    """
    if params.pooling == "mean":
        state = state / num_tokens
    if params.dimensions is not None:
        state = state[: params.dimensions]
    if params.normalize:
        state = F.normalize(state, dim=0)
    return state


def pool(seqs: list[Sequence], query_start_loc: list[int], hidden: torch.Tensor) -> PooledStep:
    """Pool this step's chunks of the embedding sequences among ``seqs``.

    Args:
        seqs: the step's sequences in batch order, with ``num_computed_tokens`` as before the step.
        query_start_loc: where each sequence's chunk starts in the flat batch, and the batch's end.
        hidden: the step's final-norm hidden states ``[num_tokens, hidden_size]``.

    """
    step = PooledStep()
    for i, seq in enumerate(seqs):
        if seq.pooling is None:
            continue
        first, last = query_start_loc[i], query_start_loc[i + 1]
        start = seq.num_computed_tokens
        # The runner only reads the sequences: the engine core stores the new state on them.
        state = accumulate(seq.pooling.pooling or "last", seq.pooling_state, hidden[first:last], start)
        if start + last - first < len(seq):
            step.states[seq.seq_id] = state
        else:
            step.finished.append(seq)
            step.embeddings.append(finalize(state, seq.pooling, len(seq)))
    return step
