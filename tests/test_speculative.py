"""Speculative decoding by prompt lookup: the drafts, their verification, the KV rollback, and exactness."""

from collections import Counter
from pathlib import Path

import pytest
import torch

from spindle import LLM, SamplingParams
from spindle.backend.block_manager import BlockManager
from spindle.backend.model_runner import sample_rows
from spindle.backend.runner_state import SequenceState
from spindle.backend.sampler import Sampler
from spindle.backend.sequence import Sequence
from spindle.backend.speculative import (
    ACCEPTANCE_PRIOR,
    EXPLORE_EVERY,
    DraftProposer,
    StepCosts,
    accepted_tokens,
    propose,
)
from spindle.backend.structured_output import StructuredOutputManager


@pytest.mark.parametrize(
    ("tokens", "num", "drafts"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # the 3-gram [1, 2, 3] occurred before: what followed it
        ([1, 2, 3, 9, 1, 2, 3], 1, [9]),
        ([5, 2, 3, 7, 1, 2, 3], 2, [7, 1]),  # no earlier [1, 2, 3]; the 2-gram [2, 3] did occur
        ([2, 3, 4, 2, 3, 5, 8, 2, 3], 2, [5, 8]),  # the latest occurrence wins
        ([4, 4, 4, 4], 3, [4]),  # only what followed, however little
        ([1, 2, 3, 4, 5, 3], 4, []),  # a 1-gram match is too weak to draft from
        ([7, 7], 4, []),
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_propose_continues_the_latest_longest_match(tokens: list[int], num: int, drafts: list[int]) -> None:
    assert propose(tokens, num) == drafts


@pytest.mark.parametrize(
    ("drafts", "sampled", "emitted"),
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted, then the bonus token
        ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # the first disagreement is the model's own token; the rest is dropped
        ([5, 6, 7], [1, 6, 7, 8], [1]),
    ],
)
def test_accepted_tokens_stop_at_the_first_disagreement(
    drafts: list[int], sampled: list[int], emitted: list[int]
) -> None:
    assert accepted_tokens(drafts, sampled) == emitted


def test_trim_returns_the_rejected_drafts_blocks_and_publishes_the_accepted_ones() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("r", 0, [1, 2, 3, 4, 5, 6], SamplingParams(), 0.0)
    bm.allocate(seq, 5)
    seq.num_computed_tokens = 5  # the 6th token is the next input
    bm.allocate(seq, 6)  # the last token and 5 drafts (7, 8, 9, 10, 11): positions 5..10, three blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.blocks[seq.block_table[1]].hash is None  # it holds drafts: not published yet
    # Two drafts accepted (7, 8) and the model's own 20: K/V is kept for positions 0..7.
    seq.token_ids += [7, 8, 20]
    seq.num_computed_tokens = 8
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    second = bm.blocks[seq.block_table[1]]
    assert second.hash is not None and bm.cached[second.hash] == second.block_id
    bm.free_blocks(seq)
    assert bm.num_free_blocks == 8


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test that ``a`` and ``b`` (counts over categories) come from one distribution."""
    categories = sorted(set(a) | set(b))
    counts = torch.tensor([[a[c] for c in categories], [b[c] for c in categories]], dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = len(categories) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def test_verification_emits_exactly_what_plain_sampling_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's rows at the draft positions plus :func:`accepted_tokens`, against the exact distribution.

    With fixed next-token distributions ``p_0..p_3`` at the positions of 3 drafts ``d``, plain decoding emits
    ``d_0..d_{j-1}`` then ``y != d_j`` with probability ``p_0(d_0)...p_{j-1}(d_{j-1}) p_j(y)`` (and after all three
    drafts any ``y`` by ``p_3``). 6,000 seeded trials must fit that distribution: a chi-square goodness-of-fit test
    must not reject at p = 0.001 (an exact verifier fails it with probability 0.1%; the seeds fix the outcome).
    """
    vocab, drafts = 6, [1, 2, 3]
    logits = torch.tensor(
        [[0.5, 1.5, 0.0, -1.0, 0.2, 0.1], [0.0, 0.3, 1.0, 0.9, -0.5, 0.0], [1.0, 0.0, 0.0, 0.6, 0.0, 0.4], [0.0] * 6]
    )
    probs = logits.double().softmax(-1)
    expected: Counter = Counter()
    reach = 1.0
    for j, p in enumerate(probs):
        for y in range(vocab):
            if j == len(drafts) or y != drafts[j]:
                expected[(*drafts[:j], y)] += reach * float(p[y])
        if j < len(drafts):
            reach *= float(p[drafts[j]])
    sampler = Sampler(vocab, eos_token_ids=[])
    observed: Counter = Counter()
    trials = 6000
    for seed in range(trials):
        state = SequenceState(0, [0], 1, SamplingParams(temperature=1.0, seed=seed), seed, [], 0)
        sampled = sampler(logits.clone(), sample_rows(state, list(drafts))).to_host()[0]
        observed[tuple(accepted_tokens(drafts, sampled))] += 1
    assert set(observed) <= set(expected)
    outcomes = sorted(expected)
    counts = torch.tensor([observed[o] for o in outcomes], dtype=torch.float64)
    means = torch.tensor([expected[o] * trials for o in outcomes], dtype=torch.float64)
    statistic = ((counts - means) ** 2 / means).sum()
    dof = torch.tensor((len(outcomes) - 1) / 2, dtype=torch.float64)
    assert float(torch.special.gammaincc(dof, statistic / 2)) > 1e-3
    assert observed[tuple(drafts) + (0,)] > 0  # all three drafts were accepted in some trials


def test_seeded_sampling_keeps_its_distribution_under_speculation(tiny_llm_dir: Path) -> None:
    """End to end: the same 600 seeded requests with and without drafts give each output position one distribution.

    Bound: a two-sample chi-square test per position must not reject at p = 0.001 (with 4 positions, equal
    distributions fail it with probability under 0.4%; the seeds make the outcome fixed). The tiny random model
    accepts few drafts (about 1 in 10), so the verifier's exactness is proven by the test above; this one proves
    the engine's path (drafts, rows, rollback) leaves sampled output as it was.
    """
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", adaptive_drafts=False)
    # The prompt ends in the model's own greedy output, which falls into a loop: the drafts continue the loop, and
    # with top_k 3 they have a fair chance of being what the model samples.
    start = [5, 6, 7, 8, 9]
    greedy = llm.generate({"prompt_token_ids": start}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    prompt = {"prompt_token_ids": start + greedy[0].outputs[0].token_ids}
    outputs = {}
    for speculative in (0, 3):
        params = [
            SamplingParams(
                temperature=0.5, top_k=3, seed=seed, max_tokens=4, min_tokens=4, num_speculative_tokens=speculative
            )
            for seed in range(600)
        ]
        results = llm.generate([prompt] * len(params), params, use_tqdm=False)
        outputs[speculative] = [r.outputs[0].token_ids for r in results]
    stats = llm.llm_engine.engine_core.stats()
    assert stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0
    for position in range(4):
        plain = Counter(tokens[position] for tokens in outputs[0])
        speculated = Counter(tokens[position] for tokens in outputs[3])
        assert chi_square_p_value(plain, speculated) > 1e-3, (position, plain, speculated)


def test_each_completion_counts_its_own_drafts(tiny_llm_dir: Path) -> None:
    """A completion reports the drafts verified for it and those accepted: over a run they add up to the engine's."""
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", adaptive_drafts=False)
    start = [5, 6, 7, 8, 9]
    greedy = llm.generate({"prompt_token_ids": start}, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    looping = {"prompt_token_ids": start + greedy[0].outputs[0].token_ids}  # drafts continue its loop
    params = [
        SamplingParams(temperature=0, max_tokens=16, num_speculative_tokens=3),
        SamplingParams(temperature=0, max_tokens=16),
    ]
    speculated, plain = (r.outputs[0] for r in llm.generate([looping, looping], params, use_tqdm=False))
    stats = llm.llm_engine.engine_core.stats()
    assert speculated.num_draft_tokens == stats.num_draft_tokens > 0
    assert speculated.num_accepted_draft_tokens == stats.num_accepted_draft_tokens > 0
    assert plain.num_draft_tokens == plain.num_accepted_draft_tokens == 0
    assert speculated.token_ids == plain.token_ids


def drafter_with_costs(seconds: dict[int, float], adaptive: bool = True) -> DraftProposer:
    """A drafter that has measured steps of these token counts (each at these seconds)."""
    structured_output = StructuredOutputManager(Path(), vocab_size=100, eos_token_ids=[])
    drafter = DraftProposer(1_000, structured_output, adaptive=adaptive)
    for num_tokens, value in seconds.items():
        drafter.observe(num_tokens, value)
    return drafter


def test_step_costs_average_each_count_and_interpolate_the_others() -> None:
    costs = StepCosts()
    assert costs.estimates(1, 3) is None  # nothing measured: no estimate
    costs.observe(2, 1.0)
    costs.observe(2, 2.0)  # a running average, the newest step weighing 0.2
    costs.observe(5, 3.0)
    # Below every measured count: the smallest's; between two, on their line; above them all: the largest's.
    assert costs.estimates(1, 6).tolist() == pytest.approx([1.2, 1.2, 1.8, 2.4, 3.0, 3.0])
    assert costs.estimates(3, 4).tolist() == pytest.approx([1.8, 2.4])


def test_drafts_are_verified_where_a_step_of_more_tokens_costs_little() -> None:
    drafts = {0: [5, 6, 7, 8], 1: [9, 9]}
    # Memory-bound (more tokens cost nothing): every draft pays.
    assert drafter_with_costs({2: 1.0, 8: 1.0}).worth_verifying(drafts, 2) == drafts
    # Compute-bound (each token costs a step's share): none can, as each is accepted with a chance below 1; but every
    # EXPLORE_EVERY steps the best sequence verifies its drafts anyway, so that their costs stay measured.
    compute_bound = drafter_with_costs({n: n / 2 for n in range(2, 9)})
    kept = [compute_bound.worth_verifying(drafts, 2) for _ in range(2 * EXPLORE_EVERY)]
    explored = {i for i, step in enumerate(kept, 1) if step}
    assert explored == {EXPLORE_EVERY, 2 * EXPLORE_EVERY} and kept[EXPLORE_EVERY - 1] == {1: [9, 9]}
    # Flat up to 4 tokens, then linear: the two drafts with the best chances.
    costs = {n: max(1.0, n / 4) for n in range(2, 9)}
    assert drafter_with_costs(costs).worth_verifying(drafts, 2) == {0: [5], 1: [9]}
    # Before any step was measured, all are tried.
    assert drafter_with_costs({}).worth_verifying(drafts, 2) == drafts


def test_a_sequence_whose_drafts_are_accepted_keeps_drafting_where_one_whose_drafts_fail_stops() -> None:
    drafter = drafter_with_costs({n: 1.0 + 0.1 * max(0, n - 3) for n in range(2, 12)})
    for _ in range(10):
        drafter.record(0, 4, 4)  # every draft accepted
        drafter.record(1, 4, 0)  # the first draft rejected each time
    assert drafter.acceptance.rate(0) > ACCEPTANCE_PRIOR > 0.25 > drafter.acceptance.rate(1)
    assert drafter.worth_verifying({0: [1, 2, 3, 4], 1: [5, 6, 7, 8]}, 2) == {0: [1, 2, 3, 4]}
    drafter.forget(0)  # finished: the next sequence 0 starts from the engine's rate
    assert drafter.acceptance.rate(0) == pytest.approx(drafter.acceptance.rate(99))
    assert drafter.num_draft_tokens == 80 and drafter.num_accepted_draft_tokens == 40


@pytest.mark.parametrize("adaptive", [True, False])
def test_propose_drafts_for_decodes_and_keeps_every_draft_unless_adaptive(adaptive: bool) -> None:
    decode = Sequence("a", 0, [1, 2, 3, 9, 1, 2, 3], SamplingParams(max_tokens=50, num_speculative_tokens=3), 0.0)
    prefill = Sequence("b", 0, [1, 2, 3, 9, 1, 2, 3], SamplingParams(max_tokens=50, num_speculative_tokens=3), 0.0)
    decode.num_computed_tokens = len(decode) - 1
    compute_bound = drafter_with_costs({n: float(n) for n in range(1, 9)}, adaptive)
    assert compute_bound.propose([decode, prefill]) == ({} if adaptive else {decode.seq_id: [9, 1, 2]})
