"""The KV cache's share of a GPU, from faked device reports: this process's use counts, other processes' does not.

The budget is driven as the model runner drives it (:class:`~spindle.backend.memory.MemoryMeter`) over
:class:`FakeCuda`, which behaves as torch's caching allocator does: an engine created after another in the same
process, or beside one, must stay within its share, CUDA graphs' private pool included.
"""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spindle.backend.memory import KVBudget, MemoryMeter, MemorySnapshot, kv_cache_budget
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


@dataclass
class Block:
    """A piece of a reserved segment: allocated, or free and cached."""

    size: int
    free: bool
    pool: int  # 0: the general pool; otherwise a CUDA graph's private one


class FakeCuda:
    """One process's ``torch.cuda`` memory API over a device that other processes share, as torch's allocator behaves.

    Memory is reserved from the device in segments. A freed block stays cached, reserved, and serves a later
    allocation of at most its size from the same pool (split, as torch splits its large blocks); ``empty_cache``
    returns the segments with nothing allocated to the device. A CUDA graph's private pool (:meth:`capture`) has its
    own segments, which other allocations never take and ``empty_cache`` returns only once the graph is gone.

    Args:
        total: the device's memory.
        others: what other processes hold of it.

    """

    def __init__(self, total: int, others: int) -> None:
        self.total = total
        self.outside = others  # other processes', and this one's outside its allocator (workspaces, modules)
        self.segments: list[list[Block]] = []
        self.peak = 0
        self._pools = 0
        self._live_pools: set[int] = set()

    def malloc(self, size: int, pool: int = 0) -> Block:
        """An allocated block of ``size`` bytes: a cached one of the pool if one is large enough, else a new segment.

        Raises:
            MemoryError: when the device has not ``size`` bytes free.

        """
        cached = [(b.size, segment, b) for segment in self.segments for b in segment if b.free and b.pool == pool]
        fits = [entry for entry in cached if entry[0] >= size]
        if fits:
            _, segment, found = min(fits, key=lambda entry: entry[0])
            at = segment.index(found)
            block = Block(size, False, pool)
            segment[at : at + 1] = [block, Block(found.size - size, True, pool)][: 2 if found.size > size else 1]
            return block
        if size > self.mem_get_info(DEVICE)[0]:
            raise MemoryError(
                f"out of memory: {size / GIB:.2f} GiB asked, {self.mem_get_info(DEVICE)[0] / GIB:.2f} free"
            )
        block = Block(size, False, pool)
        self.segments.append([block])
        self.peak = max(self.peak, self.memory_reserved(DEVICE))
        return block

    def free(self, block: Block) -> None:
        """Free ``block``: it stays cached in its segment, merged with free neighbours."""
        block.free = True
        for index, segment in enumerate(self.segments):
            if any(b is block for b in segment):
                merged: list[Block] = []
                for b in segment:
                    if merged and merged[-1].free and b.free:
                        merged[-1] = Block(merged[-1].size + b.size, True, b.pool)
                    else:
                        merged.append(b)
                self.segments[index] = merged

    def capture(self, pool_bytes: int, eager_bytes: int) -> "FakeGraphs":
        """Capture graphs as ``DecodeGraphs`` does: an eager run first (general pool), then into a private pool."""
        self.free(self.malloc(eager_bytes))
        self._pools += 1
        self._live_pools.add(self._pools)
        return FakeGraphs(self, self._pools, self.malloc(pool_bytes, self._pools))

    def release_pool(self, pool: int, blocks: list[Block]) -> None:
        """The graphs of ``pool`` are gone: its blocks are free, and ``empty_cache`` may return its segments."""
        self._live_pools.discard(pool)
        for block in blocks:
            self.free(block)

    def empty_cache(self) -> None:
        """Return every segment with nothing allocated (and not a live graph's pool) to the device."""
        self.segments = [
            segment
            for segment in self.segments
            if not all(b.free for b in segment) or segment[0].pool in self._live_pools
        ]

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """The peak starts again from what is reserved now."""
        self.peak = self.memory_reserved(device)

    def max_memory_reserved(self, device: torch.device) -> int:
        """The most reserved since the last reset."""
        return self.peak

    def memory_reserved(self, device: torch.device) -> int:
        """Segments held, allocated or cached."""
        return sum(b.size for segment in self.segments for b in segment)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """The device's free memory (everyone's use counted) and its total."""
        return self.total - self.outside - self.memory_reserved(device), self.total


class FakeGraphs:
    """Captured CUDA graphs holding their private pool's blocks; the pool is released when they are dropped."""

    def __init__(self, cuda: FakeCuda, pool: int, *blocks: Block) -> None:
        self.cuda, self.pool, self.blocks = cuda, pool, list(blocks)

    def __del__(self) -> None:
        self.cuda.release_pool(self.pool, self.blocks)


DEVICE = torch.device("cuda", 0)
WEIGHTS, ACTIVATIONS, WORKSPACES, GRAPH_POOL = 2 * GIB, 3 * GIB, GIB // 2, GIB


@dataclass
class Engine:
    """The device memory one engine holds, as the model runner's start-up leaves it."""

    budget: KVBudget
    blocks: list[Block]
    graphs: FakeGraphs

    def close(self, cuda: FakeCuda) -> None:
        """Drop the engine: its blocks are freed, and cached (nothing empties torch's cache)."""
        for block in self.blocks:
            cuda.free(block)
        del self.graphs


