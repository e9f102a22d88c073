from spindle import SamplingParams
from spindle.backend.block_manager import BlockManager
from spindle.backend.scheduler import KEYS_PER_TOKEN, STEP_OVERHEAD, ScheduledBatch, Scheduler
from spindle.backend.sequence import Sequence, SequenceStatus


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 32, slowdown: float = 0.0
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, slowdown)


def add(sched: Scheduler, prompt_len: int, max_tokens: int = 4, first_token: int = 0) -> Sequence:
    prompt = list(range(first_token, first_token + prompt_len))
    seq = Sequence(f"r{first_token}", 0, prompt, SamplingParams(max_tokens=max_tokens), 0.0)
    sched.add(seq)
    return seq


def fake_step(sched: Scheduler) -> ScheduledBatch:
    """What the engine core does after scheduling, with a 'model' whose next token is a function of the context."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert seq.num_computed_tokens + n <= len(seq)
        assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_computed_tokens + n
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(sum(seq.token_ids) % 1000)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return batch


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_unfinished():
        batches.append(fake_step(sched))
        assert len(batches) < max_steps
    return batches


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


def test_preemption_recomputes_and_loses_nothing():
    def outputs(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = make_scheduler(num_blocks=num_blocks, budget=64)
        seqs = [add(sched, 6 + i, max_tokens=12, first_token=100 * i) for i in range(6)]
        batches = run_to_completion(sched)
        assert sched.block_manager.num_free_blocks == num_blocks
        return {s.request_id: s.token_ids for s in seqs}, sum(b.num_preempted for b in batches)

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
        sched.finish(seq, "abort")
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()


def chunk_cost(computed: int, n: int) -> float:
    return n * (1 + (computed + n / 2) / KEYS_PER_TOKEN)


def test_decode_slowdown_bounds_the_prefill_beside_decodes():
    sched = make_scheduler(num_blocks=2048, block_size=16, budget=512, slowdown=2.0)
    streams = [add(sched, 40, max_tokens=5000, first_token=10_000 * (i + 1)) for i in range(4)]
    fake_step(sched)  # the streams' prefills: no decodes yet, so no bound
    long = add(sched, 6000, max_tokens=1)
    chunks = []
    while long.num_output_tokens == 0:
        computed = long.num_computed_tokens
        decode_cost = STEP_OVERHEAD + sum(1 + len(s) / KEYS_PER_TOKEN for s in streams)
        batch = fake_step(sched)
        assert batch.seqs[:4] == streams and batch.num_new_tokens[:4] == [1] * 4  # every stream decodes each step
        n = batch.num_new_tokens[4]
        # The largest chunk the budget pays for, or one token when it pays for none.
        assert chunk_cost(computed, n) <= max(decode_cost, chunk_cost(computed, 1))
        assert n == 6000 - computed or chunk_cost(computed, n + 1) > decode_cost
        chunks.append(n)
    assert chunks[0] > 20 and chunks[-1] <= 5 and chunks == sorted(chunks, reverse=True)


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
