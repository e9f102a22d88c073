"""Continuous batching, and the one place where a step's results change the sequences.

The scheduler decides which sequences run in the next step and how many tokens each contributes.
:meth:`Scheduler.schedule` returns the step's :class:`~spindle.backend.scheduler_output.SchedulerOutput`, the model
runner runs it, and :meth:`Scheduler.update_from_output` applies the runner's
:class:`~spindle.backend.runner_output.RunnerOutput`: it appends the tokens, gives back rejected drafts' cache slots,
advances grammars, ends the sequences that hit eos, a stop token, their length limit or the end of their grammar,
and frees their blocks.
"""

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Collection

from spindle.backend.block_manager import BlockManager
from spindle.backend.runner_output import RunnerOutput
from spindle.backend.scheduler_output import CachedSequence, NewSequence, SchedulerOutput
from spindle.backend.sequence import Sequence, SequenceStatus
from spindle.backend.speculative import DraftProposer
from spindle.backend.structured_output import StructuredOutputManager
from spindle.shared import FinishReason
from spindle.shared.config import SchedulerConfig
from spindle.shared.protocol import SequenceDelta

# The cost model of the decode-latency bound, in units of one prompt token's projections and MLP: a chunk of n tokens
# after c computed ones costs n * (1 + (c + n / 2) / KEYS_PER_TOKEN) + c / PREFIX_KEYS, its queries' keys plus one walk
# over the cached prefix in every layer; a step of decodes costs STEP_OVERHEAD plus one unit per decode plus its
# contexts over KEYS_PER_TOKEN. Measured on 2 EPYC cores, SmolLM2-135M float32 (int4 decodes), 8 decode streams beside
# one chunk of n tokens after c cached (ms a step): alone 35.5; c=0: n=1 49.8, 32 106, 128 324 (a prompt token 2.2
# ms); c=7,168: n=1 82.2, 8 217, 32 504, 128 1,922 (1.7 us per (query, cached key) pair, and 3 us per cached key
# however short the chunk). The decodes' cost against a prompt token's is the machine's, dtype's and quantization's
# (27 units for 8 decodes in bf16 on AVX-512, 16 here; STEP_OVERHEAD is the former's): with the fixed model, 8 streams
# beside a 7,680-token prompt ran 2.8x slower than alone here, so the scheduler learns the two units' seconds from the
# steps it times. A joint least-squares fit of both over recent steps was tried and left 2.8x: beside a long prompt
# nearly every step mixes the two in one proportion, so the fit cannot tell them apart.
KEYS_PER_TOKEN = 1300
PREFIX_KEYS = 700
STEP_OVERHEAD = 24
CREDIT_STEPS = 8
"""Steps of unspent prefill credit a scheduler may save for one chunk (see :data:`WALK_SHARE`)."""
WALK_SHARE = 4.0
"""A long prompt's next chunk waits, its credit saved, until the credit is this many times the chunk's walk over the
cached prefix, or full (:data:`CREDIT_STEPS`), unless it pays for the whole rest of the prompt. A chunk has costs
that do not shrink with its tokens (that walk, in every layer, and what a step with a prefill chunk costs beyond a
step of decodes), which the few tokens one step's credit buys late in a long prompt could not amortize: 8 decode
streams beside a 7,680-token prompt (2 Zen 4 cores, bf16, ``max_decode_slowdown=2``), spending each step's credit at
once, advanced the prompt ~5 tokens a step, ran 1.6-1.8x slower than alone (under the bound, yet) and gave the prompt
its first token after 77-111 s; with the wait (and 8 steps of credit instead of 2), 1.8-2.0x and 44-57 s."""
SMOOTHING = 0.2
"""The newest step's weight in the running averages of the steps' seconds and cost units."""


