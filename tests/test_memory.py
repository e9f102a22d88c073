"""The KV cache's share of a GPU, from faked device reports: this process's use counts, other processes' does not."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spindle.backend.memory import MemorySnapshot, kv_cache_budget
from spindle.backend.model_runner import ModelRunner
from spindle.backend.models import CheckpointConfig
from spindle.shared.config import EngineConfig

GIB = 2**30
TOTAL = 100 * GIB


def engine_start(others: float) -> tuple[MemorySnapshot, MemorySnapshot, int]:
    """(start, after profile, reserved peak) of an engine on a device where other processes hold ``others`` GiB.

    It loads 2 GiB of weights, peaks at 3 GiB of activations (released by then), and the device lost 0.5 GiB outside
    torch's allocator (workspaces, modules).
    """
    start = MemorySnapshot(free=int((100 - others) * GIB), total=TOTAL, reserved=0)
    after = MemorySnapshot(free=int((100 - others - 2.5) * GIB), total=TOTAL, reserved=2 * GIB)
    return start, after, 5 * GIB


def test_the_share_minus_this_engines_own_use() -> None:
    # 30 GiB share - (2 weights + 3 activations) - 0.5 outside torch
    assert kv_cache_budget(0.3, *engine_start(others=1)) == int(24.5 * GIB)


def test_a_second_engine_beside_the_first_gets_the_same_cache() -> None:
    """Two engines at 0.3 on one device: the second must not count the first's 30 GiB against its own share."""
    first = kv_cache_budget(0.3, *engine_start(others=1))
    second = kv_cache_budget(0.3, *engine_start(others=31))
    assert second == first > 0


def test_a_share_the_device_cannot_hold_is_refused_clearly() -> None:
    # Two engines hold 61 GiB; a third asks for half the device: 44.5 GiB of cache, 33.5 free beside its activations.
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 .* only 33.50 GiB is free"):
        kv_cache_budget(0.5, *engine_start(others=61))


class RecordingSampler:
    """The runner's sampler, noting the widths it is called at."""

    def __init__(self, sampler: object) -> None:
        self.sampler = sampler
        self.widths: dict[str, tuple] = {}

    def __call__(self, logits: torch.Tensor, seqs: list) -> object:
        self.widths["sample"] = (tuple(logits.shape), seqs[0].params.top_k, seqs[0].params.logprobs)
        return self.sampler(logits, seqs)  # type: ignore[operator]

    def prompt_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, num: int) -> object:
        self.widths["prompt_logprobs"] = (tuple(logits.shape), num)
        return self.sampler.prompt_logprobs(logits, targets, num)  # type: ignore[attr-defined]


def test_the_profile_pass_samples_at_full_width(tiny_llama_dir: Path) -> None:
    """What a real step can allocate is in the profiled peak: all sequences sampling, a chunk's prompt logprobs."""
    config = EngineConfig.of(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=12, max_num_batched_tokens=40)
    runner = ModelRunner(config, CheckpointConfig.from_dir(tiny_llama_dir), tiny_llama_dir)
    recording = runner.sampler = RecordingSampler(runner.sampler)  # type: ignore[assignment]

    runner._profile_run(max_model_len=32, sample=True)

    vocab = runner.checkpoint.vocab_size
    assert recording.widths == {"sample": ((12, vocab), vocab - 1, 20), "prompt_logprobs": ((40, vocab), 20)}


STEPS = """
import resource
from pathlib import Path

import torch

from spindle.backend.memory import bound_host_memory


def rss_mib() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


bound_host_memory()
sizes = [3 * 2**20, 3 * 2**19, 5 * 2**17, 3 * 2**20]  # a step's activations: 12, 6, 2.5 and 12 MiB of floats
for step in range(10):
    if step == 6:  # the heap has settled (in 1-4 steps, as blocks freed in the middle of it merge)
        before = faults()
    activations = [torch.ones(n) for n in sizes]
    del activations
print(faults() - before, 4 * 4 * sum(sizes) // 4096)  # 4 steps' pages
big = torch.ones(16 * 2**20)  # 64 MiB: past the threshold, mapped
held = rss_mib()
del big
print(held - rss_mib())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc (Linux)")
def test_the_backends_activations_are_reused_from_step_to_step() -> None:
    """Once the heap has settled, steps whose activations are megabytes reuse its pages: 0-9% of them faulted in
    again over 4 steps in runs here (a block now and then lands past the heap's top, as small allocations split the
    freed space), where the old 4 MiB threshold mapped every such block afresh, all of its pages. A 64 MiB block goes
    back to the system when freed."""
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True).stdout.split()
    faults, pages, returned = int(out[0]), int(out[1]), float(out[2])
    assert faults < pages / 2, (faults, pages)
    assert returned > 60
