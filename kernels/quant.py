"""Weight-only quantized matrices: the one layout every path starts from, quantization at load, torch references.

A :class:`QuantizedWeight` holds an ``[out, in]`` matrix as integers with float scales (and, for 4 bits, offsets):

- **int8**, one scale per output row (or per group of ``group_size`` inputs, as GGUF's Q8_0 blocks of 32, or of
  16, as Q6_K's sub-blocks): ``w[n, k] = q[n, k] * scale[n, k // group_size]``, plus ``zero[n, k // group_size]``
  where the weight has offsets (GGUF's Q5_K, whose values are ``d * q - m`` with ``q`` in 0..31).
- **int4**, one scale and one offset per group of ``group_size`` consecutive inputs of a row, two values per byte
  (input ``2i`` in the low nibble, ``2i + 1`` in the high one): ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]``
  with ``g = k // group_size``. GGUF's Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) blocks of 32 map onto it
  exactly: ``scale = d`` and ``zero = 0``, resp. ``zero = m + 8 * d``; Q8_0 (``d * q``) maps onto int8 by groups.
  The ``- 8`` is the convention of torch's CPU int4 kernel, which the CPU path repacks into.

The CPU path (:mod:`spindle.kernels.linear`) runs int8 as it is stored and repacks int4 into torch's CPU kernel
layout; the Triton kernel reads both as they are; :func:`quantized_linear` here is the reference both are tested
against.
"""

import itertools
import math
from dataclasses import dataclass

import torch

INT4_GROUP_SIZE = 32
"""Inputs per scale when quantizing to int4 at load: GGUF's block size, the finest group torch's CPU kernel takes."""

ACTIVATION_GROUP_SIZE = 64
"""Inputs per scale when activations are quantized to int8 on the fly (W8A8, ``spindle.kernels.cpu.w8a8_linear``).

SmolLM2-135M's perplexity on ``bench.quality``'s text with every projection's activations and weights (int8 per row)
quantized: one scale per token +4.1%, per 192 inputs +1.3%, per 64 +0.6%; the int8 weights alone +0.6%."""

SUPER_BLOCK = 256
"""Inputs per super-block of GGUF's K-quants: the span of :attr:`QuantizedWeight.super_scales`' factors."""

A8_BLOCK = 32
"""Inputs per scale when activations are quantized to int8 for the grouped int8/int4 kernel
(``spindle.kernels.cpu.a8_linear``), as llama.cpp does for its K-quant dot products."""


