import random
from itertools import groupby, pairwise

import pytest
from scheduler_harness import add, fake_step, make_scheduler, run_to_completion

from spindle.backend.scheduler import (
    CREDIT_STEPS,
    KEYS_PER_TOKEN,
    PREFIX_KEYS,
    STEP_OVERHEAD,
    WALK_SHARE,
    Scheduler,
)
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.backend.sequence import Sequence, SequenceStatus


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    sched = make_scheduler(budget=32)
    short = add(sched, 5, max_tokens=10)
    fake_step(sched)  # short's prefill
    long = add(sched, 100, first_token=500)
    batches = [fake_step(sched) for _ in range(4)]
    for batch in batches:
        assert batch.seqs[0] is short and batch.num_new_tokens[0] == 1  # running decodes go first
        assert sum(batch.num_new_tokens) <= 32
    assert [b.num_new_tokens[1] for b in batches] == [31, 31, 31, 7]
    assert long.num_output_tokens == 1


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=3, budget=1000)
    for i in range(5):
        add(sched, 4, first_token=10 * i)
    assert len(fake_step(sched).seqs) == 3 and len(sched.waiting) == 2


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_recomputes_and_loses_nothing(policy):
    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = make_scheduler(num_blocks=num_blocks, budget=64, policy=policy)
        seqs = [add(sched, 6 + i, max_tokens=12, first_token=100 * i, priority=-i % 3) for i in range(6)]
        batches = run_to_completion(sched)
        assert sched.block_manager.num_free_blocks == num_blocks
        return {s.request_id: s.token_ids for s in seqs}, sum(b.out.num_preempted for b in batches)

    roomy, roomy_preemptions = outputs(num_blocks=64)
    tight, tight_preemptions = outputs(num_blocks=8)
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_preempted_sequence_goes_back_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old = add(sched, 7, max_tokens=20)
    new = add(sched, 7, max_tokens=20, first_token=50)
    fake_step(sched)
    while new.status is SequenceStatus.RUNNING:
        fake_step(sched)
    assert sched.waiting[0] is new and new.num_computed_tokens == 0 and new.block_table == []
    assert old.status is SequenceStatus.RUNNING


def test_finish_frees_blocks_wherever_the_sequence_is():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    running, waiting = add(sched, 9), add(sched, 9, first_token=30)
    fake_step(sched)
    assert sched.block_manager.num_free_blocks < 16
    for seq in (running, waiting):
        sched.abort_requests([seq.request_id])
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()


def chunk_cost(computed: int, n: int) -> float:
    return n * (1 + (computed + n / 2) / KEYS_PER_TOKEN) + computed / PREFIX_KEYS if n else 0.0


def prefill_beside_streams(sched: Scheduler, prompt_len: int, num_streams: int = 4, scale: float = 1.0) -> list[int]:
    """Prefill a prompt beside decode streams, checking the credit rule at each step; returns the chunk sizes.

    Each step earns ``slowdown - 1`` (here 1) times its decodes' cost, times ``scale`` (prompt-token units per decode
    unit), up to ``CREDIT_STEPS`` steps' worth; its chunk is none while the credit is under ``WALK_SHARE`` times the
    chunk's prefix walk (and under the cap, and short of the whole rest), else the largest that the credit pays for,
    or one token when the credit is full and pays for none.
    """
    streams = [add(sched, 40, max_tokens=100_000, first_token=100_000 * (i + 1)) for i in range(num_streams)]
    fake_step(sched)  # the streams' prefills: no decodes yet, so no bound
    long = add(sched, prompt_len, max_tokens=1, first_token=1)
    chunks, credit = [], 0.0
    while long.num_output_tokens == 0:
        computed = long.num_computed_tokens
        earned = scale * (STEP_OVERHEAD + sum(1 + len(s) / KEYS_PER_TOKEN for s in streams))
        credit = min(credit + earned, CREDIT_STEPS * earned)
        batch = fake_step(sched)
        assert batch.seqs[:num_streams] == streams and batch.num_new_tokens[:num_streams] == [1] * num_streams
        n = batch.num_new_tokens[num_streams] if len(batch) > num_streams else 0
        saving = credit < min(CREDIT_STEPS * earned, WALK_SHARE * computed / PREFIX_KEYS)
        if saving and chunk_cost(computed, prompt_len - computed) > credit:
            assert n == 0
        elif n == 1 and chunk_cost(computed, 1) > credit:
            assert credit == CREDIT_STEPS * earned
        else:
            assert chunk_cost(computed, n) <= credit
            assert n == prompt_len - computed or chunk_cost(computed, n + 1) > credit
        credit -= chunk_cost(computed, n)
        chunks.append(n)
    return chunks


