"""One sequence being generated: its tokens, its place in the KV cache and its sampling state."""

import enum
from itertools import count

from spindle.shared import FinishReason, SamplingParams
from spindle.shared.pooling_params import PoolingParams
from spindle.shared.protocol import ImageInput, PromptEmbeds


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """A prompt and the tokens generated after it, as the scheduler sees it; ``n > 1`` requests have one per completion.

    ``num_computed_tokens`` counts the tokens whose K/V is already in the cache; the scheduler moves it
    forward by the chunk it schedules, and preemption resets it to zero (recompute). It holds scheduling state only:
    what the model runner keeps of a sequence (its pooling state, image embeddings, prompt log-probabilities so far)
    is the runner's, what structured output keeps (its grammar matcher) the
    :class:`~spindle.backend.structured_output.StructuredOutputManager`'s, and its drafts live in one step's
    :class:`~spindle.backend.scheduler_output.SchedulerOutput`.

    With ``pooling`` set it is an embedding request's: its prompt is prefilled and pooled
    (:mod:`spindle.backend.pooler`), and it ends when the prompt is complete, generating nothing. A vision-language
    prompt has ``images``, each at its placeholder tokens; a prompt given as embeddings has ``prompt_embeds``, its
    token ids placeholders. A resumed completion starts with ``output_token_ids``, the
    output it had generated on a backend that died: it is recomputed as a preempted sequence is, and goes on from there.
    """

    _ids = count()

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora_id: int | None = None,
        images: list[ImageInput] | None = None,
        output_token_ids: list[int] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        # The LoRA adapter it runs with (spindle.backend.lora_manager's id, unique per loaded adapter); None: the base.
        self.lora_id = lora_id
        # A resumed completion starts with the output it had generated (EngineRequest.resumed).
        self.token_ids = [*prompt_token_ids, *(output_token_ids or [])]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        # n > 1 completions of a seeded request must differ, so each gets seed + index. The sampler draws from
        # (seed, position): a sequence has no generator state, and a recomputed one samples what it did before.
        self.seed = None if params.seed is None else params.seed + index
        self.first_scheduled_time: float | None = None
        self.pooling = pooling
        self.images = images or []
        self.prompt_embeds = prompt_embeds
        # How many of its tokens the model runner holds (0: none, it holds no state of it): the rest go to it in the
        # next step that schedules it.
        self.num_runner_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been generated."""
        return len(self.token_ids) - self.num_prompt_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """How many more tokens it may generate: up to ``max_tokens`` (the context without one) and the context."""
        return min((self.params.max_tokens or max_model_len) - self.num_output_tokens, max_model_len - len(self))

    @property
    def skips_prefix_cache(self) -> bool:
        """Whether every prompt position must be computed: for prompt log-probabilities, or ``mean``/``cls`` pooling.

        ``last`` pooling needs only the last position, which is computed even when the whole prompt is cached.
        """
        return self.params.prompt_logprobs is not None or (self.pooling is not None and self.pooling.pooling != "last")

    @property
    def is_finished(self) -> bool:
        """Whether generation has ended."""
        return self.status == SequenceStatus.FINISHED
