"""Model definitions, their configuration, and loading from Hugging Face directories or GGUF files."""

from spindle.backend.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from spindle.backend.models.llama import KVCache, LlamaForCausalLM
from spindle.backend.models.loader import load_model, resolve_dtype, resolve_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "KVCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "resolve_dtype",
    "resolve_model",
]
