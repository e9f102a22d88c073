"""The KV budget on a CUDA GPU: an engine created again in one process stays within its share, graphs included.

Skipped without CUDA; ``tests/test_memory.py`` drives the same calls over a fake of torch's caching allocator. The
runners are started as the engine core starts its own (``init_cache`` compiles the kernels and captures the graphs).
"""

from pathlib import Path

import pytest
import torch

from spindle.backend.model_runner import ModelRunner
from spindle.backend.models import CheckpointConfig
from spindle.shared.config import EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

UTILIZATION = 0.3
MiB = 2**20


def start(model_dir: Path) -> ModelRunner:
    """A started runner of the tiny model at :data:`UTILIZATION`, 64 decode graphs (1 to 64 sequences)."""
    config = EngineConfig.of(
        model=str(model_dir), device="cuda", gpu_memory_utilization=UTILIZATION, max_num_seqs=64, max_model_len=512
    )
    runner = ModelRunner(config, CheckpointConfig.from_dir(model_dir), model_dir)
    runner.init_cache(512)
    return runner


def test_an_engine_created_twice_stays_within_its_share(tiny_llama_dir: Path) -> None:
    """The first engine's blocks, freed into torch's cache, must not serve the second's weights and activations."""
    total = torch.cuda.mem_get_info()[1]
    first = start(tiny_llama_dir)
    blocks = first.kv_budget.blocks  # type: ignore[union-attr]
    del first

    second = start(tiny_llama_dir)

    budget = second.kv_budget
    assert budget is not None and budget.torch_peak > 0 and budget.graph_pool > 0
    assert abs(budget.blocks - blocks) <= 0.05 * blocks  # the first also counted the workspaces it created
    # What the engine holds (weights, cache, graphs) and what it lost outside torch: within its share.
    assert torch.cuda.memory_reserved() - budget.start_reserved + budget.outside_torch <= UTILIZATION * total


def test_the_budgeted_graph_pool_is_what_the_decode_graphs_hold(tiny_llama_dir: Path) -> None:
    runner = start(tiny_llama_dir)
    assert runner.decode_graphs is not None and runner.kv_budget is not None
    held = torch.cuda.memory_reserved()

    runner.decode_graphs = None  # their pool returns to the device
    torch.cuda.empty_cache()

    assert held - torch.cuda.memory_reserved() == pytest.approx(runner.kv_budget.graph_pool, abs=4 * MiB)
