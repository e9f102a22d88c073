"""What the model runner computed in one step: the typed result that the scheduler applies to its sequences."""

import msgspec

from spindle.shared.outputs import TokenLogprobs


class RunnerOutput(msgspec.Struct):
    """The results of one :meth:`~spindle.backend.model_runner.ModelRunner.sample`, by ``seq_id``.

    :meth:`~spindle.backend.scheduler.Scheduler.update_from_output` applies it: the one place where sequences change.

    Attributes:
        sampled_token_ids: for each sequence whose known tokens are all computed after this step (embedding sequences
            aside), in row order, the tokens it emits: one, or with drafts (speculative decoding) the drafts the
            model agreed with and then its own next token.
        num_drafts: the drafts each of those verified (absent: none), so that the scheduler gives back the rejected
            ones' cache slots.
        logprobs: the log-probabilities of each emitted token, for the sequences that asked (``params.logprobs``).
        prompt_logprobs: each sequence's prompt log-probabilities, whole, in the step that samples its first token,
            for those that asked (``params.prompt_logprobs``).
        embeddings: the embedding (little-endian float32 values) of each embedding sequence whose prompt this step
            completed; they sampled nothing.
        seconds: how long the step took, from :meth:`~spindle.backend.model_runner.ModelRunner.execute`'s start to
            the results on the host (the scheduler's cost model learns from it); None when not timed.

    """

    sampled_token_ids: dict[int, list[int]] = {}
    num_drafts: dict[int, int] = {}
    logprobs: dict[int, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
    embeddings: dict[int, bytes] = {}
    seconds: float | None = None