def test_decode_slowdown_bounds_the_prefill_beside_decodes():
    chunks = prefill_beside_streams(make_scheduler(num_blocks=2048, block_size=16, budget=512, slowdown=2.0), 6000)
    # The chunks shrink as the prefix grows (credit left over from a step adds at most one token to the next) until
    # a step's credit no longer covers WALK_SHARE walks over the prefix; from then on the prompt saves up for some.
    saving_from = chunks.index(0)
    assert chunks[0] > 20 and saving_from > 100
    assert all(later <= earlier + 1 for earlier, later in pairwise(chunks[:saving_from]))


def test_a_long_prompt_saves_credit_for_chunks_whose_prefix_walk_outgrows_a_steps_credit():
    """Beside one stream (25 units a step), walking more than 17,500 cached keys costs more than a step earns, and
    walking 4,375 a quarter: the prompt then advances on a few steps' saved credit, never more than the cap's."""
    sched = make_scheduler(num_blocks=2048, block_size=16, budget=512, slowdown=2.0)
    chunks = prefill_beside_streams(sched, 19_000, num_streams=1)
    waits = [len(list(run)) for saving, run in groupby(chunks, key=lambda n: n == 0) if saving]
    assert waits and max(waits) < CREDIT_STEPS and chunks[-1] > 0


def test_the_bound_learns_the_cost_of_decodes_from_step_times():
    """Decode units measured at a quarter of a prompt token's seconds buy a quarter of the prefill."""
    sched = make_scheduler(num_blocks=2048, block_size=16, budget=512, slowdown=2.0)
    sched.observe(SchedulerOutput(decode_cost=30.0), 0.030)  # decodes alone: 1 ms a unit
    sched.observe(SchedulerOutput(decode_cost=30.0, prefill_cost=10.0), 0.030 + 0.040)  # 4 ms a unit
    assert sched.decode_unit_seconds == pytest.approx(0.001) and sched.prefill_unit_seconds == pytest.approx(0.004)
    chunks = prefill_beside_streams(sched, 3000, scale=0.25)
    assert chunks[0] == 7  # a quarter of 28.1 units of decodes: 7 tokens of the empty prefix, 1 unit each


def test_observed_steps_update_a_cost_weighted_running_average():
    sched = make_scheduler(slowdown=2.0)
    sched.observe(SchedulerOutput(decode_cost=10.0), 0.010)
    sched.observe(SchedulerOutput(decode_cost=10.0), 0.020)
    sched.observe(SchedulerOutput(decode_cost=30.0), 0.030)
    # Weighted by cost: the second step's 2 ms a unit over 10 units counts for less than the third's 1 ms over 30.
    seconds = (0.010 * 0.8 + 0.020 * 0.2) * 0.8 + 0.030 * 0.2
    units = 10.0 * 0.8 + 30.0 * 0.2
    assert sched.decode_unit_seconds == pytest.approx(seconds / units)
    sched.observe(SchedulerOutput(), 5.0)  # a step without decodes (no bound applied) teaches nothing
    assert sched.prefill_unit_seconds is None and sched.decode_unit_seconds == pytest.approx(seconds / units)
    sched.observe(SchedulerOutput(decode_cost=20.0, prefill_cost=5.0), 20.0 * seconds / units + 0.050)
    assert sched.prefill_unit_seconds == pytest.approx(0.010)  # what the step took beyond its decodes, per unit


