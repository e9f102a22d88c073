"""RMSNorm with an optional fused residual add (torch reference path)."""

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Root-mean-square normalisation over the last dimension, scaled by ``weight``.

    The statistics are computed in float32 and the normalised activations cast back to ``x``'s dtype before the
    weight multiply, as Llama's reference implementation does, so reduced-precision runs round the same way.

    Args:
        x: ``[..., hidden]``.
        weight: ``[hidden]``.
        eps: added to the mean square before the reciprocal square root.
        residual: when given, ``x + residual`` is normalised instead of ``x``.

    Returns:
        The normalised tensor when ``residual`` is None; else ``(normalised, x + residual)``, the second being the
        pre-norm sum that the next residual add needs (vLLM's convention).

    """
    if residual is not None:
        x = x + residual
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)
