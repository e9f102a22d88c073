"""Continuous batching: which sequences run in the next step, and how many tokens each contributes."""

from collections import deque
from dataclasses import dataclass

from spindle.backend.block_manager import BlockManager
from spindle.backend.sequence import Sequence, SequenceStatus
from spindle.shared import FinishReason


@dataclass
class ScheduledBatch:
    """One step's work: each sequence with the number of its tokens to compute now.

    A decode contributes 1 token; a prefill contributes a chunk of its uncomputed prompt (chunked prefill).
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_preempted: int = 0

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """First-come-first-served scheduling under a token budget, with chunked prefill and preemption by recompute.

    Running sequences (decodes, and prefills already under way) go first, oldest first. When the cache is out of
    blocks, the newest running sequence is preempted: its blocks are freed and it goes back to the front of the
    waiting queue to be recomputed later (its full blocks usually come back from the prefix cache). Waiting
    sequences are admitted while the budget, ``max_num_seqs`` and the free blocks allow, and never in a step that
    had to preempt.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts, allocating their blocks."""
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, num_new)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.num_preempted:
            seq = self.waiting[0]
            if seq.params.prompt_logprobs is None:
                # Prompt logprobs need logits at every prompt position, so those prompts skip the prefix cache.
                self.block_manager.match_prefix(seq)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                self.block_manager.free_blocks(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.block_manager.allocate(seq, num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | None = None) -> None:
        """End ``seq`` (eos, stop token, length or abort) and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free_blocks(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.block_manager.free_blocks(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
