"""Turns one decode step's logits into the next token of every sequence, vectorized across the batch.

Every stage runs as a handful of tensor operations over the rows that use it and is skipped when none
does, so an all-greedy batch without penalties, biases or logprobs costs one ``argmax``. The stages, in
order: the token restrictions (the grammar mask of structured output, ``allowed_token_ids``, ``bad_words``),
logprobs, the request's logits processors (:mod:`spindle.backend.logits_processors`, row by row), logit bias,
min_tokens, penalties (repetition, frequency, presence); then greedy
rows take the argmax and the others go through temperature, top-k, top-p and min-p (Hugging Face's
warper order) before an exponential race picks the token. Full-vocabulary temporaries are avoided
where possible: on a CPU, allocating one costs more than the arithmetic on it. On CUDA nothing here waits for the
device: parameters go over with :func:`~spindle.backend.transfers.to_device`, results stay on the device until the
runner fetches a whole step's at once, and seeded rows draw from a hash of (seed, position) computed on the device.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from spindle.backend.logits_processors import LogitsProcessors
from spindle.backend.transfers import fetch, to_device
from spindle.kernels import argmax
from spindle.shared import SamplingParams, TokenLogprobs

# Top-p first looks for a row's nucleus among this many most likely tokens, because a full sort of the
# vocabulary costs ~20x a top-k this small; rows whose nucleus is larger widen the search by _WIDEN.
_NUCLEUS_CANDIDATES = 256
_WIDEN = 8

_Derived = TypeVar("_Derived")


@dataclass(frozen=True, slots=True)
class SampleRow:
    """What the sampler needs of the sequence that one row samples for.

    Attributes:
        params: the sequence's sampling parameters.
        seed: the seed its samples draw from, or None.
        token_ids: its prompt and output as of this row: a decode's row after drafts counts them as output, as
            they would be once accepted (penalties and ``min_tokens`` see them, and it samples their next position).
        num_prompt_tokens: the prompt's length.

    """

    params: SamplingParams
    seed: int | None
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        """How many tokens the sequence has generated as of this row."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens it has generated as of this row."""
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class LogprobTensors:
    """Log-probabilities of some rows, still on the device: a chosen token's, its rank and the row's most likely.

    Attributes:
        token_ids: ``[rows, 1 + max(nums)]`` int64, the chosen token then the most likely ones, best first.
        logprobs: ``[rows, 1 + max(nums)]`` float32, their log-probabilities.
        ranks: ``[rows]`` int64, the chosen token's rank (1 for the most likely).
        nums: how many of the most likely tokens each row reports.

    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    nums: list[int]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors to fetch, in the order :meth:`from_host` takes them."""
        return [self.token_ids, self.logprobs, self.ranks]

    def from_host(self, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray) -> list[TokenLogprobs]:
        """One :class:`TokenLogprobs` per row, from the fetched values of :meth:`tensors`."""
        return [
            TokenLogprobs(token_ids=ids[: 1 + num], logprobs=values[: 1 + num], rank=rank)
            for ids, values, rank, num in zip(
                token_ids.tolist(), logprobs.tolist(), ranks.tolist(), self.nums, strict=True
            )
        ]

    def to_host(self) -> list[TokenLogprobs]:
        """Fetch and convert (one wait for the device); the runner fetches a whole step's tensors at once instead."""
        return self.from_host(*fetch(self.tensors()))


