"""A step's model inputs, written into persistent host buffers and sent to the device in two copies.

A step's integers (token ids, positions, cache slots, the rows to sample; context lengths, query offsets, block
tables; which LoRA adapter slot each token uses) are computed with numpy into one pinned int64 and one pinned int32
buffer, allocated once, and copied to their device twins with ``non_blocking``: two copies per step, none of which
waits for the device. Block tables are kept row by row across steps and only their new entries are written, rather
than rebuilt from Python lists.

The attention layout has a row per query of a sequence, where a decode verifying drafts has one per token: its
``k``-th new token is then a decode of its own whose context ends at that token, which is causal attention over its
queries, and a step of decodes and such verifications runs as a decode step (on the CPU, the C++ ``DecodeStack``
instead of the layers one by one).
"""

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from spindle.backend.runner_state import SequenceState
from spindle.kernels import AttentionMetadata
from spindle.kernels.lora import LoraMapping

# Every segment starts at a multiple of 16 elements: Triton specialises on whether a pointer is 16-byte aligned, so a
# segment at a step-dependent odd offset would compile a kernel variant mid-request.
_ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class StepInputs:
    """One step's inputs on the device (views of :class:`InputBuffers`' device buffers, valid until the next step).

    Attributes:
        input_ids: ``[num_tokens]`` int64.
        positions: ``[num_tokens]`` int64.
        meta: the attention layout (its host lists too).
        sample_rows: ``[num_rows]`` int64, the rows of the step's hidden states to sample from.
        lora: the adapter slot of each token, or None when no sequence uses an adapter.

    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    lora: LoraMapping | None = None


class StepLayout(NamedTuple):
    """The sizes that locate a step's inputs in :class:`InputBuffers`' two buffers."""

    num_tokens: int
    num_seqs: int  # attention rows: a sequence's, or one per token of a decode verifying drafts
    num_rows: int
    width: int  # block-table columns
    num_decodes: int
    max_seq_len: int
    lora_size: int = 0  # int32 elements the LoRA mapping may take, after the block tables (0 without one)


@dataclass
class _TableRow:
    slot: int  # row of InputBuffers.tables
    table: list[int]  # the sequence's block table, as a reference: the block manager replaces it on (re)allocation
    filled: int  # entries of the row that hold table[:filled]


class InputBuffers:
    """Persistent host and device buffers for the inputs of steps of up to the given sizes.

    Args:
        max_tokens: the most tokens a step has (``max_num_batched_tokens``).
        max_seqs: the most sequences a step has (``max_num_seqs``), and the most attention rows: a step whose
            verifying decodes' tokens would take more rows keeps a row per sequence.
        max_blocks: the most blocks a sequence holds (``max_model_len`` over the block size, rounded up).
        block_size: tokens per cache block.
        device: where the model runs; on CUDA the host buffers are pinned.

    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.layout = StepLayout(0, 0, 0, 0, 0, 0)  # the last built step's
        pinned = device.type == "cuda"
        self.max_seqs = max_seqs
        self._longs = torch.zeros(4 * _aligned(max_tokens), dtype=torch.int64, pin_memory=pinned)
        # The LoRA mapping holds at most every token, and a group start and a slot per sequence.
        lora = _aligned(max_tokens) + _aligned(max_seqs + 1) + _aligned(max_seqs)
        self._ints = torch.zeros(
            _aligned(max_seqs) + _aligned(max_seqs + 1) + _aligned(max_seqs * max_blocks) + lora,
            dtype=torch.int32,
            pin_memory=pinned,
        )
        # On the CPU the model reads the host buffers themselves.
        self._device_longs = self._longs.to(device) if pinned else self._longs
        self._device_ints = self._ints.to(device) if pinned else self._ints
        self._copied = torch.cuda.Event() if pinned else None
        self._host_longs, self._host_ints = self._longs.numpy(), self._ints.numpy()
        self.tables = np.zeros((max_seqs, max_blocks), dtype=np.int32)
        self._rows: dict[int, _TableRow] = {}
        self._free_slots = list(range(max_seqs))
        self._view_sizes: tuple[int, ...] = ()  # the sizes of the step whose views _views holds
        self._views: tuple[torch.Tensor, ...] = ()

    def build(
        self,
        seqs: list[SequenceState],
        query_lens: list[int],
        input_ids: list[int],
        sample_rows: list[int],
        lora_slots: list[int] | None = None,
        num_decode_seqs: int = 0,
    ) -> StepInputs:
        """Write a step's inputs and start their copy to the device.

        Args:
            seqs: the step's sequences, decodes first (those verifying drafts after the plain ones), their block
                tables holding this step's tokens.
            query_lens: the new tokens of each; they start at its ``num_computed_tokens``.
            input_ids: the new tokens, sequence after sequence.
            sample_rows: the rows of the flat batch whose hidden states are sampled from.
            lora_slots: each sequence's LoRA adapter slot (``-1``: the base model), or None without adapters. The
                mapping's device tensors (:class:`~spindle.kernels.lora.LoraMapping`) are staged after the block
                tables and travel in the same copy.
            num_decode_seqs: how many of the first sequences are decodes, with or without drafts: each of their
                tokens gets an attention row of its own. A plain decode's one token is its row anyway, so a step
                without drafts may leave it 0.

        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffers (it has, in practice)
        num_tokens, num_rows = len(input_ids), len(sample_rows)
        lens = np.asarray(query_lens, dtype=np.int64)
        starts = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=len(seqs))
        token_seq = np.repeat(np.arange(len(seqs)), lens)
        positions = np.arange(num_tokens) + np.repeat(starts - np.cumsum(lens) + lens, lens)
        # Attention rows: the decodes' tokens one each (their context ends at the token), then the other sequences.
        num_decode_tokens = int(lens[:num_decode_seqs].sum())
        if num_decode_tokens + len(seqs) - num_decode_seqs > self.max_seqs:
            num_decode_seqs = num_decode_tokens = 0
        row_seq = np.concatenate([token_seq[:num_decode_tokens], np.arange(num_decode_seqs, len(seqs))])
        row_lens = np.concatenate([np.ones(num_decode_tokens, dtype=np.int64), lens[num_decode_seqs:]])
        seq_lens = np.concatenate([positions[:num_decode_tokens] + 1, (starts + lens)[num_decode_seqs:]])
        num_seqs = len(row_seq)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(row_lens, out=query_start_loc[1:])
        width = max(len(seq.block_table) for seq in seqs)

        t = _aligned(num_tokens)
        longs = self._host_longs
        longs[:num_tokens] = input_ids
        longs[t : t + num_tokens] = positions
        s = _aligned(num_seqs)
        b = s + _aligned(num_seqs + 1)
        ints = self._host_ints
        ints[:num_seqs] = seq_lens
        ints[s : s + num_seqs + 1] = query_start_loc
        tables = ints[b : b + num_seqs * width].reshape(num_seqs, width)
        table_slots = self._table_slots(seqs)
        np.take(self.tables[:, :width], table_slots[row_seq], axis=0, out=tables)
        block = self.tables[table_slots[token_seq], positions // self.block_size].astype(np.int64)
        longs[2 * t : 3 * t][:num_tokens] = block * self.block_size + positions % self.block_size
        longs[3 * t : 3 * t + num_rows] = sample_rows

        stage = partial(self._stage_lora, _aligned(b + num_seqs * width))
        lora = None if lora_slots is None else LoraMapping.build(lora_slots, query_lens, stage=stage)
        # The mapping's most elements (every token adapted, every sequence its own slot): what the copy takes.
        lora_size = 0 if lora is None else _aligned(num_tokens) + _aligned(len(seqs) + 1) + _aligned(len(seqs))
        row_lens_list = row_lens.tolist()
        num_decodes = next((i for i, n in enumerate(row_lens_list) if n != 1), num_seqs)
        self.layout = StepLayout(num_tokens, num_seqs, num_rows, width, num_decodes, int(seq_lens.max()), lora_size)
        if self._copied is not None:
            longs_end, ints_end = self._ends(self.layout)
            self._device_longs[:longs_end].copy_(self._longs[:longs_end], non_blocking=True)
            self._device_ints[:ints_end].copy_(self._ints[:ints_end], non_blocking=True)
            self._copied.record()
        step = self.views(self.layout, row_lens_list, seq_lens.tolist())
        step.lora = lora
        return step

    def _stage_lora(self, start: int, packed: np.ndarray) -> torch.Tensor:
        """Write the LoRA mapping's packed int32 array from ``start`` of the host buffer; return its device place."""
        self._host_ints[start : start + len(packed)] = packed
        return self._device_ints[start : start + len(packed)]

    def views(self, layout: StepLayout, query_lens: list[int], seq_lens: list[int]) -> StepInputs:
        """The step of ``layout`` held in the device buffers, as :class:`StepInputs`.

        ``query_lens`` and ``seq_lens`` are the host lists of the attention metadata.
        """
        num_tokens, num_seqs, num_rows, width, num_decodes, max_seq_len, _ = layout
        sizes = (num_tokens, num_seqs, num_rows, width)
        if sizes != self._view_sizes:  # the views of the last sizes serve again: a decode step's rarely change
            self._view_sizes, self._views = sizes, self._slices(*sizes)
        input_ids, positions, slot_mapping, sample_rows, seq_lens_view, query_start_loc, block_tables = self._views
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_view,
            block_tables=block_tables,
            num_decodes=num_decodes,
            max_seq_len=max_seq_len,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta, sample_rows=sample_rows)

    def _slices(self, num_tokens: int, num_seqs: int, num_rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """The device buffers' views a step of these sizes reads.

        Input ids, positions, slot mapping and sample rows (int64), then sequence lengths, query starts and block tables
        (int32).
        """
        t, s = _aligned(num_tokens), _aligned(num_seqs)
        b = s + _aligned(num_seqs + 1)
        longs, ints = self._device_longs, self._device_ints
        return (
            longs[:num_tokens],
            longs[t : t + num_tokens],
            longs[2 * t : 2 * t + num_tokens],
            longs[3 * t : 3 * t + num_rows],
            ints[:num_seqs],
            ints[s : s + num_seqs + 1],
            ints[b : b + num_seqs * width].view(num_seqs, width),
        )

    @staticmethod
    def _ends(layout: StepLayout) -> tuple[int, int]:
        """Where a step of ``layout`` ends in the int64 and in the int32 buffer."""
        s = _aligned(layout.num_seqs)
        b = s + _aligned(layout.num_seqs + 1)
        tables_end = b + layout.num_seqs * layout.width
        ints_end = _aligned(tables_end) + layout.lora_size if layout.lora_size else tables_end
        return 3 * _aligned(layout.num_tokens) + layout.num_rows, ints_end

    def _table_slots(self, seqs: list[SequenceState]) -> np.ndarray:
        """The rows of :attr:`tables` holding each sequence's block table, brought up to date.

        A sequence keeps its row while it is in consecutive steps. The block manager only ever appends to a table in
        place; any other change (a new allocation, a cut) replaces the list, and then the row is written anew.
        """
        present = {seq.seq_id for seq in seqs}
        for seq_id in [seq_id for seq_id in self._rows if seq_id not in present]:
            self._free_slots.append(self._rows.pop(seq_id).slot)
        slots = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            row = self._rows.get(seq.seq_id)
            if row is None:
                row = self._rows[seq.seq_id] = _TableRow(self._free_slots.pop(), seq.block_table, 0)
            elif row.table is not seq.block_table:
                row.table, row.filled = seq.block_table, 0
            if len(row.table) > row.filled:
                self.tables[row.slot, row.filled : len(row.table)] = row.table[row.filled :]
                row.filled = len(row.table)
            slots[i] = row.slot
        return slots
