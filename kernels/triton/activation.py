"""Gated activations in Triton: SiLU-and-mul (SwiGLU) and tanh-GELU-and-mul (GeGLU)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    # int64 before the strides: a step's activations can hold more than 2**31 elements.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0)
    if GELU:
        # g (1 + tanh(u)) / 2 = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3): no tanh in every Triton version.
        act = gate * tl.sigmoid(1.5957691 * gate * (1.0 + 0.044715 * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    # Rounded after the activation and after the product, as the torch path's two ops are.
    act = act.to(up.dtype)
    tl.store(out_ptr + row * D + cols, (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(d), 2048)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(d, block))
        _act_and_mul_kernel[grid](rows, out, rows.stride(0), D=d, BLOCK=block, GELU=gelu)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up projection (Triton; same contract as the torch one).

    Args:
        x: ``[..., 2 * d]``, the gate in the first half and the up projection in the second.

    Returns:
        ``silu(x[..., :d]) * x[..., d:]``, shape ``[..., d]``.

    """
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh GELU on a fused gate/up projection (Triton; same contract as the torch one).

    Args:
        x: ``[..., 2 * d]``, the gate in the first half and the up projection in the second.

    Returns:
        ``gelu_tanh(x[..., :d]) * x[..., d:]``, shape ``[..., d]``.

    """
    return _act_and_mul(x, gelu=True)
