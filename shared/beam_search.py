"""Beam search's parameters and results, as vLLM's ``BeamSearchParams`` and ``BeamSearchOutput`` name them."""

import math
from typing import Literal

import msgspec

from spindle.shared.errors import InvalidRequestError
from spindle.shared.outputs import FinishReason
from spindle.shared.sampling_params import MAX_LOGPROBS


class BeamSearchParams(msgspec.Struct, kw_only=True, frozen=True):
    """How to beam-search the completions of a prompt (:meth:`~spindle.frontend.engine.llm.LLM.beam_search`).

    The search follows transformers' ``generate(num_beams=...)`` without sampling: at each step every running beam
    is extended by its most likely tokens, the ``(1 + number of eos tokens) x beam_width`` best extensions by
    cumulative log-probability are kept, the best ``beam_width`` that did not end continue, and those among the best
    ``beam_width`` that ended (at eos, or at ``max_tokens``) become finished hypotheses, scored by their cumulative
    log-probability over their generated length to the power ``length_penalty``.

    Attributes:
        beam_width: the beams kept at each step, and the completions returned; at most
            :data:`~spindle.shared.sampling_params.MAX_LOGPROBS` over ``1 +`` the model's number of eos tokens.
        max_tokens: the most tokens a completion has.
        ignore_eos: never finish a beam at eos: every completion has ``max_tokens`` tokens.
        length_penalty: the exponent of the generated length that divides a finished beam's cumulative
            log-probability: above 0 favours longer completions, below 0 shorter ones (transformers' default, 1).
        early_stopping: when the search stops (transformers' semantics): ``True`` as soon as ``beam_width``
            completions have finished; ``False`` when the best running beam, scored at its current length, cannot
            beat the worst finished one; ``"never"`` only when no running beam can, scored at the longest length it
            may reach (with a positive ``length_penalty``).

    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS:
            raise InvalidRequestError(
                "beam_search.beam_width",
                f"BeamSearchParams.beam_width={self.beam_width!r} is invalid: it must be an integer in [1, "
                f"{MAX_LOGPROBS}]",
            )
        if self.max_tokens < 1:
            raise InvalidRequestError(
                "beam_search.max_tokens",
                f"BeamSearchParams.max_tokens={self.max_tokens!r} is invalid: it must be an integer >= 1",
            )
        if not math.isfinite(self.length_penalty):
            raise InvalidRequestError(
                "beam_search.length_penalty",
                f"BeamSearchParams.length_penalty={self.length_penalty!r} is invalid: it must be a finite number",
            )


class BeamSearchSequence(msgspec.Struct, kw_only=True):
    """One finished beam.

    Attributes:
        tokens: the prompt's token ids, then the completion's (as vLLM's, the prompt included).
        num_prompt_tokens: how many of ``tokens`` are the prompt's.
        text: the completion's text.
        cum_logprob: the sum of the completion's tokens' log-probabilities.
        score: ``cum_logprob`` over the completion's length to the power ``length_penalty``: what ranks the beams.
        finish_reason: ``stop`` at eos, ``length`` at ``max_tokens`` or the model's context length.

    """

    tokens: list[int]
    num_prompt_tokens: int
    text: str
    cum_logprob: float
    score: float
    finish_reason: FinishReason

    @property
    def output_token_ids(self) -> list[int]:
        """The completion's token ids."""
        return self.tokens[self.num_prompt_tokens :]


class BeamSearchOutput(msgspec.Struct):
    """The ``beam_width`` finished beams of one prompt, the best first.

    Attributes:
        sequences: the beams, by descending score.

    """

    sequences: list[BeamSearchSequence]
