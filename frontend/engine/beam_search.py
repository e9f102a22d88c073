"""Beam search over an engine's one-token requests, with transformers' ``num_beams`` semantics.

As vLLM's ``LLM.beam_search`` does it: each step asks the engine for one token of every running beam, as a
request of the beam's tokens with the top log-probabilities, and keeps the best extensions. The beams of a prompt
share its KV blocks through the prefix cache (each step's requests find their common prefix's full blocks cached),
so a step computes only the tokens past the last full block of each beam. What the search keeps and when it stops
are transformers' (``GenerationMixin._beam_search``), so that its beams are the same as ``generate(num_beams=...)``'s.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from spindle.frontend.processing.input_processor import InputProcessor
from spindle.shared import PromptInputs, RequestOutput, SamplingParams
from spindle.shared.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from spindle.shared.errors import InvalidRequestError
from spindle.shared.outputs import FinishReason
from spindle.shared.sampling_params import MAX_LOGPROBS


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
        num_candidates: the extensions kept at each step (transformers' ``(1 + eos tokens) x beam_width``).

    """

    def __init__(
        self, prompt: list[int], params: BeamSearchParams, eos_token_ids: set[int], max_len: int, num_candidates: int
    ) -> None:
        self.params = params
        self.num_candidates = num_candidates  # the extensions kept a step: enough that width of them do not end
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


class BeamSearch:
    """The beam searches of a batch of prompts, stepped together by a driver that runs the engine's requests.

    A driver (:meth:`~spindle.frontend.engine.llm.LLM.beam_search`, or the gRPC servicer over the async engine)
    loops: while :meth:`running` gives sequences, it asks the engine for each one's :attr:`num_candidates` most
    likely next tokens and hands them to :meth:`advance`; then :meth:`outputs` has the beams.

    Args:
        prompts: the prompts' token ids.
        params: the search's parameters.
        eos_token_ids: the model's eos tokens.
        max_len: the most tokens a sequence may have (the engine's ``max_model_len``).

    Raises:
        InvalidRequestError: ``beam_width`` needs more log-probabilities a step than the engine gives
            (:data:`~spindle.shared.sampling_params.MAX_LOGPROBS`).

    """

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: list[int], max_len: int
    ) -> None:
        eos = set(eos_token_ids)
        self.num_candidates = max(2, 1 + (0 if params.ignore_eos else len(eos))) * params.beam_width
        self.searches = [_Search(prompt, params, eos, max_len, self.num_candidates) for prompt in prompts]
        if self.num_candidates > MAX_LOGPROBS:
            raise InvalidRequestError(
                "beam_search.beam_width",
                f"beam_width={params.beam_width} keeps {self.num_candidates} extensions a step with this model's "
                f"eos token(s), more than the {MAX_LOGPROBS} log-probabilities a step gives: use a beam_width of at "
                f"most {MAX_LOGPROBS // (self.num_candidates // params.beam_width)}",
            )
        self._live: list[_Search] = []

    def running(self) -> list[list[int]]:
        """The token sequences of every running beam of every prompt, to extend by one token; none once done."""
        self._live = [search for search in self.searches if not search.done]
        return [beam.tokens for search in self._live for beam in search.running]

    def advance(self, next_tokens: list[dict[int, float]]) -> None:
        """Extend the beams :meth:`running` gave, given each one's most likely next tokens (token to logprob)."""
        extensions = iter(next_tokens)
        for search in self._live:
            search.advance([next(extensions) for _ in search.running])

    def outputs(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """One output per prompt, in order, each completion decoded by ``decode``."""
        return [search.output(decode) for search in self.searches]


def beam_prompts(
    processor: InputProcessor, prompts: Sequence[PromptInputs], params: BeamSearchParams
) -> list[list[int]]:
    """Each prompt checked and tokenized as a request's would be (text or token ids; no images).

    Raises:
        InvalidRequestError: a prompt is refused, or holds images.

    """
    token_ids = []
    for i, prompt in enumerate(prompts):
        processed = processor.process(prompt, SamplingParams(max_tokens=params.max_tokens))
        if processed.images:
            raise InvalidRequestError(f"prompts[{i}]", "beam search takes text or token prompts, not images")
        token_ids.append(processed.prompt_token_ids)
    return token_ids


def step_params(search: BeamSearch) -> SamplingParams:
    """The parameters of the one-token request that extends a beam: greedy, with the top log-probabilities."""
    return SamplingParams(temperature=0, max_tokens=1, logprobs=search.num_candidates, ignore_eos=True)


def top_logprobs(output: RequestOutput, k: int) -> dict[int, float]:
    """The ``k`` most likely next tokens of a one-token request's output, with their log-probabilities."""
    position = output.outputs[0].logprobs[0]
    return dict(sorted(((token, entry.logprob) for token, entry in position.items()), key=lambda item: -item[1])[:k])