@dataclass
class SamplerOutput:
    """What :class:`Sampler` returns for a batch, on the logits' device.

    Attributes:
        token_ids: ``[rows]`` int64, the token chosen for each row.
        logprob_rows: the rows that asked for log-probabilities (``params.logprobs``).
        logprobs: those rows' log-probabilities, or ``None`` when none asked.

    """

    token_ids: torch.Tensor
    logprob_rows: list[int]
    logprobs: LogprobTensors | None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors to fetch, in the order :meth:`from_host` takes them."""
        return [self.token_ids, *(self.logprobs.tensors() if self.logprobs else [])]

    def from_host(self, token_ids: np.ndarray, *logprobs: np.ndarray) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens and, per row, its log-probabilities or ``None``, from the fetched values of :meth:`tensors`."""
        by_row: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            for row, entry in zip(self.logprob_rows, self.logprobs.from_host(*logprobs), strict=True):
                by_row[row] = entry
        return token_ids.tolist(), by_row

    def to_host(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Fetch and convert (one wait for the device); the runner fetches a whole step's tensors at once instead."""
        return self.from_host(*fetch(self.tensors()))


class Sampler:
    """Samples the next token of a batch of sequences, each with its own :class:`SamplingParams`.

    Semantics follow vLLM: logprobs are those of the model's logits before any stage but the token restrictions (a
    token a grammar, ``allowed_token_ids`` or ``bad_words`` rule out has a logprob of ``-inf``); ``min_tokens`` masks
    the eos ids and ``stop_token_ids`` even when ``ignore_eos`` is set; repetition penalties cover prompt and
    output tokens, presence and frequency penalties only output tokens. Rows of a sequence with a
    ``seed`` draw their randomness from the seed and the position they sample alone, so they sample the
    same tokens whatever batch they are in, on the CPU and on CUDA.

    Args:
        vocab_size: number of real tokens; logits columns past it (padding of the lm head) are ignored.
        eos_token_ids: end-of-sequence ids that ``min_tokens`` holds back.

    """

    def __init__(self, vocab_size: int, eos_token_ids: list[int], processors: LogitsProcessors | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.processors = processors or LogitsProcessors()
        self._instances = _PerRequest(lambda params: self.processors.build(params.logits_processors))
        self._biases = _PerRequest(self._bias_arrays)
        self._allowed = _PerRequest(self._allowed_positions)
        self._bad_words = _PerRequest(self._bad_word_sequences)

    def __call__(
        self, logits: torch.Tensor, seqs: list[SampleRow], allowed: tuple[torch.Tensor, list[int]] | None = None
    ) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[len(seqs), >= vocab_size]`` next-token logits, one row per sequence, on any
                device. It may be modified in place; pass a copy if it is needed afterwards.
            seqs: what each row samples for, in row order.
            allowed: for structured output, a ``[rows, ceil(vocab_size / 32)]`` int32 bitmask of the tokens each
                row may sample, on the CPU, and the rows it constrains (from
                :meth:`~spindle.backend.structured_output.StructuredOutputManager.bitmask`). The other tokens
                of those rows are masked before anything else, so logprobs are those of the constrained
                distribution (as in vLLM).

        Returns:
            The sampled tokens and, for rows that asked, their log-probabilities, on the logits' device.

        """
        # Contiguous so that the penalties can address it flat (a copy only when the lm head is padded).
        logits = logits[:, : self.vocab_size].float().contiguous()
        params = [s.params for s in seqs]
        if allowed is not None:
            _apply_bitmask(logits, *allowed)
        self._apply_allowed_token_ids(logits, params)
        self._apply_bad_words(logits, seqs)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = _take(logits, logprob_rows).log_softmax(-1) if logprob_rows else None

        self._apply_logits_processors(logits, seqs)
        self._apply_logit_bias(logits, params)
        self._apply_min_tokens(logits, seqs)
        self._apply_penalties(logits, seqs)

        greedy, rest = _partition([p.greedy for p in params])
        if not rest:
            tokens = argmax(logits)
        elif not greedy:
            tokens = self._sample(logits, seqs)
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
            rows = _index(greedy, logits)
            tokens[rows] = argmax(logits[rows])
            rows = _index(rest, logits)
            tokens[rows] = self._sample(logits[rows], [seqs[i] for i in rest])

        logprobs = None
        if raw_logprobs is not None:
            nums = [params[i].logprobs or 0 for i in logprob_rows]
            logprobs = _gather_logprobs(raw_logprobs, _take(tokens, logprob_rows), nums)
        return SamplerOutput(token_ids=tokens, logprob_rows=logprob_rows, logprobs=logprobs)

    def prompt_logprobs(self, logits: torch.Tensor, target_ids: torch.Tensor, num: int) -> LogprobTensors:
        """Log-probabilities of prompt tokens, from the logits of the positions before them.

        Args:
            logits: ``[n, >= vocab_size]`` raw logits of ``n`` consecutive prompt positions.
            target_ids: ``[n]`` the prompt token that follows each position.
            num: how many of the most likely tokens to report besides the target.

        Returns:
            One row per position, with the target first and then the top ``num`` tokens, on the logits' device.

        """
        raw_logprobs = logits[:, : self.vocab_size].float().log_softmax(-1)
        chosen = target_ids.to(device=logits.device, dtype=torch.long)
        return _gather_logprobs(raw_logprobs, chosen, [num] * len(target_ids))

    def _apply_logit_bias(self, logits: torch.Tensor, params: list[SamplingParams]) -> None:
        """Add every row's logit bias to its logits, in one ``index_add_`` over the flattened batch.

        A request's biases become arrays the first time it is sampled, not at every step, so that a large bias map
        costs a copy per step rather than a Python loop over it (per row: a request with ``n`` completions has ``n``).
        """
        rows = [i for i, p in enumerate(params) if p.logit_bias]
        biases = self._biases.of(params, rows)
        if not rows:
            return
        token_ids, values = zip(*biases, strict=True)
        offsets = np.repeat(np.asarray(rows, dtype=np.int64) * logits.shape[-1], [len(t) for t in token_ids])
        positions = np.concatenate(token_ids) + offsets
        flat = logits.view(-1)
        flat.index_add_(
            0,
            to_device(positions, torch.int64, logits.device),
            to_device(np.concatenate(values), torch.float32, logits.device),
        )

    def _apply_logits_processors(self, logits: torch.Tensor, seqs: list[SampleRow]) -> None:
        """Run each row's request's logits processors on its row (:mod:`spindle.backend.logits_processors`)."""
        params = [s.params for s in seqs]
        rows = [i for i, p in enumerate(params) if p.logits_processors]
        for row, processors in zip(rows, self._instances.of(params, rows), strict=True):
            seq = seqs[row]
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            logits[row] = self.processors.apply(processors, prompt, seq.output_token_ids, logits[row])

    def _bias_arrays(self, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
        """A request's logit bias as arrays of token ids (those in the vocabulary) and their biases."""
        kept = [(token_id, bias) for token_id, bias in params.logit_bias.items() if token_id < self.vocab_size]
        token_ids = np.fromiter((token_id for token_id, _ in kept), dtype=np.int64, count=len(kept))
        values = np.fromiter((bias for _, bias in kept), dtype=np.float32, count=len(kept))
        return token_ids, values

    def _apply_allowed_token_ids(self, logits: torch.Tensor, params: list[SamplingParams]) -> None:
        """Set to ``-inf`` every logit but the allowed tokens' in the rows with ``allowed_token_ids``.

        The allowed logits are read out, the rows filled and the values written back: three operations for all the
        rows together, with no ``[rows, vocab]`` mask built.
        """
        rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        token_ids = self._allowed.of(params, rows)
        if not rows:
            return
        offsets = np.repeat(np.asarray(rows, dtype=np.int64) * logits.shape[-1], [len(t) for t in token_ids])
        positions = to_device(np.concatenate(token_ids) + offsets, torch.int64, logits.device)
        flat = logits.view(-1)
        kept = flat.index_select(0, positions)
        if len(rows) == logits.shape[0]:
            logits.fill_(float("-inf"))
        else:
            logits[_index(rows, logits)] = float("-inf")
        flat.index_copy_(0, positions, kept)

    def _allowed_positions(self, params: SamplingParams) -> np.ndarray:
        """A request's allowed token ids in the vocabulary, as an array."""
        return np.asarray([t for t in params.allowed_token_ids if t < self.vocab_size], dtype=np.int64)

    def _apply_bad_words(self, logits: torch.Tensor, seqs: list[SampleRow]) -> None:
        """Set to ``-inf`` the last token of every bad word whose other tokens the row's output ends with.

        Which (row, token) pairs to mask is a comparison of a few short lists per row; the masking is one indexed
        write for all the rows together.
        """
        params = [s.params for s in seqs]
        rows = [i for i, p in enumerate(params) if p.bad_words_token_ids]
        words = self._bad_words.of(params, rows)
        if not rows:
            return
        masked_rows: list[int] = []
        masked_ids: list[int] = []
        for row, (single, longer) in zip(rows, words, strict=True):
            seq = seqs[row]
            banned = single + [
                last
                for prefix, last in longer
                if len(prefix) <= seq.num_output_tokens and seq.token_ids[len(seq.token_ids) - len(prefix) :] == prefix
            ]
            masked_rows += [row] * len(banned)
            masked_ids += banned
        if masked_ids:
            logits[_index(masked_rows, logits), _index(masked_ids, logits)] = float("-inf")

    def _bad_word_sequences(self, params: SamplingParams) -> tuple[list[int], list[tuple[list[int], int]]]:
        """A request's bad words (those in the vocabulary), split for :meth:`_apply_bad_words`.

        Returns:
            The one-token words' ids, masked at every step, and each longer word as (all its tokens but the last, the
            last token).

        """
        sequences = [s for s in params.bad_words_token_ids if s and max(s) < self.vocab_size]
        single = [s[0] for s in sequences if len(s) == 1]
        return single, [(s[:-1], s[-1]) for s in sequences if len(s) > 1]

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[SampleRow]) -> None:
        held = [i for i, seq in enumerate(seqs) if seq.num_output_tokens < seq.params.min_tokens]
        if not held:
            return
        # vLLM holds eos back even with ignore_eos: min_tokens is about length, not stopping.
        if self.eos_token_ids:
            logits[_index(held, logits).unsqueeze(1), _index(self.eos_token_ids, logits)] = float("-inf")
        stops = [(i, t) for i in held for t in seqs[i].params.stop_token_ids or () if t < self.vocab_size]
        if stops:
            rows, token_ids = zip(*stops, strict=True)
            logits[_index(list(rows), logits), _index(list(token_ids), logits)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[SampleRow]) -> None:
        # Penalties only touch tokens a sequence has seen, so they work on its (row, token) pairs (a few
        # thousand), as positions in the flattened logits, rather than on [rows, vocab] count tensors.
        flat = logits.view(-1)
        repeated = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1]
        if repeated:
            positions, counts = _token_positions(repeated, [seqs[i].token_ids for i in repeated], logits)
            penalty = _per_position([seqs[i].params.repetition_penalty for i in repeated], counts, logits)
            seen = flat.index_select(0, positions)
            # Dividing positive and multiplying negative logits makes a seen token less likely either way;
            # a token seen twice is written twice with the same value, so it is penalized once.
            flat.index_copy_(0, positions, torch.where(seen > 0, seen / penalty, seen * penalty))
        counted = [i for i, s in enumerate(seqs) if s.params.presence_penalty or s.params.frequency_penalty]
        if counted:
            positions, counts = _token_positions(counted, [seqs[i].output_token_ids for i in counted], logits)
            presence = _per_position([seqs[i].params.presence_penalty for i in counted], counts, logits)
            frequency = _per_position([seqs[i].params.frequency_penalty for i in counted], counts, logits)
            # Presence is written (once per distinct token), frequency added (once per occurrence).
            flat.index_copy_(0, positions, flat.index_select(0, positions) - presence)
            flat.index_add_(0, positions, -frequency)

    def _sample(self, logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
        """Sample the non-greedy rows: temperature, then top-k/top-p/min-p, then the exponential race."""
        params = [s.params for s in seqs]
        temperature = [p.temperature for p in params]
        if any(t != 1 for t in temperature):
            logits.div_(_column(temperature, logits))

        vocab = logits.shape[-1]
        truncated, whole = _partition([0 < p.top_k < vocab or p.top_p < 1 for p in params])
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if whole:
            tokens[_index(whole, logits)] = self._race(_take(logits, whole), [seqs[i] for i in whole], None)
        if truncated:
            x = _take(logits, truncated)
            for local, values, token_ids in _top_k_top_p(x, [params[i] for i in truncated]):
                rows = [truncated[j] for j in local]
                picks = self._race(values, [seqs[i] for i in rows], token_ids)
                tokens[_index(rows, logits)] = token_ids.gather(1, picks.unsqueeze(1)).squeeze(1)
        return tokens

    def _race(self, logits: torch.Tensor, seqs: list[SampleRow], token_ids: torch.Tensor | None) -> torch.Tensor:
        """Apply min-p, then pick a column per row with probability softmax: ``argmax(p / q)``, ``q ~ Exp(1)``.

        ``logits`` is overwritten. ``token_ids`` (``[rows, candidates]``) says which vocabulary tokens
        the columns are, when they are a subset of it. A seeded row's ``q`` of token ``t`` is a hash of
        (seed, position of the token sampled, ``t``) (:func:`_seeded_uniforms`): each token has its own
        draw, however many candidates the batch gave the row, on every device alike.
        """
        # Probabilities relative to the row's most likely token: scaling a row does not move the race's
        # argmax, and min-p compares exactly this ratio. (Masking logits with -inf instead would be
        # slower: exp of -inf takes ~3x longer than exp of a number.)
        probs = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        min_p = [s.params.min_p for s in seqs]
        if any(min_p):
            probs.masked_fill_(probs < _column(min_p, probs), 0.0)
        q = torch.empty_like(probs)
        seeded = [i for i, s in enumerate(seqs) if s.seed is not None]
        if len(seeded) < len(seqs):
            q.uniform_()
        if seeded:
            row_keys = [_row_key(seqs[i].seed, len(seqs[i].token_ids)) for i in seeded]  # type: ignore[arg-type]
            keys = to_device(row_keys, torch.int64, q.device)
            rows = _index(seeded, q)
            columns = torch.arange(q.shape[1], device=q.device).expand(len(seeded), -1)
            q[rows] = _seeded_uniforms(keys, columns if token_ids is None else token_ids[rows])
        # -log(U) is Exp(1), ~5x faster than exponential_() on the CPU; U < 1 keeps q > 0 (no 0 / 0).
        return argmax(probs.div_(q.log_().neg_()))


class _PerRequest(Generic[_Derived]):
    """Values derived once from each request's parameters, kept while the request is in the batch.

    Entries are keyed by ``id(params)``; holding the params keeps their id from being reused while the entry lives. A
    request with ``n`` completions has ``n`` rows, which share its entry.

    Args:
        derive: builds a request's value from its parameters.

    """

    def __init__(self, derive: Callable[[SamplingParams], _Derived]) -> None:
        self.derive = derive
        self.entries: dict[int, tuple[SamplingParams, _Derived]] = {}

    def of(self, params: list[SamplingParams], rows: list[int]) -> list[_Derived]:
        """The values of the given rows' requests; the entries of requests not among them are dropped."""
        entries = {}
        for i in rows:
            key = id(params[i])
            entries[key] = self.entries.get(key) or (params[i], self.derive(params[i]))
        self.entries = entries
        return [entries[id(params[i])][1] for i in rows]


def _top_k_top_p(
    logits: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Apply top-k, then top-p to the renormalized top-k distribution, as Hugging Face does.

    Only each row's most likely tokens are looked at (a ``topk``, much cheaper than sorting the
    vocabulary): as many as the largest ``top_k``, or ``_NUCLEUS_CANDIDATES`` for rows with top-p
    alone, widening for the rows whose nucleus turns out larger.

    Returns:
        Groups of ``(rows, values, token_ids)``: the rows of ``logits`` in the group, their candidates'
        logits in descending order (``-inf`` where dropped) and the candidates' token ids.

    """
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # A top_p of 1 becomes inf: a cumulative sum that rounds up to 1.0 must not drop tail tokens.
    top_p = [p.top_p if p.top_p < 1 else float("inf") for p in params]
    nucleus_alone = [k == vocab and p < 1 for k, p in zip(top_k, top_p, strict=True)]
    width = min(vocab, max([k for k in top_k if k < vocab] + [_NUCLEUS_CANDIDATES * any(nucleus_alone)]))
    if logits.is_cuda and any(nucleus_alone):
        # A GPU sorts a whole vocabulary per row in microseconds: widening would cost a wait for the device.
        width = vocab

    groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    pending = list(range(len(params)))
    while pending:
        x = _take(logits, pending)
        k = to_device([top_k[i] for i in pending], torch.int64, logits.device)
        p = _column([top_p[i] for i in pending], logits)
        values, token_ids = x.topk(width, dim=-1)
        # Ties with the k-th logit stay, as in Hugging Face.
        kth = values.gather(1, (k - 1).clamp_(max=width - 1).unsqueeze(1))
        values.masked_fill_(values < kth, float("-inf"))
        done = None
        if any(top_p[i] < 1 for i in pending):
            log_norm = values.logsumexp(-1)
            if any(nucleus_alone[i] for i in pending):
                # Without top-k the nucleus is a share of the whole vocabulary's probability.
                log_norm = torch.where(k < vocab, log_norm, x.logsumexp(-1))
            probs = (values - log_norm.unsqueeze(1)).exp_()
            cumulative = probs.cumsum(-1)
            values.masked_fill_(cumulative - probs >= p, float("-inf"))
            if width < vocab and any(nucleus_alone[i] for i in pending):
                # The candidates hold a row's whole nucleus once their mass reaches top_p (top-k rows always do).
                done = ((k < vocab) | (cumulative[:, -1] >= p.squeeze(1))).tolist()
        if done is None or all(done):
            groups.append((pending, values, token_ids))
            break
        rows = [j for j, f in enumerate(done) if f]
        if rows:
            local = _index(rows, logits)
            groups.append(([pending[j] for j in rows], values[local], token_ids[local]))
        pending = [pending[j] for j, f in enumerate(done) if not f]
        width = min(vocab, width * _WIDEN)
    return groups


def _apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Set to ``-inf`` the logits of the tokens ``mask`` does not allow, in ``rows`` (xgrammar's kernel).

    On the CPU xgrammar's C++ loop takes ~90 us per row of a 49k vocabulary, where unpacking the bits with torch
    ops took 40 ms for any batch; on CUDA it is a Triton kernel, fed without waiting for the device.
    """
    import xgrammar

    if logits.is_cuda:
        device_mask = to_device(mask.numpy(), torch.int32, logits.device)
        xgrammar.apply_token_bitmask_inplace(logits, device_mask, indices=_index(rows, logits))  # type: ignore[arg-type]
    else:
        xgrammar.apply_token_bitmask_inplace(logits, mask, indices=rows)


def _row_key(seed: int, position: int) -> int:
    """A 64-bit key of a seeded row's draws: splitmix64 of its seed and the position of the token it samples."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) - 2**63  # as a signed int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Mueller's), in int64 arithmetic that cannot overflow."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _seeded_uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), one per ``(row, token)``, a function of the row's key and the token only.

    Args:
        keys: ``[rows]`` int64 row keys (:func:`_row_key`).
        token_ids: ``[rows, columns]`` the tokens to draw for.

    """
    low, high = (keys & 0xFFFFFFFF).unsqueeze(1), ((keys >> 32) & 0xFFFFFFFF).unsqueeze(1)
    bits = _hash32(_hash32(token_ids ^ low) ^ high) >> 8  # 24 bits: what a float32 holds exactly
    return (bits.float() + 0.5) * 2**-24


def _gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, nums: list[int]) -> LogprobTensors:
    """Per row: the chosen token's logprob and rank, then the row's top ``nums[row]`` tokens."""
    chosen = chosen.unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprobs).sum(-1) + 1
    top_logprobs, top_ids = logprobs.topk(max(nums), dim=-1)
    return LogprobTensors(
        token_ids=torch.cat([chosen, top_ids], 1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], 1),
        ranks=ranks,
        nums=nums,
    )


