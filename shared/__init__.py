"""Types both processes speak: prompt inputs, sampling and pooling parameters, and request outputs."""

from spindle.shared.inputs import EmbedsPrompt, PromptInputs, TextPrompt, TokensPrompt
from spindle.shared.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    ToolCall,
)
from spindle.shared.pooling_params import PoolingParams
from spindle.shared.sampling_params import RequestOutputKind, SamplingParams, StructuredOutput

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EmbedsPrompt",
    "FinishReason",
    "Logprob",
    "PoolingParams",
    "PromptInputs",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutput",
    "TextPrompt",
    "TokenLogprobs",
    "TokensPrompt",
    "ToolCall",
]
