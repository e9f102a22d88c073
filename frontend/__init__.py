"""The frontend: input processing, detokenization and the engines users call.

``LLM`` and ``LLMEngine`` run the engine core in this process and so import torch; they are imported lazily,
so ``import frontend`` alone does not.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from frontend.llm import LLM
    from frontend.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from frontend.llm import LLM

        return LLM
    if name == "LLMEngine":
        from frontend.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'frontend' has no attribute {name!r}")
