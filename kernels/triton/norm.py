"""Fused residual add and RMSNorm in Triton, one program per row."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    eps,
    HIDDEN: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 before the strides: a step's activations can hold more than 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x32 = x.to(tl.float32)
    if HAS_RESIDUAL:
        # Added in float32 and rounded to the activation dtype before the statistics, as torch's `x + residual` is.
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        summed = (x32 + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * HIDDEN + cols, summed, mask=mask)
        x32 = summed.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / HIDDEN
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(dtype)
    weight = tl.load(weight_ptr + cols, mask=mask)
    tl.store(out_ptr + row * HIDDEN + cols, (normed.to(tl.float32) * weight.to(tl.float32)).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension with an optional fused residual add (Triton; same contract as the torch one).

    The rounding steps are the torch path's: the sum rounded to ``x``'s dtype, the statistics in float32, the
    normalised activations rounded to ``x``'s dtype before the weight multiply.

    Args:
        x: ``[..., hidden]``.
        weight: ``[hidden]``.
        eps: added to the mean square before the reciprocal square root.
        residual: when given, ``x + residual`` is normalised instead of ``x``.

    Returns:
        The normalised tensor when ``residual`` is None; else ``(normalised, x + residual)``.

    """
    hidden = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_rows = rows if residual is None else _rows(residual)
    residual_out = torch.empty_like(out) if residual is not None else out
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight,
            out,
            residual_out,
            rows.stride(0),
            residual_rows.stride(0),
            eps,
            HIDDEN=hidden,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out if residual is None else (out, residual_out)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, hidden]`` with a contiguous last dimension, copying only when it has to."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
