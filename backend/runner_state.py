"""The model runner's own state of each sequence it runs, kept from step to step by ``seq_id``.

Created from a :class:`~spindle.backend.scheduler_output.NewSequence` and brought up to date by each
:class:`~spindle.backend.scheduler_output.CachedSequence` (:meth:`SequenceState.update`), it holds what the runner
needs to build a step's inputs and sample: the tokens, the block table, and what its features keep between steps
(the pooling state of an embedding sequence, the prompt log-probabilities computed so far). It is the runner's alone:
the scheduler never sees it, and the runner never sees the scheduler's sequences.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from spindle.backend.scheduler_output import CachedSequence, NewSequence, SchedulerOutput
from spindle.shared import SamplingParams, TokenLogprobs
from spindle.shared.pooling_params import PoolingParams
from spindle.shared.protocol import ImageInput


@dataclass
class SequenceState:
    """One sequence as the runner holds it.

    Attributes:
        seq_id: the scheduler's id of the sequence.
        token_ids: its prompt and the tokens generated so far (drafts excluded).
        num_prompt_tokens: the prompt's length.
        params: its sampling parameters.
        seed: the seed its samples draw from, or None.
        block_table: its KV blocks. It only grows in place; any other change replaces the list (the input buffers
            keep a row per table and rewrite it when the list is another).
        num_computed_tokens: the tokens whose K/V is in the cache before the step being run.
        lora_id: its LoRA adapter, or None.
        pooling: how to pool it (an embedding sequence), or None.
        images: the prompt's images at their placeholders.
        prompt_embeds: the prompt's embeddings, ``[prompt tokens, hidden]`` float32, when it was given as them.
        pooling_state: the pooling state after the chunks computed so far (a device tensor), or None.
        prompt_logprobs: the prompt log-probabilities computed so far, when it asked for them.

    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None
    block_table: list[int]
    num_computed_tokens: int
    lora_id: int | None = None
    pooling: PoolingParams | None = None
    images: list[ImageInput] = field(default_factory=list)
    prompt_embeds: np.ndarray | None = None
    pooling_state: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def of(cls, new: NewSequence) -> "SequenceState":
        """The state of a sequence the runner starts (its lists are the new struct's own: it owns them now)."""
        return cls(
            new.seq_id,
            new.token_ids,
            new.num_prompt_tokens,
            new.params,
            new.seed,
            new.block_ids,
            new.num_computed_tokens,
            new.lora_id,
            new.pooling,
            new.images,
            None if new.prompt_embeds is None else new.prompt_embeds.array(),
        )

    def update(self, cached: CachedSequence, block_size: int) -> None:
        """Apply what changed since the sequence was last scheduled.

        Its table first drops the blocks past its computed tokens (the scheduler gave back a speculative step's
        rejected drafts' blocks), then takes the new ones.
        """
        self.token_ids += cached.new_token_ids
        self.num_computed_tokens = cached.num_computed_tokens
        kept = -(-cached.num_computed_tokens // block_size)
        if kept < len(self.block_table):
            self.block_table = self.block_table[:kept] + cached.new_block_ids
        else:
            self.block_table += cached.new_block_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """How many tokens it has generated."""
        return len(self.token_ids) - self.num_prompt_tokens


def apply_scheduler_output(
    states: dict[int, SequenceState], scheduled: SchedulerOutput, block_size: int
) -> list[SequenceState]:
    """Bring the runner's states (by ``seq_id``) up to date with a step's output; the step's, in schedule order.

    Sequences gone since the last step are dropped first: a preempted one may come back new in this step.
    """
    for seq_id in scheduled.finished_seq_ids:
        del states[seq_id]
    for new in scheduled.new_seqs:
        states[new.seq_id] = SequenceState.of(new)
    for cached in scheduled.cached_seqs:
        states[cached.seq_id].update(cached, block_size)
    return [states[seq_id] for seq_id in scheduled.num_scheduled_tokens]
