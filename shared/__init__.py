"""Types both processes speak: prompt inputs, sampling parameters and request outputs."""

from spindle.shared.inputs import PromptInputs, TextPrompt, TokensPrompt
from spindle.shared.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from spindle.shared.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "PromptInputs",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokenLogprobs",
    "TokensPrompt",
]
