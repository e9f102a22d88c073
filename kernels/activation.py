"""Gated activations (torch reference path)."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up projection.

    Args:
        x: ``[..., 2 * d]``, the gate in the first half and the up projection in the second.

    Returns:
        ``silu(x[..., :d]) * x[..., d:]``, shape ``[..., d]``.

    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (transformers' ``gelu_pytorch_tanh``: Gemma 2 and 3).

    Args:
        x: ``[..., 2 * d]``, the gate in the first half and the up projection in the second.

    Returns:
        ``gelu_tanh(x[..., :d]) * x[..., d:]``, shape ``[..., d]``.

    """
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
