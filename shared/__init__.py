"""Types both processes speak: prompt inputs, sampling parameters and request outputs."""

from spindle.shared.inputs import PromptInputs, TextPrompt, TokensPrompt
from spindle.shared.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    ToolCall,
)
from spindle.shared.sampling_params import SamplingParams, StructuredOutput

__all__ = [
    "CompletionOutput",
    "FinishReason",
    "Logprob",
    "PromptInputs",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutput",
    "TextPrompt",
    "TokenLogprobs",
    "TokensPrompt",
    "ToolCall",
]
