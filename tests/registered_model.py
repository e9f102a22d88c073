"""An architecture Spindle does not ship, for tests/test_model_registry.py to register and serve.

It is a module of its own (not defined in the test) so that a backend process can import it by name.
"""

import torch

from spindle.backend.models.llama import LlamaForCausalLM

ARCHITECTURE = "SignedLlamaForCausalLM"


class SignedLlamaForCausalLM(LlamaForCausalLM):
    """A Llama whose logits are multiplied by its config.json's own ``logit_sign`` field.

    With ``logit_sign: -1`` greedy decoding takes the plain Llama's least likely token at every step, which no
    built-in class would.
    """

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.config.hf_config["logit_sign"] * super().compute_logits(hidden)
