"""The sampler against Hugging Face's logits processors (and the OpenAI penalty formulas) on synthetic logits."""

from collections.abc import Callable, Iterable

import msgspec
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from spindle import SamplingParams
from spindle.backend.sampler import Sampler, SampleRow

VOCAB = 64
EOS = 5
STOP = 9
DRAWS = 20_000
# Total variation between DRAWS samples and their own distribution is 0.003-0.019 here (the flatter the
# distribution, the more); a wrong filter or penalty moves far more mass than this.
MAX_TOTAL_VARIATION = 0.03

Reference = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@pytest.fixture(autouse=True)
def _global_seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(VOCAB, [EOS])


def make_base_logits() -> torch.Tensor:
    """Logits with a clear head, a long tail, both signs, and eos and a stop id among the likely tokens."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 1.5
    logits[EOS] = logits.max() + 0.5
    logits[STOP] = logits[EOS] - 0.3
    return logits


@pytest.fixture
def base_logits() -> torch.Tensor:
    return make_base_logits()


def make_seq(params: SamplingParams, prompt: list[int], output: Iterable[int] = ()) -> SampleRow:
    return SampleRow(params, params.seed, [*prompt, *output], len(prompt))


def seen_tokens(logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """A prompt and an output whose tokens have positive and negative logits, some repeated."""
    order = logits.argsort(descending=True).tolist()
    prompt = [order[1], order[-3], order[20]]
    output = [order[2], order[2], order[2], order[-5], order[20]]
    return prompt, output


def empirical(
    sampler: Sampler, logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    seqs = [make_seq(params, prompt, output) for _ in range(DRAWS)]
    tokens = sampler(logits.expand(DRAWS, -1).clone(), seqs).to_host()[0]
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB) / DRAWS


def hf(*processors: object) -> Reference:
    def apply(scores: torch.Tensor, input_ids: torch.Tensor, num_prompt: int) -> torch.Tensor:
        return LogitsProcessorList(processors)(input_ids, scores)

    return apply


def openai_penalties(presence: float, frequency: float) -> Reference:
    """OpenAI's definition: subtract frequency * count and presence * [count > 0], counting output tokens only."""

    def apply(scores: torch.Tensor, input_ids: torch.Tensor, num_prompt: int) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, num_prompt:], minlength=VOCAB)
        return scores - frequency * counts - presence * (counts > 0)

    return apply


def chain(*references: Reference) -> Reference:
    def apply(scores: torch.Tensor, input_ids: torch.Tensor, num_prompt: int) -> torch.Tensor:
        for reference in references:
            scores = reference(scores, input_ids, num_prompt)
        return scores

    return apply


OUTPUT = seen_tokens(make_base_logits())[1]
# Only these tokens may be sampled; the stop id is the best of them (eos, the best of all, is not among them).
ALLOWED = [STOP, 3, 11, 40]
# Masked: eos (one token); the stop id after the output's last two tokens; not 7, as the output does not end with its
# first token.
BAD_WORDS = [[EOS], [OUTPUT[-2], OUTPUT[-1], STOP], [OUTPUT[0], 7]]


def min_new_tokens(prompt_len: int) -> Reference:
    # 3 prompt + 5 output tokens: min_tokens=6 still blocks eos and the stop id.
    return hf(MinNewTokensLengthLogitsProcessor(prompt_len, 6, [EOS, STOP]))


