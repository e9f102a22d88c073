"""Beam search over an engine's one-token requests, with transformers' ``num_beams`` semantics.

As vLLM's ``LLM.beam_search`` does it: each step asks the engine for one token of every running beam, as a
request of the beam's tokens with the top log-probabilities, and keeps the best extensions. The beams of a prompt
share its KV blocks through the prefix cache (each step's requests find their common prefix's full blocks cached),
so a step computes only the tokens past the last full block of each beam. What the search keeps and when it stops
are transformers' (``GenerationMixin._beam_search``), so that its beams are the same as ``generate(num_beams=...)``'s.
"""

from collections.abc import Callable
from dataclasses import dataclass

from spindle.shared.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from spindle.shared.errors import InvalidRequestError
from spindle.shared.outputs import FinishReason
from spindle.shared.sampling_params import MAX_LOGPROBS

NextTokens = Callable[[list[list[int]], int], list[dict[int, float]]]
"""``next_tokens(sequences, k)``: each token sequence's ``k`` most likely next tokens, with their log-probabilities."""


@dataclass
class _Beam:
    tokens: list[int]
    cum_logprob: float


class _Search:
    """One prompt's search, advanced one token at a time.

    It holds the running beams, best first, and the finished ones with their scores, best first, ``beam_width`` at
    most.

    Args:
        prompt: the prompt's token ids.
        params: the search's parameters.
        eos_token_ids: the tokens that finish a beam (none with ``ignore_eos``).
        max_len: the most tokens a beam may have, the prompt's included (the model's context length).

    """

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: set[int], max_len: int) -> None:
        self.params = params
        self.eos = set() if params.ignore_eos else eos_token_ids
        self.num_prompt_tokens = len(prompt)
        self.max_new = min(params.max_tokens, max_len - len(prompt))
        # transformers starts from beam_width copies of the prompt, all but one scored -1e9: one beam.
        self.running = [_Beam(prompt, 0.0)]
        self.finished: list[tuple[float, _Beam]] = []
        self.improvable = True  # transformers' "early stop heuristic unsatisfied"

    @property
    def done(self) -> bool:
        """Whether the search has stopped."""
        full = len(self.finished) == self.params.beam_width
        return not self.running or not self.improvable or (self.params.early_stopping is True and full)

    @property
    def num_candidates(self) -> int:
        """The extensions kept at each step: enough that ``beam_width`` of them do not end at eos."""
        return max(2, 1 + len(self.eos)) * self.params.beam_width

    def advance(self, next_tokens: list[dict[int, float]]) -> None:
        """Extend the running beams by one token, given each one's most likely next tokens."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        candidates = sorted(
            (
                (beam.cum_logprob + logprob, b, token)
                for b, (beam, tokens) in enumerate(zip(self.running, next_tokens, strict=True))
                for token, logprob in sorted(tokens.items())
            ),
            key=lambda candidate: -candidate[0],  # stable: ties keep the lower beam, then token, as torch.topk
        )[: self.num_candidates]
        generated = len(self.running[0].tokens) + 1 - self.num_prompt_tokens
        at_length = generated >= self.max_new
        accepts = self.improvable and not (self.params.early_stopping is True and len(self.finished) == width)
        running, finished = [], list(self.finished)
        for rank, (cum_logprob, b, token) in enumerate(candidates):
            beam = _Beam(self.running[b].tokens + [token], cum_logprob)
            if not at_length and token not in self.eos:
                if len(running) < width:
                    running.append(beam)
            elif rank < width and accepts:  # only the best width extensions may finish
                finished.append((cum_logprob / generated**penalty, beam))
        self.running = running
        self.finished = sorted(finished, key=lambda entry: -entry[0])[:width]
        if running:
            never = self.params.early_stopping == "never" and penalty > 0
            best_possible = running[0].cum_logprob / (self.max_new if never else generated) ** penalty
            worst = self.finished[-1][0] if len(self.finished) == width else -1.0e9
            self.improvable = self.improvable and best_possible > worst

    def output(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        """The finished beams, best first, their completions decoded by ``decode``."""
        sequences = []
        for score, beam in self.finished:
            completion = beam.tokens[self.num_prompt_tokens :]
            reason = FinishReason.STOP if completion[-1] in self.eos else FinishReason.LENGTH
            sequences.append(
                BeamSearchSequence(
                    tokens=beam.tokens,
                    num_prompt_tokens=self.num_prompt_tokens,
                    text=decode(completion),
                    cum_logprob=beam.cum_logprob,
                    score=score,
                    finish_reason=reason,
                )
            )
        return BeamSearchOutput(sequences)


def beam_search(
    prompts: list[list[int]],
    params: BeamSearchParams,
    next_tokens: NextTokens,
    eos_token_ids: list[int],
    max_len: int,
    decode: Callable[[list[int]], str],
) -> list[BeamSearchOutput]:
    """Beam-search every prompt, stepping all the prompts' running beams together.

    Args:
        prompts: the prompts' token ids.
        params: the search's parameters.
        next_tokens: the engine's step (:data:`NextTokens`): called once per step over every running beam.
        eos_token_ids: the model's eos tokens.
        max_len: the most tokens a sequence may have (the engine's ``max_model_len``).
        decode: a completion's text from its token ids.

    Returns:
        One output per prompt, in order.

    Raises:
        InvalidRequestError: ``beam_width`` needs more log-probabilities a step than the engine gives
            (:data:`~spindle.shared.sampling_params.MAX_LOGPROBS`).

    """
    searches = [_Search(prompt, params, set(eos_token_ids), max_len) for prompt in prompts]
    if searches and searches[0].num_candidates > MAX_LOGPROBS:
        raise InvalidRequestError(
            "beam_search_params.beam_width",
            f"beam_width={params.beam_width} keeps {searches[0].num_candidates} extensions a step with this model's "
            f"{len(searches[0].eos)} eos token(s), more than the {MAX_LOGPROBS} log-probabilities a step gives: use "
            f"a beam_width of at most {MAX_LOGPROBS // (searches[0].num_candidates // params.beam_width)}",
        )
    while live := [search for search in searches if not search.done]:
        beams = [beam.tokens for search in live for beam in search.running]
        extensions = iter(next_tokens(beams, live[0].num_candidates))
        for search in live:
            search.advance([next(extensions) for _ in search.running])
    return [search.output(decode) for search in searches]
