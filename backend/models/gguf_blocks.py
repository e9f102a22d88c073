"""GGUF quantized blocks decoded exactly into :mod:`spindle.kernels.quant`'s layouts, a whole matrix at a time.

Every decoder takes a matrix's rows of blocks as ``GGUFReader`` gives them (uint8 ``[out, blocks x bytes]``) and
returns a :class:`~spindle.kernels.quant.QuantizedWeight` that dequantizes to the values ``gguf``'s own
dequantization computes. The fp16 (and 6-bit, 8-bit) fields become float32 scales and offsets; the integers keep
their values:

======  ===============================  ==========================================================
type    GGUF value                       Spindle layout
======  ===============================  ==========================================================
Q4_0    ``d * (q - 8)``, q 0..15         int4 group 32: ``scale = d``, ``zero = 0``
Q4_1    ``d * q + m``                    int4 group 32: ``scale = d``, ``zero = m + 8 d``
Q4_K    ``d sc * q - dmin m``            int4 group 32: ``scale = d sc``, ``zero = 8 scale - dmin m``
Q5_0    ``d * (q - 16)``, q 0..31        int8 group 32: ``q - 16``, ``scale = d``
Q5_1    ``d * q + m``                    int8 group 32 with offsets: ``scale = d``, ``zero = m``
Q5_K    ``d sc * q - dmin m``, q 0..31   int8 group 32 with offsets: ``scale = d sc``, ``zero = -dmin m``
Q6_K    ``d sc * (q - 32)``, q 0..63     int8 group 16: ``q - 32``, ``scale = d sc``
Q8_0    ``d * q``, q int8                int8 group 32: ``scale = d``
======  ===============================  ==========================================================

The K-quants pack 256 inputs into a super-block with one fp16 ``d`` (and ``dmin``) and a small integer scale ``sc``
(and minimum ``m``) per sub-block of 32 (Q6_K: of 16). Everything is vectorised over all blocks of the matrix.
"""

from collections.abc import Callable

import torch

from spindle.kernels.quant import QuantizedWeight, pack_int4

SUPER_BLOCK = 256
"""Inputs per K-quant super-block."""

BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8, "Q8_0": 8}
"""The GGUF types kept as they are, and the bits of the layout they map onto (:func:`decode`)."""


