"""A step waits for the device once: what would sync on CUDA, counted on the CPU; and the persistent input buffers.

On CUDA a ``.tolist()``, ``.item()``, ``bool()`` or ``.cpu()`` of a device tensor, or a ``torch.tensor(...)`` made
from host data, waits for every kernel queued before it. On the CPU nothing waits, but the same calls are made, so a
torch function mode records each one with the line of our code that made it. The engine runs its steps on the Triton
kernels (in the interpreter) and the decode-graph path, the code CUDA runs. Only :mod:`spindle.backend.transfers` may
make such calls, and a step calls its :func:`~spindle.backend.transfers.fetch` at most once.
"""

import sys
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import spindle.backend
import spindle.backend.model_runner
import spindle.kernels
from spindle.backend import transfers
from spindle.backend.engine_core import EngineCore
from spindle.backend.input_buffers import InputBuffers
from spindle.backend.model_runner import DecodeGraphs
from spindle.backend.runner_state import SequenceState
from spindle.shared import SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.protocol import EngineRequest

# Reads of a tensor's values on the host, and tensors made from host data: each a wait for the device on CUDA.
SYNCING = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero", "tensor"}
OURS = [Path(spindle.backend.__file__).parent, Path(spindle.kernels.__file__).parent]
TORCH = Path(torch.__file__).parent


class SyncRecorder(TorchFunctionMode):
    """Records the syncing torch calls made from our backend and kernel code, outside the transfer helpers."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") in SYNCING:
            frame = sys._getframe(1)
            # The caller is the innermost frame outside torch; a library's own calls (Triton's interpreter reading
            # its arguments) are not ours.
            while frame is not None and Path(frame.f_code.co_filename).is_relative_to(TORCH):
                frame = frame.f_back
            path = Path(frame.f_code.co_filename) if frame is not None else Path()
            if any(path.is_relative_to(root) for root in OURS) and path != Path(transfers.__file__):
                self.calls.append(f"{func.__name__} at {path.name}:{frame.f_lineno}")  # type: ignore[union-attr]
        return func(*args, **(kwargs or {}))


REQUESTS = [
    ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], SamplingParams(temperature=0, max_tokens=6)),
    ([30, 31, 32, 33, 34, 35], SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=6)),
    ([40, 41, 42, 43], SamplingParams(temperature=1.0, logprobs=3, prompt_logprobs=2, max_tokens=5)),
    (
        [50, 51, 52, 50, 51, 52, 50, 51],
        SamplingParams(temperature=0, num_speculative_tokens=3, repetition_penalty=1.2, max_tokens=6),
    ),
    (
        [60, 61, 62, 63, 64],
        SamplingParams(
            temperature=0.7, min_p=0.05, frequency_penalty=0.5, logit_bias={7: 2.0}, min_tokens=2, max_tokens=5
        ),
    ),
]


@pytest.mark.parametrize("decode_graphs", [False, True], ids=["eager", "decode_graphs"])
def test_a_step_waits_for_the_device_at_most_once(
    decode_graphs: bool, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig.of(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16
    )
    core = EngineCore(config)
    if decode_graphs:
        core.runner.decode_graphs = DecodeGraphs(core.runner.model, core.runner.kv_caches, 8, 512, 8)
    fetches: list[int] = []
    fetch = transfers.fetch
    monkeypatch.setattr(spindle.backend.model_runner, "fetch", lambda tensors: fetches.append(1) or fetch(tensors))
    for i, (prompt, params) in enumerate(REQUESTS):
        core.add_request(EngineRequest(str(i), prompt, params, arrival_time=0.0))

    recorder = SyncRecorder()
    steps = 0
    with spindle.kernels.force_triton(), recorder:
        while core.has_unfinished_requests():
            fetches.clear()
            core.step()
            steps += 1
            assert len(fetches) <= 1

    assert recorder.calls == []
    assert steps > 5  # chunked prompts, decodes with and without drafts


def test_a_greedy_decode_step_copies_nothing_but_its_inputs(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Besides the input buffers' two copies, a greedy decode step sends nothing to the device."""
    core = EngineCore(EngineConfig.of(model=str(tiny_llama_dir), dtype="float32", device="cpu"))
    for i in range(3):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        core.add_request(EngineRequest(str(i), [3 + i, 9, 27], params, arrival_time=0.0))
    core.step()  # the prompts
    copies: list[int] = []
    to_device = transfers.to_device
    for module in (spindle.backend.model_runner, spindle.backend.sampler):
        monkeypatch.setattr(module, "to_device", lambda *args: copies.append(1) or to_device(*args))
    while core.has_unfinished_requests():
        core.step()
    assert copies == []


SEQ_IDS = count()


def sequence(table: list[int], computed: int, tokens: int) -> SequenceState:
    return SequenceState(next(SEQ_IDS), list(range(tokens)), tokens, SamplingParams(), None, table, computed)


