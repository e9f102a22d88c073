"""Batched LoRA (punica / S-LoRA style): each token of a step adds the low-rank delta of its own adapter slot.

A LoRA-adapted projection computes ``y = base(x) + (x @ A.T) @ B.T * scale``. The engine keeps ``S`` adapter slots
in memory; per projection a slot holds ``A [K, in]`` and ``B.T [K, out]`` (stacked ``lora_a [S, K, in]`` and
``lora_b [S, K, out]``: both with the rank first, so that the shrink reads rows of ``A`` and the expand rows of
``B.T``, contiguous), rank padded with zeros and ``scale`` folded into ``B``. A fused projection (q/k/v, gate/up)
has one rank block per part: ``A`` stacks the parts' ``A`` matrices and ``B`` is block-diagonal, each part's rows
reading its own rank block, so one shrink (``x @ A.T``) and one expand (``@ B.T``) cover all the parts.

A step tells which slot each token uses with a :class:`LoraMapping` (``-1``: the base model, no delta), set for the
model's forward by :func:`lora_mapping`. The delta is added to ``y`` in place, on top of whatever computed the base
output (dense, oneDNN-packed or quantized), so the base's quantization does not matter to the adapter.

Three implementations with one signature, ``add_lora(y, x, slots, mapping)``, dispatched by
:mod:`spindle.kernels` (CUDA tensors to Triton, CPU tensors to the C++ kernel):

- :func:`add_lora` here, the torch reference: two matmuls per *segment*, a run of consecutive tokens with one slot
  (the model runner orders a step's sequences by slot within the decodes and within the prefill chunks, so a step
  has at most two runs per slot).
- CPU (:func:`add_lora_cpu`): the same segments in one C++ call per projection (``kernels/cpu/lora.cpp``), as small
  matmuls cost tens of microseconds of overhead each in torch on the CPU; the measurements are in that file.
- CUDA (``spindle.kernels.triton.lora``): a shrink and an expand kernel, each one launch over the step's tokens
  grouped by slot (``token_indices``, ``group_starts``), as punica's SGMV.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from spindle.kernels import cpu


@dataclass
class LoraSlots:
    """One projection's adapter slots, as every implementation of :func:`add_lora` reads them.

    Attributes:
        lora_a: ``[S, K, in]``: each slot's ``A``, one rank block of ``K / parts`` rows per part of the output.
        lora_b: ``[S, K, out]``: each slot's ``B.T``, block-diagonal: a part's rank block reaches only the part's
            output columns.
        part_ends: the end column of each part of the output (a fused q/k/v projection has three), the last ``out``.
        ranks: int64 ``[S, parts]`` on the host: the rank of each slot's adapter in each part, 0 where it adapts
            nothing; the rows of a rank block past it are zeros. The C++ kernel skips what is zero.

    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    part_ends: list[int]
    ranks: torch.Tensor