CASES = [
    pytest.param(SamplingParams(top_k=2), hf(TopKLogitsWarper(2)), id="top_k=2"),
    pytest.param(SamplingParams(top_k=12), hf(TopKLogitsWarper(12)), id="top_k=12"),
    pytest.param(SamplingParams(top_p=0.5), hf(TopPLogitsWarper(0.5)), id="top_p=0.5"),
    pytest.param(SamplingParams(top_p=0.9), hf(TopPLogitsWarper(0.9)), id="top_p=0.9"),
    # Top-p applies to the renormalized top-k distribution: 2 of these 3 tokens survive, not 3.
    pytest.param(SamplingParams(top_k=3, top_p=0.7), hf(TopKLogitsWarper(3), TopPLogitsWarper(0.7)), id="top_k+top_p"),
    pytest.param(SamplingParams(min_p=0.1), hf(MinPLogitsWarper(0.1)), id="min_p=0.1"),
    pytest.param(
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.2),
        hf(TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8), MinPLogitsWarper(0.2)),
        id="temperature+top_k+top_p+min_p",
    ),
    pytest.param(SamplingParams(repetition_penalty=1.8), hf(RepetitionPenaltyLogitsProcessor(1.8)), id="repetition>1"),
    pytest.param(SamplingParams(repetition_penalty=0.6), hf(RepetitionPenaltyLogitsProcessor(0.6)), id="repetition<1"),
    pytest.param(SamplingParams(presence_penalty=1.5), openai_penalties(1.5, 0), id="presence"),
    pytest.param(SamplingParams(frequency_penalty=0.8), openai_penalties(0, 0.8), id="frequency"),
    pytest.param(
        SamplingParams(presence_penalty=-0.5, frequency_penalty=0.6),
        openai_penalties(-0.5, 0.6),
        id="presence+frequency",
    ),
    pytest.param(
        SamplingParams(logit_bias={3: 4.0, 7: -3.0, 11: 1.5}),
        hf(SequenceBiasLogitsProcessor([[[3], 4.0], [[7], -3.0], [[11], 1.5]])),
        id="logit_bias",
    ),
    pytest.param(SamplingParams(min_tokens=6, stop_token_ids=[STOP]), min_new_tokens(3), id="min_tokens"),
    pytest.param(
        SamplingParams(min_tokens=6, stop_token_ids=[STOP], ignore_eos=True), min_new_tokens(3), id="min_tokens+ignore"
    ),
    pytest.param(
        SamplingParams(allowed_token_ids=ALLOWED),
        hf(PrefixConstrainedLogitsProcessor(lambda batch_id, input_ids: ALLOWED, num_beams=1)),
        id="allowed_token_ids",
    ),
    pytest.param(
        SamplingParams(bad_words_token_ids=BAD_WORDS), hf(NoBadWordsLogitsProcessor(BAD_WORDS)), id="bad_words"
    ),
    pytest.param(
        SamplingParams(temperature=1.3, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.3, logit_bias={3: 2.0}),
        chain(
            hf(SequenceBiasLogitsProcessor([[[3], 2.0]]), RepetitionPenaltyLogitsProcessor(1.3)),
            openai_penalties(0, 0.3),
            hf(TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.95)),
        ),
        id="everything",
    ),
]


def reference_logits(
    base_logits: torch.Tensor, reference: Reference, prompt: list[int], output: list[int]
) -> torch.Tensor:
    return reference(base_logits[None].clone(), torch.tensor([prompt + output]), len(prompt))[0]


