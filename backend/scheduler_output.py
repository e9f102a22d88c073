"""What the scheduler decides for one step: the typed boundary between the scheduler and the model runner.

:meth:`~spindle.backend.scheduler.Scheduler.schedule` returns a :class:`SchedulerOutput`;
:meth:`~spindle.backend.model_runner.ModelRunner.execute` runs it. The runner never sees the scheduler's
:class:`~spindle.backend.sequence.Sequence`: it keeps its own state of each sequence it runs, keyed by ``seq_id``,
created from a :class:`NewSequence` and brought up to date by a :class:`CachedSequence` (as vLLM's ``NewRequestData``
and ``CachedRequestData``). The structs are msgspec's, so that rank 0 broadcasts the same output to the
tensor-parallel workers, which run the same runner code on it (:mod:`spindle.backend.parallel`); in one process they
travel as they are.
"""

import msgspec

from spindle.shared.pooling_params import PoolingParams
from spindle.shared.protocol import ImageInput, PromptEmbeds
from spindle.shared.sampling_params import SamplingParams


class NewSequence(msgspec.Struct, array_like=True, omit_defaults=True):
    """A sequence the runner holds no state of: scheduled for the first time, or again after a preemption.

    Attributes:
        seq_id: the sequence's id, unique for the engine's life.
        token_ids: its prompt and the tokens generated so far (a sequence preempted after its first token comes back
            with them, to be recomputed).
        num_prompt_tokens: the prompt's length.
        params: its sampling parameters.
        seed: the seed its samples draw from (the request's ``seed`` plus the completion's index), or None.
        block_ids: its block table.
        num_computed_tokens: the tokens whose K/V is in the cache already (a prefix-cache hit).
        lora_id: its LoRA adapter, or None for the base model.
        pooling: how to pool it, for an embedding sequence (which samples nothing).
        images: the prompt's images at their placeholders.
        prompt_embeds: the embeddings of a prompt given as embeddings, or None.

    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None
    block_ids: list[int]
    num_computed_tokens: int
    lora_id: int | None = None
    pooling: PoolingParams | None = None
    images: list[ImageInput] = []
    prompt_embeds: PromptEmbeds | None = None


class CachedSequence(msgspec.Struct, array_like=True):
    """What changed for a sequence the runner already holds, since it was last scheduled.

    Attributes:
        seq_id: the sequence's id.
        new_token_ids: the tokens appended to it since (those sampled in its last step).
        new_block_ids: the blocks appended to its table since. Its table first drops the blocks past
            ``num_computed_tokens`` (rejected draft tokens' blocks, given back after a speculative step).
        num_computed_tokens: the tokens whose K/V is in the cache before this step.

    """

    seq_id: int
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    """One step's work.

    Attributes:
        new_seqs: the scheduled sequences the runner holds no state of.
        cached_seqs: the scheduled sequences it holds, with what changed.
        num_scheduled_tokens: by ``seq_id``, in schedule order, the tokens each computes now: 1 for a decode (plus
            its drafts), a chunk of its prompt for a prefill (chunked prefill).
        spec_token_ids: by ``seq_id``, the draft tokens a decode verifies this step (speculative decoding), after
            its last token.
        scheduled_images: by ``seq_id``, the indices of its images whose placeholders this step's chunk reaches:
            the runner encodes those its encoder cache lacks.
        grammar_seq_ids: the sequences that sample under a structured-output grammar this step: the rows of the
            grammar bitmask (:meth:`~spindle.backend.structured_output.StructuredOutputManager.bitmask`).
        finished_seq_ids: the sequences gone since the previous output (finished, aborted or preempted): the runner
            drops their state first, as a preempted one may come back among ``new_seqs`` in the same output.
        running_lora_ids: the LoRA adapters of all running sequences, scheduled now or not: their slots stay.
        lora_ids_in_use: the adapters of every unfinished sequence, waiting ones too: an unloaded adapter's weights
            stay until it is no longer among them.
        num_preempted: running sequences preempted while scheduling this step.
        decode_cost: the step's decodes in the scheduler's cost model (0 where its decode bound does not apply).
        prefill_cost: its prefill chunks in the same units.

    """

    new_seqs: list[NewSequence] = []
    cached_seqs: list[CachedSequence] = []
    num_scheduled_tokens: dict[int, int] = {}
    spec_token_ids: dict[int, list[int]] = {}
    scheduled_images: dict[int, list[int]] = {}
    grammar_seq_ids: list[int] = []
    finished_seq_ids: list[int] = []
    running_lora_ids: list[int] = []
    lora_ids_in_use: list[int] = []
    num_preempted: int = 0
    decode_cost: float = 0.0
    prefill_cost: float = 0.0

    @property
    def total_num_scheduled_tokens(self) -> int:
        """The step's tokens, drafts included."""
        return sum(self.num_scheduled_tokens.values())