def test_short_prompts_are_prefilled_whole_beside_decodes_and_long_ones_held_to_the_bound():
    sched = make_scheduler(num_blocks=2048, block_size=16, budget=1024, slowdown=2.0, long_threshold=256)
    stream = add(sched, 40, max_tokens=100)
    fake_step(sched)
    long = add(sched, 3000, max_tokens=1, first_token=1000)
    shorts = [add(sched, 256, max_tokens=1, first_token=10_000 * (i + 1)) for i in range(2)]
    earned = STEP_OVERHEAD + 1 + len(stream) / KEYS_PER_TOKEN
    batch = fake_step(sched)
    n = batch.num_new_tokens[1]
    assert batch.seqs == [stream, long, *shorts] and batch.num_new_tokens == [1, n, 256, 256]
    assert chunk_cost(0, n) <= earned < chunk_cost(0, n + 1)  # the long prompt spends the credit alone
    assert sched.prefill_credit == pytest.approx(earned - chunk_cost(0, n))
    # Every chunk counts in the step's prefill cost, which the step's measured time is set against.
    assert batch.out.decode_cost == pytest.approx(earned)
    assert batch.out.prefill_cost == pytest.approx(chunk_cost(0, n) + 2 * chunk_cost(0, 256))


def test_prefill_fills_the_token_budget_without_decodes_or_without_the_bound():
    for slowdown, streams in ((2.0, 0), (0.0, 4)):
        sched = make_scheduler(num_blocks=2048, block_size=16, budget=512, slowdown=slowdown)
        for i in range(streams):
            add(sched, 40, max_tokens=200, first_token=10_000 * (i + 1))
        fake_step(sched)
        add(sched, 3000, max_tokens=1)
        assert sum(fake_step(sched).num_new_tokens) == 512


def test_waiting_prompts_beside_decodes_share_one_bounded_budget():
    sched = make_scheduler(num_blocks=2048, block_size=16, budget=512, slowdown=2.0)
    add(sched, 40, max_tokens=200)
    fake_step(sched)
    prompts = [add(sched, 300, max_tokens=1, first_token=1000 * (i + 1)) for i in range(3)]
    batch = fake_step(sched)
    assert batch.num_new_tokens[0] == 1
    assert sum(chunk_cost(0, n) for n in batch.num_new_tokens[1:]) <= STEP_OVERHEAD + 1 + 41 / KEYS_PER_TOKEN
    assert 0 < len(batch) - 1 < len(prompts)  # the budget admits the first prompt, not all three


def admission_order(sched: Scheduler) -> list[Sequence]:
    """Run to completion, returning the sequences in the order they were first scheduled."""
    order: list[Sequence] = []
    for batch in run_to_completion(sched):
        order += [seq for seq in batch.seqs if seq not in order]
    return order


@pytest.mark.parametrize("aging", [0.0, 1000.0])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_follows_priority_then_arrival_and_fcfs_ignores_priority(policy, aging):
    sched = make_scheduler(max_num_seqs=1, policy=policy, aging=aging)
    # Added out of arrival order, as a preempted sequence or a late frontend message can be.
    specs = [(2, 0.0), (0, 3.0), (1, 1.0), (0, 2.0), (2, -1.0), (1, 4.0)]
    seqs = [add(sched, 4, max_tokens=2, first_token=10 * i, priority=p, arrival=t) for i, (p, t) in enumerate(specs)]
    expected = seqs if policy == "fcfs" else sorted(seqs, key=lambda s: (s.priority, s.arrival_time))
    assert admission_order(sched) == expected


@pytest.mark.parametrize(
    "aging,newcomer_arrival,low_goes_first",
    [(10.0, 9.0, False), (10.0, 11.0, True), (0.0, 1000.0, False)],
    ids=["within-aging", "past-aging", "no-aging"],
)
def test_aging_puts_an_old_low_priority_request_before_a_newer_high_priority_one(
    aging, newcomer_arrival, low_goes_first
):
    sched = make_scheduler(max_num_seqs=1, policy="priority", aging=aging)
    low = add(sched, 4, priority=1, arrival=0.0)
    high = add(sched, 4, first_token=50, priority=0, arrival=newcomer_arrival)
    assert admission_order(sched) == ([low, high] if low_goes_first else [high, low])