def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block (uint8 ``[out, blocks, bytes]``), as float32 ``[out, blocks]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]`` values: the n low nibbles, then the n high ones."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def _bit_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 8 // bits, n]``: plane ``p`` holds bits ``p * bits`` up of every byte."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)[:, None]
    return (packed.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _low_bits_first(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 8 n]`` bits, byte by byte, least significant bit first (a little-endian mask)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def decode_q4_0(raw: torch.Tensor) -> QuantizedWeight:
    """Q4_0 rows: blocks of 32 inputs, an fp16 ``d`` then 16 bytes (inputs 0-15 low nibbles, 16-31 high ones)."""
    return _decode_32(raw, with_min=False, fifth_bit=False)


def decode_q4_1(raw: torch.Tensor) -> QuantizedWeight:
    """Q4_1 rows: as Q4_0 with an fp16 minimum ``m`` after ``d``; the value is ``d * q + m``."""
    return _decode_32(raw, with_min=True, fifth_bit=False)


def decode_q5_0(raw: torch.Tensor) -> QuantizedWeight:
    """Q5_0 rows in Spindle's int8 layout; the value is ``d * (q - 16)``.

    A block is 32 inputs: an fp16 ``d``, 4 bytes of fifth bits (input i at bit i, little-endian), then 16 bytes of
    low 4 bits as Q4_0's.
    """
    return _decode_32(raw, with_min=False, fifth_bit=True)


def decode_q5_1(raw: torch.Tensor) -> QuantizedWeight:
    """Q5_1 rows: as Q5_0 with an fp16 minimum ``m`` after ``d``; the value is ``d * q + m``."""
    return _decode_32(raw, with_min=True, fifth_bit=True)


def _decode_32(raw: torch.Tensor, with_min: bool, fifth_bit: bool) -> QuantizedWeight:
    """Q4_0/Q4_1 rows as int4 (offset 0, or ``m + 8 d``), Q5_0/Q5_1 (``fifth_bit``) as int8 (``q - 16``, or ``m``).

    A block is 32 inputs: ``d`` (and ``m``), the fifth bits, then 16 bytes of low 4 bits.
    """
    out = raw.shape[0]
    header = 4 if with_min else 2
    blocks = raw.view(out, -1, header + (20 if fifth_bit else 16))
    scales, low = fp16_field(blocks, 0), _nibbles(blocks[..., -16:])
    minimums = fp16_field(blocks, 2) if with_min else None
    if not fifth_bit:
        zeros = torch.zeros_like(scales) if minimums is None else minimums + 8 * scales
        return QuantizedWeight(pack_int4(low.view(out, -1)), scales, zeros, 32)
    q = (low | (_low_bits_first(blocks[..., header : header + 4]) << 4)).to(torch.int8)
    return QuantizedWeight((q if with_min else q - 16).view(out, -1), scales, minimums, 32)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and minimums -> ``(sc, m)``, float32 ``[..., 8]`` each.

    Bytes 0-3 hold sub-blocks 0-3's scales in their low 6 bits, bytes 4-7 their minimums; sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 (scale low nibble, minimum high nibble) and their top 2 bits from the top 2
    bits of bytes 0-3 (scales) and 4-7 (minimums).
    """
    low_sc, low_m, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low_sc & 0x3F, (rest & 0xF) | ((low_sc >> 6) << 4)], dim=-1)
    m = torch.cat([low_m & 0x3F, (rest >> 4) | ((low_m >> 6) << 4)], dim=-1)
    return sc.float(), m.float()


def _k_header(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-blocks ``[out, blocks, bytes]`` -> ``(d sc, dmin m, supers)``.

    ``d sc`` and ``dmin m`` per sub-block of 32, ``[out, groups]``; ``supers`` the super-blocks' ``(d, dmin)``,
    ``[out, blocks, 2]`` (:attr:`~spindle.kernels.quant.QuantizedWeight.super_scales`).
    """
    sc, m = _k_scales(blocks[..., 4:16])
    out = blocks.shape[0]
    d, dmin = fp16_field(blocks, 0), fp16_field(blocks, 2)
    return (d[..., None] * sc).view(out, -1), (dmin[..., None] * m).view(out, -1), torch.stack([d, dmin], dim=-1)


def decode_q4_k(raw: torch.Tensor) -> QuantizedWeight:
    """Q4_K rows in Spindle's int4 layout; the value is ``d sc * q - dmin m``.

    A super-block is 256 inputs (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit ``sc`` and ``m``
    (:func:`_k_scales`), then 4 runs of 32 bytes whose low nibbles are sub-block ``2j`` and high ones ``2j + 1``.
    """
    out = raw.shape[0]
    blocks = raw.view(out, -1, 144)
    scales, minimums, supers = _k_header(blocks)
    q = _nibbles(blocks[..., 16:].unflatten(-1, (4, 32)))
    return QuantizedWeight(pack_int4(q.view(out, -1)), scales, 8 * scales - minimums, 32, supers)


def decode_q5_k(raw: torch.Tensor) -> QuantizedWeight:
    """Q5_K rows in Spindle's int8 layout with offsets; the value is ``d sc * q - dmin m``.

    A super-block is 256 inputs (176 bytes): Q4_K's header, 32 bytes of fifth bits (bit j of byte i is input i of
    sub-block j), then Q4_K's 128 bytes of low 4 bits.
    """
    out = raw.shape[0]
    blocks = raw.view(out, -1, 176)
    scales, minimums, supers = _k_header(blocks)
    low = _nibbles(blocks[..., 48:].unflatten(-1, (4, 32))).flatten(-2)
    q = low | (_bit_planes(blocks[..., 16:48], 1).flatten(-2) << 4)
    return QuantizedWeight(q.to(torch.int8).view(out, -1), scales, -minimums, 32, supers)


def decode_q6_k(raw: torch.Tensor) -> QuantizedWeight:
    """Q6_K rows in Spindle's int8 layout, groups of 16; the value is ``d sc * (q - 32)``.

    A super-block is 256 inputs (210 bytes): 128 bytes of low 4 bits, 64 of top 2 bits, 16 int8 scales ``sc`` (one
    per 16 inputs), fp16 ``d``. Each half of 128 inputs takes 64 low-bit bytes (low nibbles inputs 0-63, high ones
    64-127) and 32 top-bit bytes (bit pairs 0-1, 2-3, 4-5, 6-7: inputs 0-31, 32-63, 64-95, 96-127).
    """
    out = raw.shape[0]
    blocks = raw.view(out, -1, 210)
    low = _nibbles(blocks[..., :128].unflatten(-1, (2, 64)))
    high = _bit_planes(blocks[..., 128:192].unflatten(-1, (2, 32)), 2).flatten(-2)
    values = (low | (high << 4)).to(torch.int8) - 32
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = fp16_field(blocks, 208)
    supers = torch.stack([d, torch.zeros_like(d)], dim=-1)
    return QuantizedWeight(values.view(out, -1), (d[..., None] * sc).view(out, -1), None, 16, supers)


def decode_q8_0(raw: torch.Tensor) -> QuantizedWeight:
    """Q8_0 rows: blocks of 32 inputs, an fp16 ``d`` then 32 int8 ``q``; the value is ``d * q``."""
    out = raw.shape[0]
    blocks = raw.view(out, -1, 34)
    return QuantizedWeight(
        blocks[..., 2:].contiguous().view(torch.int8).reshape(out, -1), fp16_field(blocks, 0), None, 32
    )


KEPT: dict[str, tuple[int, Callable[[torch.Tensor], QuantizedWeight]]] = {
    "Q4_0": (18, decode_q4_0),
    "Q4_1": (20, decode_q4_1),
    "Q4_K": (144, decode_q4_k),
    "Q5_0": (22, decode_q5_0),
    "Q5_1": (24, decode_q5_1),
    "Q5_K": (176, decode_q5_k),
    "Q6_K": (210, decode_q6_k),
    "Q8_0": (34, decode_q8_0),
}
"""Each type of :data:`BITS`: the bytes of one of its blocks, and its decoder."""


def decode(gguf_type: str, raw: torch.Tensor) -> QuantizedWeight:
    """A GGUF matrix's rows of ``gguf_type`` blocks (uint8 ``[out, blocks x bytes]``) in Spindle's layout.

    Raises:
        ValueError: for a type not kept (:data:`BITS`), or rows that are not whole blocks of it.

    """
    if gguf_type not in KEPT:
        raise ValueError(f"GGUF {gguf_type} blocks are not kept; kept types: {', '.join(KEPT)}")
    block_bytes, decoder = KEPT[gguf_type]
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % block_bytes:
        raise ValueError(f"{gguf_type} rows must be uint8 [out, blocks x {block_bytes}], not {tuple(raw.shape)}")
    return decoder(raw)
