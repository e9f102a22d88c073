"""The KV cache's share of a GPU, from faked device reports: this process's use counts, other processes' does not."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spindle.backend.memory import MemorySnapshot, kv_cache_budget
from spindle.backend.model_runner import ModelRunner
from spindle.backend.models import ModelConfig
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
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_seqs=12, max_num_batched_tokens=40)
    runner = ModelRunner(config, ModelConfig.from_dir(tiny_llama_dir), tiny_llama_dir)
    recording = runner.sampler = RecordingSampler(runner.sampler)  # type: ignore[assignment]

    runner._profile_run(max_model_len=32, sample=True)

    vocab = runner.model_config.vocab_size
    assert recording.widths == {"sample": ((12, vocab), vocab - 1, 20), "prompt_logprobs": ((40, vocab), 20)}


REUSED_BLOCK = """
import resource
import sys
from pathlib import Path

import torch

from spindle.backend.memory import bound_host_memory


def rss_mib() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


if sys.argv[1] == "bounded":
    bound_host_memory()
block = torch.ones(6 * 2**20)  # 24 MiB, a large activation, then freed
del block
before = faults()
block = torch.ones(6 * 2**20)  # the next step's: from the heap, or mapped and faulted in again
taken_again = faults() - before
del block
big = torch.ones(16 * 2**20)  # 64 MiB: past any threshold, mapped
held = rss_mib()
del big
print(taken_again, held - rss_mib())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc (Linux)")
def test_a_freed_activation_is_reused_in_the_backend() -> None:
    """Without the settings, a 24 MiB block taken a second time faults its 6,144 pages in again (glibc maps it, or
    grows its heap for it); with them, it is reused from the heap. A 64 MiB one goes back to the system either way."""
    runs = {}
    for mode in ("plain", "bounded"):
        out = subprocess.run([sys.executable, "-c", REUSED_BLOCK, mode], capture_output=True, text=True, check=True)
        faults, returned = out.stdout.split()
        runs[mode] = int(faults), float(returned)
    assert runs["plain"][0] > 3000 and runs["bounded"][0] < 60, runs
    assert runs["plain"][1] > 60 and runs["bounded"][1] > 60, runs