def test_block_tables_are_written_incrementally_and_anew_when_replaced() -> None:
    buffers = InputBuffers(max_tokens=32, max_seqs=3, max_blocks=6, block_size=4, device=torch.device("cpu"))
    a, b = sequence([7, 3], computed=5, tokens=6), sequence([1, 2, 4], computed=0, tokens=9)

    step = buffers.build([a, b], [1, 9], [5, *range(9)], [0, 9])
    assert step.meta.block_tables[0, :2].tolist() == [7, 3] and step.meta.block_tables[1].tolist() == [1, 2, 4]
    assert step.meta.slot_mapping.tolist() == [3 * 4 + 1, *range(4, 8), *range(8, 12), 16]
    assert step.positions.tolist() == [5, *range(9)]
    assert step.meta.seq_lens.tolist() == [6, 9] and step.meta.query_start_loc.tolist() == [0, 1, 10]
    assert step.sample_rows.tolist() == [0, 9] and step.meta.num_decodes == 1

    a.block_table.append(5)  # grows in place: only the new entry is written
    a.num_computed_tokens = 8
    b.block_table = [9, 8, 6]  # reallocated (preempted and scheduled again): a new list, rewritten whole
    b.num_computed_tokens = 8
    step = buffers.build([a, b], [1, 1], [0, 1], [0, 1])
    assert step.meta.block_tables.tolist() == [[7, 3, 5], [9, 8, 6]]
    assert step.meta.slot_mapping.tolist() == [5 * 4, 6 * 4]

    a.block_table = [7]  # cut (rejected drafts: SequenceState.update makes a new list), then grown again
    a.block_table.append(4)
    a.num_computed_tokens = 5
    step = buffers.build([a], [2], [0, 1], [1])
    assert step.meta.block_tables.tolist() == [[7, 4]]
    assert step.meta.slot_mapping.tolist() == [4 * 4 + 1, 4 * 4 + 2]


def test_steps_of_the_same_sizes_reuse_their_views_with_the_new_values() -> None:
    buffers = InputBuffers(max_tokens=32, max_seqs=3, max_blocks=6, block_size=4, device=torch.device("cpu"))
    a, b = sequence([7, 3], computed=5, tokens=6), sequence([1, 2], computed=6, tokens=7)

    first = buffers.build([a, b], [1, 1], [11, 12], [0, 1])
    a.num_computed_tokens, b.num_computed_tokens = 6, 7
    second = buffers.build([a, b], [1, 1], [21, 22], [0, 1])

    # The tensors are the first step's (views of the same buffers), holding the second step's values.
    assert second.input_ids is first.input_ids and second.meta.block_tables is first.meta.block_tables
    assert second.input_ids.tolist() == [21, 22] and second.positions.tolist() == [6, 7]
    assert second.meta.seq_lens.tolist() == second.meta.seq_lens_list == [7, 8]
    assert second.meta.slot_mapping.tolist() == [3 * 4 + 2, 2 * 4 + 3]
    a.block_table.append(5)  # a third block column: new sizes, new views
    a.num_computed_tokens = 8
    third = buffers.build([a, b], [1, 1], [31, 32], [0, 1])
    assert third.meta.block_tables is not first.meta.block_tables
    assert third.meta.block_tables.tolist() == [[7, 3, 5], [1, 2, 0]] and third.positions.tolist() == [8, 7]


def test_a_decode_verifying_drafts_attends_as_one_decode_per_token() -> None:
    buffers = InputBuffers(max_tokens=32, max_seqs=5, max_blocks=6, block_size=4, device=torch.device("cpu"))
    plain, verifying = sequence([7, 3], computed=5, tokens=6), sequence([1, 2, 4], computed=6, tokens=7)
    prompt = sequence([9], computed=0, tokens=3)

    # The verifying sequence's last token and 2 drafts (positions 6-8): three decodes whose contexts end at each.
    step = buffers.build([plain, verifying, prompt], [1, 3, 3], [5, 6, 60, 61, 0, 1, 2], [0, 1, 2, 3, 6], None, 2)
    assert step.meta.num_decodes == 4 and step.meta.query_lens_list == [1, 1, 1, 1, 3]
    assert step.meta.seq_lens.tolist() == step.meta.seq_lens_list == [6, 7, 8, 9, 3]
    assert step.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 7]
    assert step.meta.block_tables.tolist() == [[7, 3, 0], *[[1, 2, 4]] * 3, [9, 0, 0]]
    assert step.positions.tolist() == [5, 6, 7, 8, 0, 1, 2]
    assert step.meta.slot_mapping.tolist() == [3 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4 * 4, 36, 37, 38]

    # More rows than max_num_seqs: a row per sequence, the verification attending as a prefill chunk.
    wide = sequence([5, 6, 8], computed=6, tokens=7)
    step = buffers.build([plain, verifying, wide], [1, 3, 4], list(range(8)), [0, 3], None, 3)
    assert step.meta.query_lens_list == [1, 3, 4] and step.meta.num_decodes == 1
    assert step.meta.seq_lens_list == [6, 9, 10]
