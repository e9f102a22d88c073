"""A scheduler driven by a fake model runner, for the scheduler's tests (tests/test_scheduler.py, tests/test_lora.py).

:func:`fake_step` schedules, checks that a runner's state of each sequence built from the scheduler outputs alone is
the sequence itself, and applies a fake runner output through ``update_from_output``, as the engine core does.
"""

import weakref
from dataclasses import dataclass
from pathlib import Path

from spindle import SamplingParams
from spindle.backend.block_manager import BlockManager
from spindle.backend.runner_output import RunnerOutput
from spindle.backend.runner_state import SequenceState, apply_scheduler_output
from spindle.backend.scheduler import Scheduler
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.backend.sequence import Sequence
from spindle.backend.speculative import DraftProposer
from spindle.backend.structured_output import StructuredOutputManager
from spindle.shared.config import SchedulerConfig


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 32,
    slowdown: float = 0.0,
    policy: str = "fcfs",
    aging: float = 0.0,
    long_threshold: int = 0,
    max_loras: int | None = None,
) -> Scheduler:
    structured_output = StructuredOutputManager(Path(), vocab_size=1000, eos_token_ids=[])  # nothing is compiled
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_decode_slowdown=slowdown,
        long_prefill_token_threshold=long_threshold,
        scheduling_policy=policy,
        priority_aging=aging,
    )
    return Scheduler(
        config,
        BlockManager(num_blocks, block_size),
        max_loras=max_loras,
        max_model_len=1_000_000,
        eos_token_ids=(),
        structured_output=structured_output,
        drafter=DraftProposer(1_000_000, structured_output),
    )


def add(
    sched: Scheduler,
    prompt_len: int,
    max_tokens: int = 4,
    first_token: int = 0,
    priority: int = 0,
    arrival: float = 0.0,
) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    seq = Sequence(f"r{first_token}", 0, prompt, SamplingParams(max_tokens=max_tokens), arrival, priority)
    sched.add_request([seq])
    return seq


@dataclass
class Step:
    """One step as the tests read it: the scheduled sequences and their token counts, in schedule order."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    out: SchedulerOutput

    def __len__(self) -> int:
        return len(self.seqs)


# Each scheduler's fake runner: its state of each sequence, built from the outputs alone, as the model runner's is.
RUNNER_STATES: "weakref.WeakKeyDictionary[Scheduler, dict[int, SequenceState]]" = weakref.WeakKeyDictionary()


def fake_step(sched: Scheduler) -> Step:
    """Schedule, then apply the output of a fake runner whose next token is a function of the context.

    The runner's state of each scheduled sequence, kept from the scheduler outputs alone, must be the sequence's:
    its tokens, block table and computed tokens.
    """
    out = sched.schedule()
    step = Step(
        [sched.seqs[seq_id] for seq_id in out.num_scheduled_tokens], list(out.num_scheduled_tokens.values()), out
    )
    states = apply_scheduler_output(RUNNER_STATES.setdefault(sched, {}), out, sched.block_manager.block_size)
    for seq, state in zip(step.seqs, states, strict=True):
        assert (state.token_ids, state.block_table) == (seq.token_ids, seq.block_table)
        assert state.num_computed_tokens == seq.num_computed_tokens
    sampled = {}
    for seq, n in zip(step.seqs, step.num_new_tokens, strict=True):
        assert seq.num_computed_tokens + n <= len(seq)
        assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_computed_tokens + n
        if seq.num_computed_tokens + n == len(seq):
            sampled[seq.seq_id] = [sum(seq.token_ids) % 1000]
    sched.update_from_output(out, RunnerOutput(sampled_token_ids=sampled))
    return step


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[Step]:
    batches = []
    while sched.has_unfinished():
        batches.append(fake_step(sched))
        assert len(batches) < max_steps
    return batches