@pytest.mark.parametrize(("params", "reference"), CASES)
def test_sampled_distribution_matches_reference(
    sampler: Sampler, base_logits: torch.Tensor, params: SamplingParams, reference: Reference
) -> None:
    prompt, output = seen_tokens(base_logits)
    expected = reference_logits(base_logits, reference, prompt, output).softmax(-1)
    got = empirical(sampler, base_logits, params, prompt, output)

    assert set(got.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert bool((got[expected > 0.005] > 0).all())
    assert 0.5 * (got - expected).abs().sum().item() < MAX_TOTAL_VARIATION


@pytest.mark.parametrize(("params", "reference"), CASES)
def test_greedy_takes_argmax_of_processed_logits(
    sampler: Sampler, base_logits: torch.Tensor, params: SamplingParams, reference: Reference
) -> None:
    prompt, output = seen_tokens(base_logits)
    greedy = msgspec.structs.replace(params, temperature=0.0)
    # The greedy row sits between random rows so that it takes the mixed-batch path.
    seqs = [make_seq(p, prompt, output) for p in (params, greedy, params)]
    tokens = sampler(base_logits.expand(3, -1).clone(), seqs).to_host()[0]
    assert tokens[1] == reference_logits(base_logits, reference, prompt, output).argmax().item()


def test_greedy_batch_is_argmax(sampler: Sampler) -> None:
    logits = torch.randn(16, VOCAB)
    seqs = [make_seq(SamplingParams(temperature=0.0), [1, 2]) for _ in range(16)]
    assert sampler(logits.clone(), seqs).to_host()[0] == logits.argmax(-1).tolist()


def test_temperature_scales_entropy(sampler: Sampler, base_logits: torch.Tensor) -> None:
    entropies = []
    for temperature in (0.4, 1.0, 2.5):
        got = empirical(sampler, base_logits, SamplingParams(temperature=temperature), [1], [])
        expected = (base_logits / temperature).softmax(-1)
        entropy = -(got[got > 0] * got[got > 0].log()).sum().item()
        assert entropy == pytest.approx(-(expected * expected.log()).sum().item(), abs=0.05)
        entropies.append(entropy)
    assert entropies[0] < entropies[1] < entropies[2]


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("where", ["prompt", "output"])
def test_repetition_penalty_demotes_seen_token(sampler: Sampler, sign: float, where: str) -> None:
    # Token 1 leads token 2 by a margin a 1.5 penalty overturns whichever the sign of the logits.
    logits = torch.full((VOCAB,), -9.0 if sign > 0 else -20.0)
    logits[1], logits[2] = (2.0, 1.5) if sign > 0 else (-1.0, -1.2)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    plain = make_seq(SamplingParams(temperature=0.0), [3])
    seen = make_seq(params, [1, 3], []) if where == "prompt" else make_seq(params, [3], [1])
    assert sampler(logits.expand(2, -1).clone(), [plain, seen]).to_host()[0] == [1, 2]


@pytest.mark.parametrize("bias", [100.0, -100.0])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_or_bans_a_token(
    sampler: Sampler, base_logits: torch.Tensor, bias: float, temperature: float
) -> None:
    target = (base_logits.argmin() if bias > 0 else base_logits.argmax()).item()
    got = empirical(sampler, base_logits, SamplingParams(temperature=temperature, logit_bias={target: bias}), [1], [])
    assert got[target].item() == (1.0 if bias > 0 else 0.0)


def test_logit_bias_follows_the_batch_from_step_to_step(sampler: Sampler, base_logits: torch.Tensor) -> None:
    # The sampler keeps each request's bias between steps: rows come and go, and a request's n rows share it.
    up, down = base_logits.argmin().item(), base_logits.argmax().item()
    forced = SamplingParams(temperature=0.0, logit_bias={up: 100.0})
    banned = SamplingParams(temperature=0.0, logit_bias={down: -100.0, up: -100.0})
    plain = SamplingParams(temperature=0.0)
    runner_up = base_logits.argsort(descending=True)[1].item()
    expected = {id(forced): up, id(banned): runner_up, id(plain): down}
    for batch in ([forced, banned, banned], [banned, plain], [plain, forced], [forced, forced]):
        tokens = sampler(base_logits.expand(len(batch), -1).clone(), [make_seq(p, [1]) for p in batch]).to_host()[0]
        assert tokens == [expected[id(p)] for p in batch]


def test_token_restrictions_follow_the_batch_from_step_to_step(sampler: Sampler, base_logits: torch.Tensor) -> None:
    # Rows with allowed ids, with bad words, with both and with neither, in batches that change: each row is masked
    # as its own request asks, whatever its neighbours.
    order = base_logits.argsort(descending=True).tolist()
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=order[3:6])
    banned = SamplingParams(temperature=0.0, bad_words_token_ids=[[order[0]], [order[1]]])
    both = SamplingParams(temperature=0.0, allowed_token_ids=order[2:6], bad_words_token_ids=[[order[2]], [order[3]]])
    plain = SamplingParams(temperature=0.0)
    expected = {id(allowed): order[3], id(banned): order[2], id(both): order[4], id(plain): order[0]}
    for batch in ([allowed, banned, both, plain], [plain, both], [banned, allowed, allowed], [both, both]):
        tokens = sampler(base_logits.expand(len(batch), -1).clone(), [make_seq(p, [1]) for p in batch]).to_host()[0]
        assert tokens == [expected[id(p)] for p in batch]


@pytest.mark.parametrize(
    ("prompt", "output", "masked"),
    [
        ([1, 2], [], False),  # the word's first token ends the prompt: vLLM compares the output only
        ([1], [2], True),
        ([1], [2, 3, 2], True),
        ([1], [2, 3], False),
    ],
    ids=["start-in-prompt", "start-is-output", "output-ends-with-start", "start-earlier-in-output"],
)
def test_a_bad_word_is_masked_once_the_output_ends_with_its_start(
    sampler: Sampler, base_logits: torch.Tensor, prompt: list[int], output: list[int], masked: bool
) -> None:
    params = SamplingParams(temperature=0.0, bad_words_token_ids=[[2, EOS]])
    token = sampler(base_logits[None].clone(), [make_seq(params, prompt, output)]).to_host()[0][0]
    assert token == (STOP if masked else EOS)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_ids_then_releases(
    sampler: Sampler, base_logits: torch.Tensor, ignore_eos: bool
) -> None:
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[STOP], ignore_eos=ignore_eos)
    blocked = set(base_logits.argsort(descending=True)[:2].tolist())
    assert blocked == {EOS, STOP}
    seqs = [make_seq(params, [1], [0] * produced) for produced in range(5)]
    tokens = sampler(base_logits.expand(5, -1).clone(), seqs).to_host()[0]
    assert [t in blocked for t in tokens] == [False, False, False, True, True]
    assert tokens[3] == EOS