class Scheduler:
    """Continuous batching under a token budget, with chunked prefill and preemption by recompute.

    Running sequences (decodes, and prefills already under way) go first, in queue order. When the cache is out of
    blocks, the last running sequence is preempted: its blocks are freed and it goes back to the waiting queue to be
    recomputed later (its full blocks usually come back from the prefix cache). Waiting sequences are admitted in
    queue order while the budget, ``max_num_seqs`` and the free blocks allow, and never in a step whose running
    sequences ran out of blocks; one whose structured-output grammar is still compiling is passed over without holding
    up those behind it. So is one whose LoRA adapter could not have a slot: with
    ``max_loras`` set, the running sequences use at most that many distinct adapters (the base model needs none),
    and a sequence of another adapter waits until one of them has no running sequence left.

    The queue order is the ``policy``'s:

    * ``fcfs``: arrival. The newest running sequence is preempted first and goes back to the front of the waiting
      queue; ``Sequence.priority`` is ignored.
    * ``priority`` (vLLM's): lower ``priority`` first, then earlier arrival. Both queues are kept in that order, so
      the lowest-priority running sequence gets the budget last and is preempted first, and a preempted one waits at
      its place. Before each step, when the first waiting sequence lacks a slot under ``max_num_seqs`` or the blocks
      of a first chunk as long as the budget, running sequences of a strictly worse effective priority (below) are
      preempted, worst first, until it has them; never one of the same or a better one.

    Starvation is bounded by aging: with ``priority_aging`` = T > 0, a sequence's effective priority is
    ``priority - (now - arrival_time) / T``, one level better per T seconds since its request arrived. Every sequence
    ages at the same rate, so this order is that of ``arrival_time + priority * T``, fixed for a sequence's life
    (no clock is read). Hence a request of priority p that arrived at time a ranks ahead of (is admitted before, and
    preempted after) every request of priority q that arrives later than a + (p - q) * T: only requests of a
    better priority q < p that arrive within (p - q) * T seconds after it can overtake it, and it waits for no
    request that arrives after a + (p - p_min) * T, where p_min is the best priority sent (the one exception: it
    is passed over while its own grammar compiles). With T = 0 the order is strict priority, and a steady stream of
    better requests can starve a worse one.

    With ``max_decode_slowdown`` > 1, the steps that carry decodes take only as much prefill work of long prompts
    (more than ``long_prefill_token_threshold`` tokens) as keeps their estimated cost within that factor of the
    decodes' own (the cost model above), so streams keep their rate while a long prompt is prefilled beside them, at
    the price of that prompt's time to first token. Each such step earns ``slowdown - 1`` times its decodes' cost in
    prefill credit, up to ``CREDIT_STEPS`` steps' worth, and long prompts' chunks spend it, each once the credit is
    ``WALK_SHARE`` times its walk over the cached prefix (or full); when the credit is full and pays for no token, the
    first long prefill still gets one, so a prompt always advances. The decodes' cost in
    prompt-token units is learned from the measured step times that :meth:`observe` is given (until then it is the
    model's). Shorter prompts are prefilled whole, beside the streams, as without the bound: holding a burst of them
    to a few streams' credit would starve them, as each finished prompt adds a stream that earns a little more
    (serving 128 requests of ~15 tokens 64 at a time: TTFT p50 9-17 s, against 1.4-2.0 s prefilled whole). 0 turns
    the bound off: prefill chunks fill the token budget (best throughput).

    A request is *paused* (:meth:`pause_requests`) while the consumer of its stream lags behind (back-pressure from
    the frontend): its sequences keep their blocks, their place in the queues and their slots under
    ``max_num_seqs``, but get no tokens (no decodes, no prefill chunks, no drafts; a grammar has nothing to do)
    until it is resumed, so a stream nobody reads burns no compute. The scheduler never ends a paused request: the
    frontend aborts it after its own timeout. A paused sequence gives way: when a running sequence lacks blocks, or a
    waiting one blocks or a slot, paused running sequences are preempted first (the last first), as they use
    neither now; one preempted, or still waiting, is passed over until its request is resumed.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        max_model_len: int,
        eos_token_ids: Collection[int],
        structured_output: StructuredOutputManager,
        drafter: DraftProposer,
        max_loras: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_decode_slowdown = config.max_decode_slowdown
        self.by_priority = config.scheduling_policy == "priority"
        self.priority_aging = config.priority_aging
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.structured_output = structured_output
        self.drafter = drafter
        # Request id -> its sequences (one per completion), while any of them is unfinished; and those by seq_id.
        self.requests: dict[str, list[Sequence]] = {}
        self.seqs: dict[int, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # The requests paused by their frontend: unfinished ones only (a request is forgotten here with its last).
        self.paused: set[str] = set()
        self.num_preemptions = 0
        self.max_loras = max_loras
        # LoRA adapter id -> its running sequences; and its unfinished (waiting or running) ones.
        self.running_loras: dict[int, int] = {}
        self.lora_users: Counter[int] = Counter()
        # Sequences the runner holds state of that finished or were preempted since the last output.
        self.gone_seq_ids: list[int] = []
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.prefill_credit = 0.0
        # The most credit the steps may save: CREDIT_STEPS times the latest step's earnings.
        self.credit_cap = 0.0
        # Whether the step being scheduled may give its first long prefill a token the credit does not pay for.
        self.force_token = False
        # Running averages of (seconds, cost units) from observe(), of decode steps and of prefill chunks: their
        # ratios are a unit's seconds, weighted by cost (an average of per-step ratios would overweight the short
        # chunks, whose fixed costs the model leaves out, and hold the prefill to less than its share).
        self.decode_time: tuple[float, float] | None = None
        self.prefill_time: tuple[float, float] | None = None

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences (one per completion)."""
        self.requests[seqs[0].request_id] = seqs
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
            if seq.lora_id is not None:
                self.lora_users[seq.lora_id] += 1
            self._enqueue(self.waiting, seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.requests)

    def has_unpaused(self) -> bool:
        """Whether any unfinished request is not paused: whether a step may have work (else none can)."""
        return len(self.requests) > len(self.paused)

    def pause_requests(self, request_ids: Collection[str]) -> None:
        """Schedule no tokens for these requests until they are resumed; unknown or finished ids are ignored."""
        self.paused.update(request_id for request_id in request_ids if request_id in self.requests)

    def resume_requests(self, request_ids: Collection[str]) -> None:
        """Schedule these paused requests again, from where they were; others are ignored."""
        self.paused.difference_update(request_ids)

    def abort_requests(self, request_ids: Collection[str]) -> None:
        """Drop requests wherever they are and free all their blocks; unknown ids are ignored."""
        for request_id in request_ids:
            for seq in self.requests.get(request_id, []):
                if not seq.is_finished:
                    self._finish(seq, FinishReason.ABORT)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion of a request (the frontend matched a stop string) and free its blocks."""
        # By index, not position: a resumed request has only the completions that had not finished.
        seq = next((s for s in self.requests.get(request_id, []) if s.index == index), None)
        if seq is not None and not seq.is_finished:
            self._finish(seq, FinishReason.STOP)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their blocks; the drafts of those that speculate."""
        drafts = self.drafter.propose(s for s in self.running if s.request_id not in self.paused)
        # Preemptions that make room for a waiting sequence are there to admit it: unlike those below, they do not
        # close this step to admissions.
        made_room = self._make_room() if self.by_priority else 0
        out = SchedulerOutput(num_preempted=made_room)
        budget = self.max_num_batched_tokens
        now = time.time()
        self._earn_prefill_credit(out)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.request_id in self.paused:
                i += 1
                continue
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            seq_drafts = drafts.get(seq.seq_id, [])
            if num_new == 1 and seq_drafts:
                # A decode with drafts: the last token and as many drafts as the budget holds, verified together.
                seq_drafts = seq_drafts[: budget - 1]
                num_new += len(seq_drafts)
                if not self.block_manager.can_allocate(seq, num_new):
                    # Drafts are worth no one's preemption.
                    seq_drafts, num_new = [], 1
            elif num_new > 1:
                num_new = self._prefill_chunk(seq, num_new, out)
                if not num_new:
                    i += 1
                    continue
            while not self.block_manager.can_allocate(seq, num_new):
                paused = self._last_paused()
                victim = self.running[-1] if paused is None else paused
                if self.running.index(victim) < i:  # a paused one passed over: seq moves up
                    i -= 1
                self.running.remove(victim)
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                self._schedule(seq, num_new, seq_drafts, out, now)
                budget -= num_new
                i += 1
        out_of_blocks = out.num_preempted > made_room
        i = 0
        while not out_of_blocks and i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            if not self._admissible(seq):
                i += 1
                continue
            if len(self.running) >= self.max_num_seqs and not self._preempt_paused(out):
                break
            if not seq.skips_prefix_cache:
                # Prompt logprobs need logits, and mean/cls pooling hidden states, at every prompt position.
                self.block_manager.match_prefix(seq)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            num_new = self._prefill_chunk(seq, num_new, out)
            while num_new and not self.block_manager.can_allocate(seq, num_new) and self._preempt_paused(out):
                pass
            if not num_new or not self.block_manager.can_allocate(seq, num_new):
                self.block_manager.free_blocks(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            i = self.waiting.index(seq)  # a preempted paused sequence may have gone back before it
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self._count_lora(seq, 1)
            self._enqueue(self.running, seq)
            self._schedule(seq, num_new, [], out, now)
            budget -= num_new
        if out.num_scheduled_tokens:  # an empty step is not run: the runner hears of them in the next one
            # Last: the preemptions above are among them.
            out.finished_seq_ids, self.gone_seq_ids = self.gone_seq_ids, []
        out.running_lora_ids = list(self.running_loras)
        out.lora_ids_in_use = list(self.lora_users)
        return out

    def _schedule(self, seq: Sequence, num_new: int, drafts: list[int], out: SchedulerOutput, now: float) -> None:
        """Give ``seq`` the blocks of its next ``num_new`` tokens and add it to ``out`` with what the runner lacks."""
        kept = len(seq.block_table)
        self.block_manager.allocate(seq, num_new)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        if seq.num_runner_tokens:
            new_tokens = seq.token_ids[seq.num_runner_tokens :]
            out.cached_seqs.append(
                CachedSequence(seq.seq_id, new_tokens, seq.block_table[kept:], seq.num_computed_tokens)
            )
        else:
            out.new_seqs.append(
                NewSequence(
                    seq.seq_id,
                    list(seq.token_ids),
                    seq.num_prompt_tokens,
                    seq.params,
                    seq.seed,
                    list(seq.block_table),
                    seq.num_computed_tokens,
                    seq.lora_id,
                    seq.pooling,
                    seq.images,
                    seq.prompt_embeds,
                )
            )
        seq.num_runner_tokens = len(seq)
        out.num_scheduled_tokens[seq.seq_id] = num_new
        if drafts:
            out.spec_token_ids[seq.seq_id] = drafts
        end = seq.num_computed_tokens + num_new
        if seq.images:
            reached = [k for k, image in enumerate(seq.images) if image.overlaps(seq.num_computed_tokens, end)]
            if reached:
                out.scheduled_images[seq.seq_id] = reached
        if end >= len(seq) and self.structured_output.is_constrained(seq.seq_id):
            out.grammar_seq_ids.append(seq.seq_id)

    def update_from_output(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[SequenceDelta]:
        """Apply a step's results, the one place where sequences change; returns what changed for each sequence.

        One delta per sequence that got tokens, or completed an embedding (those first, each with its embedding).
        """
        if output.seconds is not None:
            self.observe(scheduled, output.seconds)
            self.drafter.observe(scheduled.total_num_scheduled_tokens, output.seconds)
        for seq_id, num_new in scheduled.num_scheduled_tokens.items():
            self.seqs[seq_id].num_computed_tokens += num_new
        deltas = [self._finish_embedding(self.seqs[seq_id], data) for seq_id, data in output.embeddings.items()]
        for seq_id, token_ids in output.sampled_token_ids.items():
            deltas.append(self._append(self.seqs[seq_id], token_ids, output))
        return deltas

    def _append(self, seq: Sequence, token_ids: list[int], output: RunnerOutput) -> SequenceDelta:
        """Append a step's tokens to ``seq``, ending it where one stops it; its delta."""
        first = seq.num_output_tokens == 0
        num_drafts = output.num_drafts.get(seq.seq_id, 0)
        num_accepted = len(token_ids) - 1 if num_drafts else 0
        if num_drafts:
            # The rejected drafts' K/V is not the sequence's: step back over it.
            self.drafter.record(seq.seq_id, num_drafts, num_accepted)
            seq.num_computed_tokens -= num_drafts - num_accepted
        constrained = self.structured_output.follows(seq.seq_id)
        emitted = 0
        for token_id in token_ids:
            seq.token_ids.append(token_id)
            emitted += 1
            if constrained and self.structured_output.advance(seq.request_id, seq.seq_id, token_id):
                self._finish(seq, FinishReason.STOP)
            else:
                self._check_stop(seq, token_id)
            if seq.is_finished:
                break
        if num_drafts and not seq.is_finished:
            self.block_manager.trim(seq)
        logprobs = output.logprobs.get(seq.seq_id)
        return SequenceDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=token_ids[:emitted],
            new_logprobs=None if logprobs is None else logprobs[:emitted],
            prompt_logprobs=output.prompt_logprobs.get(seq.seq_id) if first else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_tokens if first else 0,
            first_scheduled_time=seq.first_scheduled_time if first else None,
            num_draft_tokens=num_drafts,
            num_accepted_draft_tokens=num_accepted,
        )

    def _finish_embedding(self, seq: Sequence, embedding: bytes) -> SequenceDelta:
        """End an embedding sequence whose prompt is complete (its blocks are freed) and report its embedding."""
        self._finish(seq, FinishReason.STOP)
        return SequenceDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=[],
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            first_scheduled_time=seq.first_scheduled_time,
            embedding=embedding,
        )

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        """End ``seq`` if its new token is eos or a stop token (past ``min_tokens``), or it reached its length."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return self._finish(seq, FinishReason.STOP)
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return self._finish(seq, FinishReason.STOP, token_id)
        if seq.tokens_left(self.max_model_len) <= 0:
            self._finish(seq, FinishReason.LENGTH)

    def observe(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Learn the cost model's scale from the measured time of a step that ran ``scheduled``.

        A step of decodes alone gives the seconds of a decode unit; a step with prefill chunks beside decodes, what
        is left of its time after its decodes' estimate, the seconds of a prefill unit.
        """
        if not scheduled.decode_cost:
            return
        if not scheduled.prefill_cost:
            self.decode_time = _smoothed(self.decode_time, (seconds, scheduled.decode_cost))
        elif self.decode_unit_seconds is not None:
            rest = seconds - scheduled.decode_cost * self.decode_unit_seconds
            if rest > 0:
                self.prefill_time = _smoothed(self.prefill_time, (rest, scheduled.prefill_cost))

    @property
    def decode_unit_seconds(self) -> float | None:
        """The measured seconds of a decode step's cost unit (``None`` before a decode step was observed)."""
        return None if self.decode_time is None else self.decode_time[0] / self.decode_time[1]

    @property
    def prefill_unit_seconds(self) -> float | None:
        """The measured seconds of a prefill chunk's cost unit (``None`` before a chunk beside decodes was observed)."""
        return None if self.prefill_time is None else self.prefill_time[0] / self.prefill_time[1]

    def _key(self, seq: Sequence) -> tuple[float, float, int]:
        """The priority policy's rank of ``seq`` (lowest first): its aged priority, then arrival, then creation."""
        if self.priority_aging:
            return seq.arrival_time + seq.priority * self.priority_aging, seq.arrival_time, seq.seq_id
        return seq.priority, seq.arrival_time, seq.seq_id

    def _enqueue(self, queue: deque[Sequence] | list[Sequence], seq: Sequence, front: bool = False) -> None:
        """Put ``seq`` in ``queue``: at its rank under the priority policy, else at the back (or the ``front``)."""
        if self.by_priority:
            bisect.insort(queue, seq, key=self._key)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def _make_room(self) -> int:
        """Preempt the running sequences ranked below the first waiting one that it needs the room of.

        The room is a slot under ``max_num_seqs`` and the blocks of a first chunk of up to the whole budget (cached
        blocks may make it need fewer). Only sequences of a strictly worse effective priority are preempted, worst
        first; returns how many.
        """
        seq = next((s for s in self.waiting if self._admissible(s)), None)
        if seq is None:
            return 0
        rank = self._key(seq)[0]
        chunk = min(len(seq), self.max_num_batched_tokens)
        num_preempted = 0
        while (
            self.running
            and self._key(self.running[-1])[0] > rank
            and (len(self.running) >= self.max_num_seqs or not self.block_manager.can_allocate(seq, chunk))
        ):
            self._preempt(self.running.pop())
            num_preempted += 1
        return num_preempted

    def _earn_prefill_credit(self, out: SchedulerOutput) -> None:
        """Add this step's earnings to the prefill credit where the bound applies, setting ``out.decode_cost``.

        The decodes' cost is in the model's units, and what they earn in prompt-token units: the model's, scaled by
        the measured seconds of each kind of unit once both are known.
        """
        self.force_token = False
        if self.max_decode_slowdown <= 1:
            return
        decode_contexts = [
            len(s) for s in self.running if len(s) - s.num_computed_tokens == 1 and s.request_id not in self.paused
        ]
        if not decode_contexts:
            self.prefill_credit = 0.0
            return
        out.decode_cost = STEP_OVERHEAD + len(decode_contexts) + sum(decode_contexts) / KEYS_PER_TOKEN
        scale = 1.0
        if self.decode_unit_seconds is not None and self.prefill_unit_seconds is not None:
            scale = self.decode_unit_seconds / self.prefill_unit_seconds
        earned = (self.max_decode_slowdown - 1) * out.decode_cost * scale
        self.credit_cap = CREDIT_STEPS * earned
        self.prefill_credit = min(self.prefill_credit + earned, self.credit_cap)
        self.force_token = self.prefill_credit >= self.credit_cap

    def _prefill_chunk(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> int:
        """How many of ``seq``'s next ``num_new`` prompt tokens to prefill in this step, adding their cost to ``out``.

        All of them where the bound does not apply (no decodes in the step, or a prompt of at most
        ``long_prefill_token_threshold`` tokens); else the largest chunk that the prefill credit pays for, spent from
        it, once the credit is ``WALK_SHARE`` times the chunk's prefix walk or full, or pays for the whole rest (none
        before). The step's first long prefill gets a token even when the credit pays for none, if the credit is
        full, so that a prompt always advances.
        """
        if not out.decode_cost:
            return num_new
        computed = seq.num_computed_tokens
        if len(seq) > self.long_prefill_token_threshold:
            per_token = 1 + computed / KEYS_PER_TOKEN
            walk = computed / PREFIX_KEYS
            # The largest n with n * (per_token + n / (2 * KEYS_PER_TOKEN)) <= credit - walk: that quadratic's root.
            root = math.sqrt(per_token * per_token + 2 * max(self.prefill_credit - walk, 0) / KEYS_PER_TOKEN)
            affordable = int(KEYS_PER_TOKEN * (root - per_token))
            if affordable < num_new and self.prefill_credit < min(self.credit_cap, WALK_SHARE * walk):
                affordable = 0  # saving up, so that the walk is a small part of the chunk
            num_new = min(num_new, max(affordable, int(self.force_token)))
            self.force_token = False
            self.prefill_credit -= self._chunk_cost(computed, num_new)
        out.prefill_cost += self._chunk_cost(computed, num_new)
        return num_new

    @staticmethod
    def _chunk_cost(computed: int, n: int) -> float:
        """The model's cost of a chunk of ``n`` tokens after ``computed`` ones (none for no tokens)."""
        if not n:
            return 0.0
        return n * (1 + (computed + n / 2) / KEYS_PER_TOKEN) + computed / PREFIX_KEYS

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | None = None) -> None:
        """End ``seq`` (eos, stop token, length or abort) and free its blocks at once; forget its request with its last.

        The one way a sequence ends.
        """
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._count_lora(seq, -1)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.free_blocks(seq)
        self._leave_runner(seq)
        self.drafter.forget(seq.seq_id)
        del self.seqs[seq.seq_id]
        if seq.lora_id is not None:
            self.lora_users[seq.lora_id] -= 1
            if not self.lora_users[seq.lora_id]:
                del self.lora_users[seq.lora_id]
        seqs = self.requests[seq.request_id]
        if all(s.is_finished for s in seqs):
            del self.requests[seq.request_id]
            self.paused.discard(seq.request_id)
            self.structured_output.remove_request(seq.request_id, [s.seq_id for s in seqs])

    def _leave_runner(self, seq: Sequence) -> None:
        """Have the runner drop its state of ``seq`` in the next step (it holds none of a sequence never scheduled)."""
        if seq.num_runner_tokens:
            self.gone_seq_ids.append(seq.seq_id)
            seq.num_runner_tokens = 0

    def _admissible(self, seq: Sequence) -> bool:
        """Whether waiting ``seq`` may be admitted now: not paused, its grammar compiled, its adapter has a slot."""
        if seq.request_id in self.paused or self.structured_output.is_compiling(seq.request_id):
            return False
        return self._lora_fits(seq)

    def _last_paused(self) -> Sequence | None:
        """The last running sequence of a paused request, the first to give way; ``None`` if none is paused."""
        if not self.paused:
            return None
        return next((s for s in reversed(self.running) if s.request_id in self.paused), None)

    def _preempt_paused(self, out: SchedulerOutput) -> bool:
        """Preempt the last paused running sequence to make room for a waiting one; whether there was one."""
        victim = self._last_paused()
        if victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim)
        out.num_preempted += 1
        return True

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter can have a slot if it runs: the base model, or one of at most ``max_loras``."""
        if seq.lora_id is None or self.max_loras is None or seq.lora_id in self.running_loras:
            return True
        return len(self.running_loras) < self.max_loras

    def _count_lora(self, seq: Sequence, change: int) -> None:
        """Count ``seq`` in (``change`` 1) or out of (-1) the running sequences of its LoRA adapter."""
        if seq.lora_id is None:
            return
        count = self.running_loras.get(seq.lora_id, 0) + change
        if count:
            self.running_loras[seq.lora_id] = count
        else:
            del self.running_loras[seq.lora_id]

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it again, to be recomputed (the runner starts it afresh)."""
        self.num_preemptions += 1
        self._count_lora(seq, -1)
        self._leave_runner(seq)
        self.block_manager.free_blocks(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(self.waiting, seq, front=True)


def _smoothed(average: tuple[float, float] | None, sample: tuple[float, float]) -> tuple[float, float]:
    """The next value of an exponential moving average of (seconds, units) pairs (the first sample as it is)."""
    if average is None:
        return sample
    return (
        (1 - SMOOTHING) * average[0] + SMOOTHING * sample[0],
        (1 - SMOOTHING) * average[1] + SMOOTHING * sample[1],
    )