def test_aging_bounds_how_late_an_overtaking_request_may_arrive():
    """The class docstring's bound: B goes before an earlier A only if it arrived within (p_A - p_B) * T of A."""
    aging, rng = 10.0, random.Random(0)
    sched = make_scheduler(max_num_seqs=1, policy="priority", aging=aging)
    seqs = [
        add(sched, 4, max_tokens=1, first_token=10 * i, priority=rng.randrange(5), arrival=rng.uniform(0, 100))
        for i in range(40)
    ]
    order = admission_order(sched)
    assert sorted(order, key=lambda s: s.seq_id) == seqs
    pairs = [(first, then) for i, then in enumerate(order) for first in order[:i]]
    # Whoever went first despite arriving later had a better priority, and arrived within its aging allowance.
    overtakes = [(first, then) for first, then in pairs if first.arrival_time > then.arrival_time]
    assert overtakes
    for first, then in overtakes:
        assert 0 < first.arrival_time - then.arrival_time <= (then.priority - first.priority) * aging
    # And aging matters: some request went before a better one that arrived after it.
    assert any(first.priority > then.priority for first, then in pairs)


@pytest.mark.parametrize("policy,victim", [("fcfs", "newest"), ("priority", "lowest_priority")])
def test_out_of_blocks_preempts_the_newest_or_the_lowest_priority(policy, victim):
    sched = make_scheduler(num_blocks=4, block_size=4, policy=policy)
    # One block each for the prompts, one spare: the second decode to need a block finds none.
    lowest_priority = add(sched, 4, max_tokens=8, priority=2, arrival=0.0)
    add(sched, 4, max_tokens=8, first_token=20, priority=0, arrival=1.0)
    newest = add(sched, 4, max_tokens=8, first_token=40, priority=1, arrival=2.0)
    assert len(fake_step(sched).seqs) == 3
    batch = fake_step(sched)
    expected = {"newest": newest, "lowest_priority": lowest_priority}[victim]
    assert batch.out.num_preempted == 1 and list(sched.waiting) == [expected] and expected not in batch.seqs
    assert expected.status is SequenceStatus.WAITING and expected.block_table == []


@pytest.mark.parametrize("short_of", ["slots", "blocks"])
@pytest.mark.parametrize(
    "policy,newcomer_priority,preempts",
    [("priority", 0, True), ("priority", 1, False), ("fcfs", 0, False)],
    ids=["better", "equal", "fcfs"],
)
def test_a_better_waiting_sequence_preempts_a_worse_running_one_for_room(short_of, policy, newcomer_priority, preempts):
    # slots: max_num_seqs is 1; blocks: the running sequence's next block is the last free one, the newcomer needs 2.
    num_blocks, max_num_seqs = (64, 1) if short_of == "slots" else (3, 8)
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, policy=policy, aging=10.0)
    running = add(sched, 8, max_tokens=4, priority=1, arrival=0.0)  # 12 tokens: the 3 blocks hold it alone
    fake_step(sched)
    newcomer = add(sched, 8, max_tokens=2, first_token=50, priority=newcomer_priority, arrival=1.0)
    batch = fake_step(sched)
    assert (batch.seqs, batch.out.num_preempted) == (([newcomer], 1) if preempts else ([running], 0))
    assert running.status is (SequenceStatus.WAITING if preempts else SequenceStatus.RUNNING)
    assert newcomer.status is (SequenceStatus.RUNNING if preempts else SequenceStatus.WAITING)
    run_to_completion(sched)
    assert running.num_output_tokens == 4 and newcomer.num_output_tokens == 2
    assert sched.block_manager.num_free_blocks == num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_sequence_waiting_for_its_grammar_is_passed_over_until_it_compiles(policy, monkeypatch):
    sched = make_scheduler(max_num_seqs=2, policy=policy)
    compiling = add(sched, 4, arrival=0.0)
    # The structured-output manager's word on which requests still compile (a real compile needs a tokenizer).
    still_compiling = {compiling.request_id}
    monkeypatch.setattr(sched.structured_output, "is_compiling", still_compiling.__contains__)
    # Of the same priority, so that once ready it waits for a slot under both policies rather than preempting.
    behind = [add(sched, 4, max_tokens=2, first_token=10 * (i + 1), arrival=1.0 + i) for i in range(2)]
    assert fake_step(sched).seqs == behind
    still_compiling.clear()
    assert fake_step(sched).seqs == behind  # their last tokens: max_num_seqs leaves no slot yet
    assert fake_step(sched).seqs == [compiling]


