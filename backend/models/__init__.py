"""Model definitions, their configuration, and loading from Hugging Face directories or GGUF files."""

from spindle.backend.models.checkpoint_config import SUPPORTED_ARCHITECTURES, CheckpointConfig
from spindle.backend.models.interface import CausalLM, model_class
from spindle.backend.models.llama import KVCache, LlamaForCausalLM
from spindle.backend.models.loader import load_model, resolve_dtype, resolve_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "KVCache",
    "LlamaForCausalLM",
    "CheckpointConfig",
    "load_model",
    "model_class",
    "resolve_dtype",
    "resolve_model",
]
