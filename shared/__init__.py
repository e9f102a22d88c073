"""Types both processes speak: prompt inputs, sampling parameters and request outputs."""

from shared.inputs import PromptInputs, TextPrompt, TokensPrompt
from shared.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from shared.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "Logprob",
    "PromptInputs",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokenLogprobs",
    "TokensPrompt",
]