def test_the_runner_hears_once_of_each_sequence_gone_and_sees_a_preempted_one_come_back_whole():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    old = add(sched, 7, max_tokens=20)
    new = add(sched, 7, max_tokens=20, first_token=50)
    assert [s.seq_id for s in fake_step(sched).out.new_seqs] == [old.seq_id, new.seq_id]
    while not (step := fake_step(sched)).out.num_preempted:
        assert not step.out.new_seqs and not step.out.finished_seq_ids
    assert step.out.finished_seq_ids == [new.seq_id] and new.num_output_tokens > 0
    tokens = list(new.token_ids)
    sched.abort_requests([old.request_id])
    out = fake_step(sched).out
    # The preempted sequence comes back with its prompt and outputs, to be recomputed, after the runner drops both.
    assert out.finished_seq_ids == [old.seq_id] and [(s.seq_id, s.token_ids) for s in out.new_seqs] == [
        (new.seq_id, tokens)
    ]
    sched.abort_requests([new.request_id])
    assert not sched.schedule().num_scheduled_tokens  # an empty step: not run, so the news waits for the next one
    late = add(sched, 3, first_token=90)
    out = fake_step(sched).out
    assert out.finished_seq_ids == [new.seq_id] and [s.seq_id for s in out.new_seqs] == [late.seq_id]


@pytest.mark.parametrize("pause_after", [0, 1, 3], ids=["waiting", "mid-prefill", "decoding"])
def test_a_paused_request_gets_no_tokens_and_keeps_its_blocks_until_resumed(pause_after):
    def run(pause: bool) -> list[int]:
        sched = make_scheduler(budget=8)
        paused = add(sched, 12, max_tokens=10)  # its prompt takes two steps: 8 tokens, then 4 beside other's
        other = add(sched, 4, max_tokens=10, first_token=50)
        for _ in range(pause_after):
            fake_step(sched)
        if pause:
            sched.pause_requests([paused.request_id, "unknown"])
            held = (paused.status, list(paused.block_table), paused.num_computed_tokens, len(paused))
            while not other.is_finished:
                assert paused not in fake_step(sched).seqs
            assert (paused.status, paused.block_table, paused.num_computed_tokens, len(paused)) == held
            assert not sched.has_unpaused() and not fake_step(sched).seqs
            sched.resume_requests([paused.request_id])
        run_to_completion(sched)
        assert sched.block_manager.num_free_blocks == 64
        return paused.token_ids

    assert run(pause=True) == run(pause=False)


@pytest.mark.parametrize("short_of", ["slots", "blocks", "decode blocks"])
def test_a_paused_sequence_is_preempted_first_and_waits_until_resumed(short_of):
    # slots: max_num_seqs is 1. blocks: the newcomer's prompt needs 2 of the 3, the paused one holds 2. decode
    # blocks: the 4 hold both prompts, and the newcomer's first decode needs a fifth.
    num_blocks, max_num_seqs = {"slots": (64, 1), "blocks": (3, 8), "decode blocks": (4, 8)}[short_of]
    sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=max_num_seqs, block_size=4, budget=64)
    paused = add(sched, 8, max_tokens=4)
    fake_step(sched)
    sched.pause_requests([paused.request_id])
    newcomer = add(sched, 8, max_tokens=4, first_token=50)  # the newest: fcfs would preempt it first
    steps = []
    while not newcomer.is_finished:
        steps.append(fake_step(sched))
    assert sum(step.out.num_preempted for step in steps) == 1 and newcomer.num_output_tokens == 4
    assert paused.status is SequenceStatus.WAITING and paused.block_table == [] and paused.num_output_tokens == 1
    assert not fake_step(sched).seqs  # room enough now, but it waits for its resume
    sched.resume_requests([paused.request_id])
    run_to_completion(sched)
    alone = make_scheduler(num_blocks=num_blocks, block_size=4, budget=64)
    undisturbed = add(alone, 8, max_tokens=4)
    run_to_completion(alone)
    assert paused.token_ids == undisturbed.token_ids
    assert sched.block_manager.num_free_blocks == num_blocks


def test_an_aborted_paused_request_is_forgotten():
    sched = make_scheduler(num_blocks=16)
    seq = add(sched, 9)
    fake_step(sched)
    sched.pause_requests([seq.request_id])
    sched.abort_requests([seq.request_id])
    assert sched.block_manager.num_free_blocks == 16
    later = add(sched, 9, first_token=30)
    assert sched.has_unpaused()  # the aborted request no longer counts as paused
    assert fake_step(sched).seqs == [later]
