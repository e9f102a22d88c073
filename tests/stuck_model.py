"""A Llama whose step never ends once a prompt holds :data:`STUCK_TOKEN`, for tests/test_recovery.py.

It stands for a step stuck in a collective that never completes or a kernel that never returns: it blocks with the
GIL released, as those do, so the backend's I/O thread goes on answering. It is a module of its own so that a backend
process can import it by name (``--register-model``).
"""

import threading

import torch

from spindle.backend.models.llama import LlamaForCausalLM

ARCHITECTURE = "StuckLlamaForCausalLM"
STUCK_TOKEN = 250
"""A token of the tiny model's vocabulary that none of the engine's own runs (its profile run feeds zeros) holds."""


class StuckLlamaForCausalLM(LlamaForCausalLM):
    """The tiny Llama, whose forward pass blocks forever on a batch that holds :data:`STUCK_TOKEN`."""

    def forward(self, input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        """Block forever if ``input_ids`` holds the stuck token; else the Llama's forward pass."""
        if bool((input_ids == STUCK_TOKEN).any()):
            threading.Event().wait()
        return super().forward(input_ids, *args, **kwargs)