def test_padded_vocab_columns_are_never_sampled(base_logits: torch.Tensor) -> None:
    logits = torch.cat([base_logits, torch.full((8,), 50.0)])
    seqs = [make_seq(SamplingParams(temperature=t), [1]) for t in (0.0, 1.0, 5.0) for _ in range(200)]
    tokens = Sampler(VOCAB, [EOS])(logits.expand(len(seqs), -1).clone(), seqs).to_host()[0]
    assert max(tokens) < VOCAB


def test_nucleus_larger_than_first_candidate_window() -> None:
    """Top-p must widen past its first few hundred candidates when the nucleus is that large."""
    vocab, draws = 1024, 12_000
    logits = torch.full((vocab,), -12.0)
    logits[:400] = -torch.arange(400) * 2e-3
    expected = TopPLogitsWarper(0.9)(None, logits[None].clone())[0].isfinite()
    assert expected.sum() > 300
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.9, top_k=5)]
    seqs = [make_seq(params[i % 2], [1]) for i in range(draws)]
    tokens = torch.tensor(Sampler(vocab, [EOS])(logits.expand(draws, -1).clone(), seqs).to_host()[0])
    assert set(tokens[0::2].tolist()) == set(expected.nonzero().flatten().tolist())
    assert set(tokens[1::2].tolist()) == set(range(5))


LOGPROB_PARAMS = [
    SamplingParams(logprobs=0),
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(),
    SamplingParams(top_k=3, temperature=0.5, logprobs=20, repetition_penalty=1.5),
    SamplingParams(temperature=0.0, logprobs=5),
]


def test_logprobs_are_raw_log_softmax_with_ranks(sampler: Sampler) -> None:
    logits = torch.randn(len(LOGPROB_PARAMS), VOCAB)
    # The last row is forced onto the raw least likely token, so its rank is the vocabulary size.
    least = logits[-1].argmin().item()
    params = [*LOGPROB_PARAMS[:-1], msgspec.structs.replace(LOGPROB_PARAMS[-1], logit_bias={least: 100.0})]
    reference = logits.double().log_softmax(-1)
    token_ids, logprobs = sampler(logits.clone(), [make_seq(p, [least, 1]) for p in params]).to_host()

    assert token_ids[-1] == least
    for row, (p, token, got) in enumerate(zip(params, token_ids, logprobs, strict=True)):
        if p.logprobs is None:
            assert got is None
            continue
        top = reference[row].argsort(descending=True)[: p.logprobs].tolist()
        assert got.token_ids == [token, *top]
        assert got.logprobs == pytest.approx(reference[row, got.token_ids].tolist(), abs=1e-5)
        assert got.rank == 1 + sum(v > reference[row, token].item() for v in reference[row].tolist())
    assert logprobs[-1].rank == VOCAB


def test_logprobs_are_those_of_the_restricted_distribution(sampler: Sampler) -> None:
    logits = torch.randn(3, VOCAB)
    allowed = logits[0].argsort()[:6].tolist()  # the least likely tokens: none would be sampled without the mask
    bad = logits[1].argsort(descending=True)[:2].tolist()
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=8),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[t] for t in bad], logprobs=3),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    masked = logits.double().clone()
    masked[0, [t for t in range(VOCAB) if t not in allowed]] = float("-inf")
    masked[1, bad] = float("-inf")
    reference = masked.log_softmax(-1)
    token_ids, logprobs = sampler(logits.clone(), [make_seq(p, [1]) for p in params]).to_host()

    assert token_ids == reference.argmax(-1).tolist()
    for row, got in enumerate(logprobs):
        assert got.logprobs == pytest.approx(reference[row, got.token_ids].tolist(), abs=1e-5)
        top = reference[row].argsort(descending=True)[: params[row].logprobs].tolist()
        finite = [t for t in top if reference[row, t] > float("-inf")]  # the masked ones tie, in any order
        assert got.token_ids[1 : 1 + len(finite)] == finite
    # Six tokens are allowed: the other two of the top eight have no probability.
    assert set(logprobs[0].token_ids[1:7]) == set(allowed) and logprobs[0].logprobs[7:] == [float("-inf")] * 2


