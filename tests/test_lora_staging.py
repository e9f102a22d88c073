"""A step's LoRA mapping travels in the input buffers' staging: pinned on CUDA, in the step's one int32 copy.

Before, each step with adapters copied its mapping to the device from pageable memory (a wait for the device on
CUDA). Without a GPU the buffers are the host's own, so these check what CUDA relies on: the mapping's device tensors
are views of the int32 buffer, aligned, within what the copy takes, beside the rest of the step; and a LoRA step
sends nothing to the device on its own.
"""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from test_lora import TINY_ADAPTERS, save_random_adapter, tiny_core
from torch.overrides import TorchFunctionMode

import spindle.backend
import spindle.kernels
from spindle.backend.input_buffers import InputBuffers
from spindle.backend.runner_state import SequenceState
from spindle.kernels.lora import LoraMapping
from spindle.shared import SamplingParams
from spindle.shared.protocol import EngineRequest

OURS = [Path(spindle.backend.__file__).parent, Path(spindle.kernels.__file__).parent]


def sequences(lens: list[int]) -> list[SequenceState]:
    """Sequences of 32 tokens in 8 blocks of 4, ``lens[i]`` of them new this step."""
    return [
        SequenceState(i, list(range(32)), 32, SamplingParams(), None, list(range(8 * i, 8 * i + 8)), 32 - n)
        for i, n in enumerate(lens)
    ]


def test_a_mixed_adapter_batch_is_staged_beside_the_step_inputs() -> None:
    buffers = InputBuffers(max_tokens=32, max_seqs=6, max_blocks=8, block_size=4, device=torch.device("cpu"))
    lens, slots = [1, 1, 1, 2, 4, 3], [2, 2, -1, -1, 0, 2]  # decodes, then prefill chunks; adapters and the base

    step = buffers.build(sequences(lens), lens, list(range(sum(lens))), [0, 5], slots)

    expected = LoraMapping.build(slots, lens)
    assert step.lora is not None and expected is not None
    assert (step.lora.segments, step.lora.slots, step.lora.max_group) == (expected.segments, [0, 2], 5)
    _, ints_end = buffers._ends(buffers.layout)
    for name in ("token_indices", "group_starts", "slot_ids"):
        staged, reference = getattr(step.lora, name), getattr(expected, name)
        assert staged.tolist() == reference.tolist(), name
        # A view of the device buffer at a 16-element boundary (Triton specialises on alignment), in the copy.
        assert staged.untyped_storage().data_ptr() == buffers._device_ints.untyped_storage().data_ptr()
        assert staged.storage_offset() % 16 == 0 and staged.storage_offset() + len(staged) <= ints_end
    assert step.meta.block_tables.tolist() == [list(range(8 * i, 8 * i + 8)) for i in range(6)]
    assert step.meta.seq_lens.tolist() == [32] * 6
    # The largest step fits: every token adapted, every sequence its own slot.
    full = buffers.build(sequences([1] * 5 + [27]), [1] * 5 + [27], list(range(32)), [0], list(range(6)))
    assert full.lora is not None and full.lora.slot_ids.tolist() == list(range(6))


class DeviceCopies(TorchFunctionMode):
    """Records the ``Tensor.to(device)`` calls made from our backend and kernel code."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        targets = [*args[1:], *(kwargs or {}).values()]
        if func is torch.Tensor.to and any(isinstance(t, torch.device | str) for t in targets):
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename)
            if any(path.is_relative_to(root) for root in OURS):
                self.calls.append(f"{path.name}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


def test_a_lora_step_sends_nothing_to_the_device_but_its_inputs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    rank, alpha, targets, extra = TINY_ADAPTERS["a"]
    adapter = save_random_adapter(tiny_llama_dir, tmp_path / "a", rank, alpha, targets, seed=0, std=0.1, **extra)
    core = tiny_core(tiny_llama_dir, lora_modules={"a": str(adapter)})
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, name in enumerate(["a", None, "a"]):
        core.add_request(EngineRequest(str(i), [3 + i, 9, 27, 5], params, arrival_time=0.0, lora_name=name))

    copies = DeviceCopies()
    with copies:
        while core.has_unfinished_requests():
            core.step()

    assert copies.calls == []