def _partition(flags: list[bool]) -> tuple[list[int], list[int]]:
    """Split the row numbers into those whose flag is set and the others."""
    return [i for i, f in enumerate(flags) if f], [i for i, f in enumerate(flags) if not f]


def _token_positions(
    rows: list[int], token_lists: list[list[int]], logits: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """Flatten per-row token lists into positions in ``logits.view(-1)``, with the number per row."""
    counts = [len(t) for t in token_lists]
    # numpy builds these ~100x faster than torch.tensor / repeat_interleave do.
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])
    positions = tokens + np.repeat(np.asarray(rows, dtype=np.int64) * logits.shape[-1], counts)
    return to_device(positions, torch.int64, logits.device), counts


def _per_position(values: list[float], counts: list[int], like: torch.Tensor) -> torch.Tensor:
    """Repeat each row's value once per position of that row."""
    return to_device(np.repeat(np.asarray(values, dtype=np.float32), counts), torch.float32, like.device)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    return to_device(rows, torch.int64, like.device)


def _take(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Return the given rows of ``x``; ``x`` itself when that is all of them, so in-place work reaches it."""
    return x if len(rows) == x.shape[0] else x[_index(rows, x)]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row parameters as a ``[rows, 1]`` float column on ``like``'s device, to broadcast over tokens."""
    return to_device(values, torch.float32, like.device).unsqueeze(1)