@pytest.mark.parametrize("num", [0, 4])
def test_prompt_logprobs(sampler: Sampler, num: int) -> None:
    logits = torch.randn(7, VOCAB)
    targets = torch.randint(VOCAB, (7,))
    reference = logits.double().log_softmax(-1)
    got = sampler.prompt_logprobs(logits.clone(), targets, num).to_host()
    for row, entry in enumerate(got):
        target = targets[row].item()
        assert entry.token_ids == [target, *reference[row].argsort(descending=True)[:num].tolist()]
        assert entry.logprobs == pytest.approx(reference[row, entry.token_ids].tolist(), abs=1e-5)
        assert entry.rank == 1 + int((reference[row] > reference[row, target]).sum())


SEEDED = [
    pytest.param(SamplingParams(seed=7, temperature=0.9), id="temperature"),
    pytest.param(SamplingParams(seed=7, top_k=5), id="top_k"),
    pytest.param(SamplingParams(seed=7, top_p=0.8, min_p=0.05), id="top_p+min_p"),
    pytest.param(SamplingParams(seed=7, repetition_penalty=1.4, presence_penalty=0.5), id="penalties"),
    pytest.param(
        SamplingParams(seed=7, allowed_token_ids=list(range(0, VOCAB, 2)), bad_words_token_ids=[[4], [6, 8]]),
        id="token_restrictions",
    ),
]
COMPANIONS = [
    SamplingParams(seed=123),
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(top_k=40, top_p=0.95),
    SamplingParams(seed=5, top_p=0.5, frequency_penalty=1.0),
]


def generate(sampler: Sampler, params: SamplingParams, steps: list[torch.Tensor], batched: bool) -> list[int]:
    """Samples len(steps) tokens for one sequence, alone or as row 2 of a batch of all kinds of rows."""
    seq = make_seq(params, [1, 2, 3])
    others = [make_seq(p, [4, 5]) for p in COMPANIONS] if batched else []
    batch = [*others[:2], seq, *others[2:]]
    row = batch.index(seq)
    for step in steps:
        logits = torch.randn(len(batch), VOCAB)
        logits[row] = step
        tokens = sampler(logits, batch).to_host()[0]
        for s, token in zip(batch, tokens, strict=True):
            s.token_ids.append(token)
    return seq.output_token_ids


@pytest.mark.parametrize("params", SEEDED)
def test_seeded_row_samples_the_same_alone_and_in_a_batch(sampler: Sampler, params: SamplingParams) -> None:
    steps = list(torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(3)))
    alone = generate(sampler, params, steps, batched=False)
    assert generate(sampler, params, steps, batched=True) == alone
    assert generate(sampler, msgspec.structs.replace(params, seed=8), steps, batched=False) != alone


@pytest.mark.parametrize("truncation", [{"top_k": VOCAB - 1}, {"top_p": 0.999}])
def test_seeded_draws_belong_to_token_ids(sampler: Sampler, truncation: dict[str, float]) -> None:
    """A seed gives each token its own draw, so a truncation that keeps the chosen tokens changes nothing."""
    steps = list(torch.randn(10, VOCAB, generator=torch.Generator().manual_seed(4)))
    whole = generate(sampler, SamplingParams(seed=11), steps, batched=False)
    truncated = generate(sampler, SamplingParams(seed=11, **truncation), steps, batched=False)
    assert truncated == whole


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_for_seeded_and_greedy_rows(sampler: Sampler) -> None:
    restricted = SamplingParams(temperature=0.0, allowed_token_ids=list(range(0, VOCAB, 3)), bad_words_token_ids=[[3]])
    params = [
        SamplingParams(seed=3, top_p=0.9),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        restricted,
    ] * 2
    logits = torch.randn(len(params), VOCAB)
    cpu, cuda = (
        sampler(logits.clone().to(device), [make_seq(p, [1, 2]) for p in params]).to_host()[0]
        for device in ("cpu", "cuda")
    )
    assert cpu == cuda