@dataclass
class LoraMapping:
    """Which adapter slot each token of one step uses, in the forms the implementations read.

    Attributes:
        segments: host ``(start, end, slot)`` runs of consecutive tokens ``[start, end)`` that use one slot; tokens
            of the base model are in none. The CPU paths run one shrink and one expand per run.
        segment_table: ``segments`` as an int64 ``[num_segments, 3]`` tensor on the host (the C++ kernel's input).
        slots: host list of the distinct slots the step uses, ascending.
        token_indices: ``[num_adapted_tokens]`` int32 on the device: the tokens that use a slot, grouped by slot in
            the order of ``slots`` (within a group, ascending).
        group_starts: ``[len(slots) + 1]`` int32 on the device: where each slot's group starts in ``token_indices``.
        slot_ids: ``[len(slots)]`` int32 on the device, ``slots`` as a tensor.
        max_group: the most tokens one slot has (sizes the Triton grid).
        num_tokens: the step's tokens, adapted or not.

    """

    segments: list[tuple[int, int, int]]
    segment_table: torch.Tensor
    slots: list[int]
    token_indices: torch.Tensor
    group_starts: torch.Tensor
    slot_ids: torch.Tensor
    max_group: int
    num_tokens: int

    @classmethod
    def build(
        cls,
        seq_slots: Sequence[int],
        query_lens: Sequence[int],
        device: torch.device | str = "cpu",
        stage: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> "LoraMapping | None":
        """The mapping of a step's flat batch, from each sequence's slot and its number of new tokens.

        Args:
            seq_slots: the slot of each sequence, in batch order; ``-1`` for the base model.
            query_lens: the new tokens of each sequence, in batch order.
            device: where the tensors go.
            stage: in place of a copy to ``device``, puts the int32 array that packs the device tensors there and
                returns it on the device (the model runner's pinned input buffers, copied without waiting).

        Returns:
            The mapping, or None when no sequence uses an adapter (the step then skips LoRA entirely).

        """
        if all(slot < 0 for slot in seq_slots):
            return None
        segments: list[tuple[int, int, int]] = []
        start = 0
        for slot, n in zip(seq_slots, query_lens, strict=True):
            if slot >= 0:
                if segments and segments[-1][1] == start and segments[-1][2] == slot:
                    segments[-1] = (segments[-1][0], start + n, slot)
                else:
                    segments.append((start, start + n, slot))
            start += n
        token_slots = np.repeat(np.asarray(seq_slots, dtype=np.int64), np.asarray(query_lens, dtype=np.int64))
        adapted = np.flatnonzero(token_slots >= 0)
        # Stable, so that a slot's tokens stay in ascending order (coalesced gathers).
        token_indices = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slots, counts = np.unique(token_slots[adapted], return_counts=True)
        group_starts = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=group_starts[1:])
        # One host-to-device copy for the three, each at a multiple of 16 elements: Triton specialises on whether a
        # pointer is 16-byte aligned, and a step-dependent offset would compile a kernel variant mid-request.
        parts, offsets = [token_indices, group_starts, slots], [0]
        for part in parts:
            offsets.append(offsets[-1] + -(-len(part) // 16) * 16)
        packed = np.zeros(offsets[-1], dtype=np.int32)
        for part, offset in zip(parts, offsets, strict=False):
            packed[offset : offset + len(part)] = part
        tensors = torch.from_numpy(packed).to(device) if stage is None else stage(packed)
        token_indices_t, group_starts_t, slot_ids_t = (
            tensors[offset : offset + len(part)] for part, offset in zip(parts, offsets, strict=False)
        )
        return cls(
            segments=segments,
            segment_table=torch.tensor(segments, dtype=torch.int64),
            slots=slots.tolist(),
            token_indices=token_indices_t,
            group_starts=group_starts_t,
            slot_ids=slot_ids_t,
            max_group=int(counts.max()),
            num_tokens=len(token_slots),
        )


def add_lora(y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, mapping: LoraMapping) -> None:
    """``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s]`` for every token ``t`` of slot ``s >= 0``, in place (torch).

    The reference: two matmuls per segment, over the whole padded rank. The shrink's result is rounded to ``x``'s
    dtype before the expand, as PEFT's ``lora_B(lora_A(x))`` rounds it.

    Args:
        y: ``[num_tokens, out]``, the base projection's output; written in place.
        x: ``[num_tokens, in]``, the projection's input.
        slots: the projection's adapter slots.
        mapping: the step's slots per token.

    """
    for start, end, slot in mapping.segments:
        y[start:end].addmm_(torch.mm(x[start:end], slots.lora_a[slot].T), slots.lora_b[slot])


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, slots: LoraSlots, mapping: LoraMapping) -> None:
    """:func:`add_lora` in one C++ call (``kernels/cpu/lora.cpp``): float32 math, ``y`` rounded once.

    It computes each slot's ranks only (``slots.ranks``), not the zeros that pad them or lie off the diagonal of a
    fused projection's ``B``. float32 and bfloat16 with dense rows; anything else goes to the torch reference.
    """
    dense = x.stride(-1) == 1 and y.stride(-1) == 1
    same_dtype = y.dtype == x.dtype == slots.lora_a.dtype == slots.lora_b.dtype
    if dense and same_dtype and x.dtype in (torch.float32, torch.bfloat16):
        cpu.lora_add_(y, x, slots.lora_a, slots.lora_b, mapping.segment_table, slots.part_ends, slots.ranks)
    else:
        add_lora(y, x, slots, mapping)


_mapping: LoraMapping | None = None


@contextmanager
def lora_mapping(mapping: LoraMapping | None) -> Iterator[None]:
    """Within the block, :func:`current_lora_mapping` is ``mapping`` (None: no token uses an adapter).

    The model runner sets it around a step's forward, as the attention layout is set by
    :func:`spindle.kernels.attention_metadata`: the models' ``forward`` signature stays what every model class has.
    """
    global _mapping
    previous, _mapping = _mapping, mapping
    try:
        yield
    finally:
        _mapping = previous


def current_lora_mapping() -> LoraMapping | None:
    """The mapping of the step being run, or None when it uses no adapter (or outside :func:`lora_mapping`)."""
    return _mapping
