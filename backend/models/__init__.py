"""Model definitions, their configuration, and loading from Hugging Face directories or GGUF files."""

from spindle.backend.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from spindle.backend.models.llama import KVCache, LlamaForCausalLM
from spindle.backend.models.loader import load_model, resolve_dtype, resolve_model
from spindle.backend.models.registry import CausalLM, model_class

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "KVCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "load_model",
    "model_class",
    "resolve_dtype",
    "resolve_model",
]