@dataclass
class QuantizedWeight:
    """A weight-only quantized ``[out_features, in_features]`` matrix (layout in the module docstring).

    Attributes:
        qweight: int8 ``[out, in]`` (8 bits) or uint8 ``[out, in // 2]``, two 4-bit values per byte (4 bits).
        scales: float32 ``[out, in // group_size]``.
        zeros: float32 ``[out, in // group_size]`` for 4 bits; for 8 bits None (symmetric) or the groups' offsets.
        group_size: inputs per scale; ``in_features`` for int8 quantized at load (one scale per row).
        super_scales: float32 ``[out, in // 256, 2]`` or None: for a weight from GGUF's K-quants (Q4_K, Q5_K, Q6_K),
            the super-block factors ``(d, dmin)`` its group scales and offsets are integer multiples of: ``scale =
            d * sc`` and the offset past ``q * scale`` (int4: ``zero - 8 * scale``; int8: ``zero``) ``= -dmin * m``,
            ``sc`` and ``m`` integers per group (``sc`` in -128..127, ``m`` in 0..255), as the file stores them. The
            CPU kernel keeps those integers in place of float32 scales (``spindle.kernels.cpu.a8_pack``); nothing
            else reads them.
        parts: for a matrix :func:`cat_rows` stacked from parts of different layouts (and so widened), those parts
            as they were, in row order, or None. The CPU kernel lays each out as it is (a Q4_K_M layer's q and k at
            4 bits beside its Q6_K v at 6), where one layout would widen q and k to int8; the others read the
            widened matrix. Cut off by :meth:`narrow`, :meth:`select` and :func:`widen`.

    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    super_scales: torch.Tensor | None = None
    parts: tuple["QuantizedWeight", ...] | None = None

    @property
    def bits(self) -> int:
        """8 or 4."""
        return 8 if self.qweight.dtype == torch.int8 else 4

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the matrix it stands for."""
        out, stored = self.qweight.shape
        return out, stored if self.bits == 8 else 2 * stored

    def unpacked(self) -> torch.Tensor:
        """The integer values ``q``, int32 ``[out, in]`` (0..15 for int4, -128..127 for int8)."""
        if self.bits == 8:
            return self.qweight.to(torch.int32)
        low, high = (self.qweight & 0xF).to(torch.int32), (self.qweight >> 4).to(torch.int32)
        return torch.stack([low, high], dim=-1).flatten(-2)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """The part ``[start, start + length)`` of the output rows (``dim`` 0) or the inputs (``dim`` 1).

        Inputs are cut along whole groups, so that every value keeps its scale (a tensor-parallel rank's slice).

        Raises:
            ValueError: when an input range does not start and end on a group boundary.

        """
        if dim == 0:
            return self.select(slice(start, start + length))
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"inputs [{start}, {start + length}) do not fall on groups of {self.group_size}")
        per_byte = 1 if self.bits == 8 else 2
        groups = slice(start // self.group_size, (start + length) // self.group_size)
        zeros = None if self.zeros is None else self.zeros[:, groups]
        supers = None  # kept where the cut falls on whole super-blocks
        if self.super_scales is not None and not (start % SUPER_BLOCK or length % SUPER_BLOCK):
            supers = self.super_scales[:, start // SUPER_BLOCK : (start + length) // SUPER_BLOCK]
        return QuantizedWeight(
            self.qweight[:, start // per_byte : (start + length) // per_byte],
            self.scales[:, groups],
            zeros,
            self.group_size,
            supers,
        )

    def select(self, index: int | slice | torch.Tensor) -> "QuantizedWeight":
        """The entries ``index`` of the leading dimension, with their scales and offsets.

        Output rows of a matrix (an embedding lookup's ids, a shard's rows), or one matrix of a stack (an expert).
        """
        zeros = None if self.zeros is None else self.zeros[index]
        supers = None if self.super_scales is None else self.super_scales[index]
        return QuantizedWeight(self.qweight[index], self.scales[index], zeros, self.group_size, supers)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        """The same weight with its tensors on ``device``."""
        zeros = None if self.zeros is None else self.zeros.to(device)
        supers = None if self.super_scales is None else self.super_scales.to(device)
        parts = None if self.parts is None else tuple(part.to(device) for part in self.parts)
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device), zeros, self.group_size, supers, parts)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int ``[out, in]`` values in 0..15 two per byte (``in`` even): input ``2i`` low nibble, ``2i + 1`` high."""
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


def quantize(weight: torch.Tensor, bits: int, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Quantize a float ``[out, in]`` weight: int8 symmetric per row, or int4 asymmetric per group of inputs.

    int4 groups map their minimum to ``q = 0`` and maximum to ``q = 15`` (round to nearest), as GGUF's Q4_1 does.

    Raises:
        ValueError: for ``bits`` other than 8 or 4, or an int4 ``in_features`` not divisible by ``group_size``.

    """
    w = weight.detach().float()
    out, inputs = w.shape
    if bits == 8:
        scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(q, scales, None, inputs)
    if bits != 4:
        raise ValueError(f"weights quantize to 8 or 4 bits, not {bits}")
    if inputs % group_size or group_size % 2:
        raise ValueError(f"int4 needs in_features ({inputs}) divisible by an even group_size ({group_size})")
    groups = w.view(out, inputs // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15).view(out, inputs)
    return QuantizedWeight(pack_int4(q), scales, low + 8 * scales, group_size)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float ``[out, in]`` matrix ``weight`` stands for, computed in float32 and rounded once to ``dtype``."""
    q = weight.unpacked().float()
    out, inputs = q.shape
    scales = weight.scales.repeat_interleave(weight.group_size, dim=1)
    if weight.zeros is None:
        return (q * scales).to(dtype)
    zeros = weight.zeros.repeat_interleave(weight.group_size, dim=1)
    centre = 8 if weight.bits == 4 else 0
    return ((q - centre) * scales + zeros).to(dtype)


def widen(weight: QuantizedWeight, group_size: int) -> QuantizedWeight:
    """``weight`` as int8 with groups of ``group_size`` inputs (a divisor of its own), exactly the same values.

    int4's ``q - 8`` are int8 values under the same scale and offset, and a group's scale and offset repeat over
    its parts; int8 is only regrouped.

    Raises:
        ValueError: when ``group_size`` does not divide the weight's.

    """
    if group_size <= 0 or weight.group_size % group_size:
        raise ValueError(f"groups of {weight.group_size} inputs do not split into groups of {group_size}")
    parts = weight.group_size // group_size
    q = weight.qweight if weight.bits == 8 else (weight.unpacked() - 8).to(torch.int8)
    zeros = None if weight.zeros is None else weight.zeros.repeat_interleave(parts, dim=1)
    return QuantizedWeight(q, weight.scales.repeat_interleave(parts, dim=1), zeros, group_size)


def _layout(weight: QuantizedWeight) -> tuple[int, int, bool, bool]:
    """What one kernel layout needs alike: bits, group size, offsets or not, super-block factors or not."""
    return weight.bits, weight.group_size, weight.zeros is None, weight.super_scales is None


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices of equal ``in_features`` along the output rows (fused q/k/v, gate/up).

    Matrices of one bit width and group size stack as they are. Others (a GGUF Q4_K_M file's int4 q and k beside
    its Q6_K v, int8 in groups of 16) are first widened exactly to int8 at the largest group size dividing all of
    theirs (:func:`widen`). Offsets are kept where any part has them (zero for the parts without), super-block
    factors where every part has them; the widened matrix keeps the parts as they were (:attr:`QuantizedWeight.parts`,
    consecutive parts of one layout stacked into one).
    """
    differ = any(w.bits != weights[0].bits or w.group_size != weights[0].group_size for w in weights)
    parts = None
    if differ or any(w.parts for w in weights):  # runs of one layout stacked (q and k of one type: one part)
        runs = itertools.groupby((p for w in weights for p in (w.parts or (w,))), key=_layout)
        parts = tuple(part if not rest else cat_rows([part, *rest]) for _, (part, *rest) in runs)
    if differ:
        group_size = math.gcd(*(w.group_size for w in weights))
        weights = [widen(w, group_size) for w in weights]
    zeros = supers = None
    if any(w.zeros is not None for w in weights):
        zeros = torch.cat([torch.zeros_like(w.scales) if w.zeros is None else w.zeros for w in weights])
    if all(w.super_scales is not None for w in weights):
        supers = torch.cat([w.super_scales for w in weights])  # type: ignore[misc]
    return QuantizedWeight(
        torch.cat([w.qweight for w in weights]),
        torch.cat([w.scales for w in weights]),
        zeros,
        weights[0].group_size,
        supers,
        parts,
    )


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` (torch reference): float32 accumulation, output in ``x``'s dtype.

    Args:
        x: ``[..., in_features]``.
        weight: the quantized ``[out_features, in_features]`` matrix.
        bias: ``[out_features]`` or None.

    """
    out = x.float() @ dequantize(weight).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_activations(x: torch.Tensor, group_size: int = ACTIVATION_GROUP_SIZE) -> torch.Tensor:
    """``x [..., in]`` rounded to int8 levels with one symmetric scale per ``group_size`` inputs, in float32.

    Each group's scale is its largest magnitude / 127; values round to nearest even. This is what a W8A8 kernel
    multiplies (``in`` must be a multiple of ``group_size``).
    """
    groups = x.float().unflatten(-1, (-1, group_size))
    scales = groups.abs().amax(-1, keepdim=True) / 127
    levels = torch.where(scales > 0, torch.round(groups / scales), 0.0)
    return (levels * scales).flatten(-2)


def w8a8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`quantized_linear` of ``x`` quantized by :func:`quantize_activations` (torch reference of W8A8)."""
    return quantized_linear(quantize_activations(x), weight, bias).to(x.dtype)


def a8_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`quantized_linear` of ``x`` quantized per :data:`A8_BLOCK` inputs (torch reference of ``a8_linear``)."""
    return quantized_linear(quantize_activations(x, A8_BLOCK), weight, bias).to(x.dtype)
