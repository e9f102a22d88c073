"""Embeddings: a prompt's final-norm hidden states pooled into one vector, chunk by chunk as the prompt is prefilled.

An embedding sequence (``pooling`` set) is prefilled like any prompt, in chunks that share steps with other
requests. After each chunk the runner updates the sequence's pooling state (:func:`pool`), which it keeps in its
:class:`~spindle.backend.runner_state.SequenceState`: the running float32 sum of its hidden states for ``mean``, the
first position's for ``cls``, the latest position's for ``last``. The chunk that completes the prompt turns the state
into the embedding (:func:`finalize`); nothing is sampled, and the scheduler then ends the sequence, which frees its
blocks.
"""

import torch
import torch.nn.functional as F

from spindle.backend.runner_state import SequenceState
from spindle.shared.pooling_params import PoolingParams


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


def pool(states: list[SequenceState], query_start_loc: list[int], hidden: torch.Tensor) -> dict[int, torch.Tensor]:
    """Pool this step's chunks of the embedding sequences among ``states``; the embeddings of those it completed.

    Args:
        states: the step's sequences in batch order, with ``num_computed_tokens`` as before the step. An embedding
            sequence whose prompt is not complete keeps its new pooling state for the next chunk.
        query_start_loc: where each sequence's chunk starts in the flat batch, and the batch's end.
        hidden: the step's final-norm hidden states ``[num_tokens, hidden_size]``.

    Returns:
        By ``seq_id``, each completed prompt's embedding: float32 ``[dimensions]`` on the model's device.

    """
    embeddings = {}
    for i, state in enumerate(states):
        if state.pooling is None:
            continue
        first, last = query_start_loc[i], query_start_loc[i + 1]
        start = state.num_computed_tokens
        pooled = accumulate(state.pooling.pooling or "last", state.pooling_state, hidden[first:last], start)
        if start + last - first < len(state):
            state.pooling_state = pooled
        else:
            state.pooling_state = None
            embeddings[state.seq_id] = finalize(pooled, state.pooling, len(state))
    return embeddings
