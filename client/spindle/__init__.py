"""Spindle: an LLM serving engine that ships as a gRPC microservice.

The public API, as vLLM users write it::

    from spindle import LLM as LLM, SamplingParams as SamplingParams

    llm = LLM()
    print(llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)

Everything here is imported on first use, so ``import spindle`` alone imports neither torch nor the engines. This
module belongs to the ``spindle-client`` distribution (the gRPC stubs in :mod:`spindle.v1`, :mod:`spindle.client`
and the ``spindle`` command); the engines and types come with ``spindle-serve``, which depends on it.
"""

import importlib
from importlib.metadata import version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spindle.client import SpindleClient as SpindleClient
    from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine as AsyncLLMEngine
    from spindle.frontend.engine.llm import LLM as LLM
    from spindle.frontend.engine.llm_engine import LLMEngine as LLMEngine
    from spindle.shared.beam_search import BeamSearchOutput as BeamSearchOutput
    from spindle.shared.beam_search import BeamSearchParams as BeamSearchParams
    from spindle.shared.config import EngineConfig as EngineConfig
    from spindle.shared.errors import EngineUnavailableError as EngineUnavailableError
    from spindle.shared.errors import InvalidRequestError as InvalidRequestError
    from spindle.shared.inputs import (
        PromptInputs as PromptInputs,
    )
    from spindle.shared.inputs import (
        TextPrompt as TextPrompt,
    )
    from spindle.shared.inputs import (
        TokensPrompt as TokensPrompt,
    )
    from spindle.shared.lora import LoRARequest as LoRARequest
    from spindle.shared.model_registry import ModelRegistry as ModelRegistry
    from spindle.shared.outputs import CompletionOutput as CompletionOutput
    from spindle.shared.outputs import EmbeddingOutput as EmbeddingOutput
    from spindle.shared.outputs import EmbeddingRequestOutput as EmbeddingRequestOutput
    from spindle.shared.outputs import FinishReason as FinishReason
    from spindle.shared.outputs import RequestOutput as RequestOutput
    from spindle.shared.outputs import ToolCall as ToolCall
    from spindle.shared.pooling_params import PoolingParams as PoolingParams
    from spindle.shared.sampling_params import RequestOutputKind as RequestOutputKind
    from spindle.shared.sampling_params import SamplingParams as SamplingParams
    from spindle.shared.sampling_params import StructuredOutput as StructuredOutput

__version__ = version("spindle-client")

_PUBLIC = {
    "LLM": "spindle.frontend.engine.llm",
    "LLMEngine": "spindle.frontend.engine.llm_engine",
    "AsyncLLMEngine": "spindle.frontend.engine.async_llm_engine",
    "EngineConfig": "spindle.shared.config",
    "SamplingParams": "spindle.shared.sampling_params",
    "RequestOutputKind": "spindle.shared.sampling_params",
    "BeamSearchParams": "spindle.shared.beam_search",
    "BeamSearchOutput": "spindle.shared.beam_search",
    "StructuredOutput": "spindle.shared.sampling_params",
    "PoolingParams": "spindle.shared.pooling_params",
    "RequestOutput": "spindle.shared.outputs",
    "CompletionOutput": "spindle.shared.outputs",
    "EmbeddingRequestOutput": "spindle.shared.outputs",
    "EmbeddingOutput": "spindle.shared.outputs",
    "FinishReason": "spindle.shared.outputs",
    "ToolCall": "spindle.shared.outputs",
    "PromptInputs": "spindle.shared.inputs",
    "TextPrompt": "spindle.shared.inputs",
    "TokensPrompt": "spindle.shared.inputs",
    "LoRARequest": "spindle.shared.lora",
    "InvalidRequestError": "spindle.shared.errors",
    "EngineUnavailableError": "spindle.shared.errors",
    "ModelRegistry": "spindle.shared.model_registry",
    "SpindleClient": "spindle.client",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> object:
    module_name = _PUBLIC.get(name)
    if module_name is None:
        raise AttributeError(f"module 'spindle' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only the absence of the serving distribution itself is explained; any other missing module is a real bug.
        if error.name not in ("spindle.frontend", "spindle.shared"):
            raise
        raise ImportError(
            f"spindle.{name} comes with the spindle-serve distribution, and only spindle-client is installed; "
            "install the server (pip install ./client . from the repository) to run models in this process"
        ) from error
    value = getattr(module, name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