def start_engine(cuda: FakeCuda, utilization: float, first_in_process: bool = True) -> Engine:
    """The model runner's start-up, call for call: the weights, the profile pass, the budget, the cache, the graphs."""
    meter = MemoryMeter(DEVICE, cuda)  # ModelRunner.__init__, before the weights
    weights = cuda.malloc(WEIGHTS)
    activations = cuda.malloc(ACTIVATIONS)  # _profile_run
    if first_in_process:
        cuda.outside += WORKSPACES  # cuBLAS's workspaces, the kernels' modules: once a process
    cuda.free(activations)
    measured = meter.after_profile(lambda: cuda.capture(GRAPH_POOL, eager_bytes=GIB))  # init_cache
    budget = kv_cache_budget(utilization, *measured)
    cache = cuda.malloc(budget)
    graphs = cuda.capture(GRAPH_POOL, eager_bytes=GIB)  # _capture_decode_graphs
    cuda.empty_cache()
    return Engine(KVBudget.of(utilization, measured, budget, 1, budget), [weights, cache], graphs)


def serve(cuda: FakeCuda, engines: int) -> int:
    """Steps of ``engines`` engines at once, each taking the largest step's activations back: the reserved bytes."""
    steps = [cuda.malloc(ACTIVATIONS) for _ in range(engines)]
    reserved = cuda.memory_reserved(DEVICE)
    for step in steps:
        cuda.free(step)
    return reserved


def test_an_engine_stays_within_its_share_its_cuda_graphs_pool_included() -> None:
    cuda = FakeCuda(TOTAL, others=GIB)
    engine = start_engine(cuda, 0.3)

    # The share minus the weights and activations, the workspaces and the graphs' pool (not the trial run's blocks).
    assert engine.budget == KVBudget(
        total=TOTAL,
        utilization=0.3,
        start_free=99 * GIB,
        start_reserved=0,
        torch_peak=WEIGHTS + ACTIVATIONS,
        outside_torch=WORKSPACES,
        graph_pool=GRAPH_POOL,
        budget_bytes=int(23.5 * GIB),
        block_bytes=1,
        blocks=int(23.5 * GIB),
    )
    assert serve(cuda, engines=1) + WORKSPACES == int(0.3 * TOTAL)


@pytest.mark.parametrize("closed", [True, False], ids=["created_twice", "beside_another"])
def test_a_second_engine_in_one_process_stays_within_its_share(closed: bool) -> None:
    """The first engine's freed or cached blocks must not serve the second's weights and activations unseen.

    Taken from torch's cache, they would not raise the reserved peak the budget reads, and the second engine's cache
    would take their bytes again: the process held 35 GiB for a 30 GiB share (created twice), 62.5 GiB for two.
    """
    cuda = FakeCuda(TOTAL, others=GIB)
    first = start_engine(cuda, 0.3)
    serve(cuda, engines=1)  # its activations stay cached
    if closed:
        first.close(cuda)
        del first

    second = start_engine(cuda, 0.3, first_in_process=False)

    assert serve(cuda, engines=1 if closed else 2) <= (1 if closed else 2) * int(0.3 * TOTAL)
    assert second.budget.torch_peak == WEIGHTS + ACTIVATIONS


def test_the_trial_graphs_pool_is_returned_before_the_cache_is_sized() -> None:
    cuda = FakeCuda(TOTAL, others=GIB)
    meter = MemoryMeter(DEVICE, cuda)
    weights = cuda.malloc(WEIGHTS)

    measured = meter.after_profile(lambda: cuda.capture(GRAPH_POOL, eager_bytes=GIB))

    assert measured.graph_pool == GRAPH_POOL
    assert measured.now.reserved == cuda.memory_reserved(DEVICE) == WEIGHTS
    assert kv_cache_budget(0.3, *measured) == kv_cache_budget(0.3, *measured._replace(graph_pool=0)) - GRAPH_POOL
    cuda.free(weights)


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
import sys
from pathlib import Path

import torch

from spindle import LLMEngine
from spindle.backend.memory import bound_host_memory


def rss_mib() -> float:
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


if sys.argv[1] == "backend":
    bound_host_memory()
else:  # an in-process engine sets the allocator up as it builds its core
    engine = LLMEngine.from_args(model=sys.argv[1], dtype="float32", kv_cache_memory="4MiB")
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
@pytest.mark.parametrize("process", ["backend", "in_process_engine"])
def test_the_backends_activations_are_reused_from_step_to_step(process: str, tiny_llm_dir: Path) -> None:
    """Once the heap has settled, steps whose activations are megabytes reuse its pages: 0-9% of them faulted in
    again over 4 steps in runs here (a block now and then lands past the heap's top, as small allocations split the
    freed space), where the old 4 MiB threshold mapped every such block afresh, all of its pages. A 64 MiB block goes
    back to the system when freed. The same in a backend process and in one that runs an in-process engine."""
    argument = "backend" if process == "backend" else str(tiny_llm_dir)
    run = subprocess.run([sys.executable, "-c", STEPS, argument], capture_output=True, text=True, check=True)
    out = run.stdout.split()
    faults, pages, returned = int(out[0]), int(out[1]), float(out[2])
    assert faults < pages / 2, (faults, pages)
    assert returned > 60
