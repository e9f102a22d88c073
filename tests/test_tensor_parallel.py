"""Tensor parallelism over gloo on this CPU: outputs equal one rank's, what does not fit is refused, and a dead worker
is a dead engine."""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import psutil
import pytest
import torch
from test_process_split import settled_stats
from waiting import SLACK, wait_until_async

from spindle import LLM, ModelRegistry, SamplingParams
from spindle.backend import parallel
from spindle.backend.models.llama import LlamaForCausalLM
from spindle.backend.models.loader import load_model, quantized_weights, resolve_model
from spindle.backend.parallel import TensorParallel
from spindle.backend.worker import Workers
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import EngineDeadError
from spindle.kernels.linear import FLOAT_ACTIVATIONS
from spindle.kernels.quant import dequantize

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Drafts add rows per sequence to sample, and prompt log-probabilities rows beside them: the one LM head call per step.
PARAMS = [
    GREEDY,
    msgspec.structs.replace(GREEDY, num_speculative_tokens=3),
    msgspec.structs.replace(GREEDY, prompt_logprobs=2),
]
BLOCKS = 12  # KV blocks of 16 tokens for the tiny model: two 128-token sequences' worth, so the batch preempts


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[None]:
    """Give later tests back torch's threads: rank 0 of an in-process engine sets the process's to its share."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_prompts() -> list[dict]:
    """Six prompts of 5 to 45 tokens: with 16-token steps the long ones are prefilled in chunks."""
    return [{"prompt_token_ids": [3 + (11 * i + 5 * j) % 250 for j in range(5 + 8 * i)]} for i in range(6)]


def tiny_args(tensor_parallel_size: int) -> dict:
    """The tiny model's engine with :data:`BLOCKS` blocks on every rank and 16-token steps."""
    kv_heads = max(1, 2 // tensor_parallel_size)
    block_bytes = 2 * 2 * kv_heads * 16 * 16 * 4  # K and V x layers x the rank's KV heads x head size x block x fp32
    return dict(
        dtype="float32",
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_memory=BLOCKS * block_bytes,
        max_model_len=128,
        max_num_batched_tokens=16,
    )


def two_node_args(tensor_parallel_size: int) -> dict:
    """:func:`tiny_args` with the ranks over two nodes: node 1 is a ``spindle backend --node-rank 1`` process."""
    args = tiny_args(tensor_parallel_size)
    if tensor_parallel_size == 1:
        return args
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {**args, "nnodes": 2, "master_addr": "127.0.0.1", "master_port": port}


def smollm2_prompts() -> list[str]:
    """A few raw prompts for the embedded SmolLM2."""
    return ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away, there lived"]


def smollm2_args(tensor_parallel_size: int) -> dict:
    """SmolLM2 as served by default (Q4_1 as int4 under ``quantization="auto"``), with chunked prefill, in float32.

    Not ``dtype="auto"``: where that is bf16 (an AVX-512 bf16 CPU), the ranks' narrower GEMMs round their bf16
    outputs differently from one rank's, enough to flip a greedy near-tie within 24 tokens (seen on such a CPU, with
    and without its bf16 kernels); float32's rounding is 65,536 times finer.
    """
    return dict(
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_memory="32MiB",
        max_model_len=256,
        max_num_batched_tokens=16,
        dtype="float32",
    )


@dataclass
class Served:
    """What an engine made of the prompts."""

    tokens: list[list[int]]  # greedy, under :data:`PARAMS` in turn
    prompt_logprobs: list[list[dict[int, float]]]  # of the prompts that asked (token id -> logprob, per position)
    embeddings: np.ndarray  # one pooled row per prompt
    preemptions: int


@contextlib.contextmanager
def other_nodes(model: Path | None, args: dict) -> Iterator[None]:
    """Run the ranks of nodes 1.. of ``args`` as ``spindle backend --node-rank K``; they must exit cleanly after."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in args.items()]
    if model is not None:
        flags.append(f"--model={model}")
    spindle = Path(sys.executable).parent / "spindle"
    nodes = [
        subprocess.Popen([spindle, "backend", *flags, f"--node-rank={rank}"])
        for rank in range(1, args.get("nnodes", 1))
    ]
    try:
        yield
        assert [node.wait(timeout=30) for node in nodes] == [0] * len(nodes)  # stopped by rank 0's stop header
    finally:
        for node in nodes:
            node.kill()


def serve(model: Path | None, args: dict, prompts: list) -> Served:
    """Generate and embed ``prompts`` with an in-process ``LLM`` (node 0), closed after."""
    with other_nodes(model, args):
        llm = LLM(None if model is None else str(model), **args)
        try:
            outputs = llm.generate(prompts, [PARAMS[i % len(PARAMS)] for i in range(len(prompts))], use_tqdm=False)
            embeddings = np.array([out.outputs.embedding for out in llm.embed(prompts, use_tqdm=False)])
            preemptions = llm.llm_engine.engine_core.stats().num_preemptions
        finally:
            llm.llm_engine.engine_core.close()
    return Served(
        tokens=[list(out.outputs[0].token_ids) for out in outputs],
        prompt_logprobs=[
            [{t: lp.logprob for t, lp in position.items()} for position in out.prompt_logprobs[1:]]
            for out in outputs
            if out.prompt_logprobs is not None
        ],
        embeddings=embeddings,
        preemptions=preemptions,
    )


@pytest.mark.parametrize(
    ("model", "size", "make_args", "make_prompts"),
    [
        ("tiny", 2, tiny_args, tiny_prompts),
        # 2 KV heads over 4 ranks: replicated; vocabulary 254 padded to 256; ranks 2 and 3 on a second "node".
        ("tiny", 4, two_node_args, tiny_prompts),
        pytest.param("smollm2", 3, smollm2_args, smollm2_prompts, marks=pytest.mark.slow),  # 9 query, 3 KV heads
    ],
    ids=["tiny-tp2", "tiny-tp4-two-nodes", "smollm2-tp3"],
)
def test_outputs_equal_one_rank(model, size, make_args, make_prompts, request, monkeypatch):
    """SmolLM2's int4 projections keep float activations: quantized, a value at a rounding boundary moves a level
    on the ranks' other summation order, and greedy tokens may part."""
    monkeypatch.setenv(FLOAT_ACTIVATIONS, "1")
    model_dir = request.getfixturevalue("tiny_tp_llm_dir") if model == "tiny" else None
    expected = serve(model_dir, make_args(1), make_prompts())
    served = serve(model_dir, make_args(size), make_prompts())
    assert served.tokens == expected.tokens
    # The ranks sum partial products in another order: float rounding only.
    positions = [p for seq in served.prompt_logprobs for p in seq]
    expected_positions = [p for seq in expected.prompt_logprobs for p in seq]
    assert len(positions) == len(expected_positions) > 0
    for got, want in zip(positions, expected_positions, strict=True):
        assert got == pytest.approx(want, abs=1e-3)
    np.testing.assert_allclose(served.embeddings, expected.embeddings, atol=1e-4)
    if model == "tiny":
        assert served.preemptions > 0  # the batch did not fit its cache: recomputed sequences match too


@pytest.mark.slow
def test_a_rank_keeps_the_gguf_int4_blocks_of_its_slice():
    """SmolLM2's rank 1 of 3 serves the file's own blocks, cut along whole groups, not weights quantized again."""
    model_dir = resolve_model(None)
    full = quantized_weights(load_model(model_dir, torch.float32, torch.device("cpu")), model_dir, 4)
    parallel.set_current(TensorParallel(rank=1, size=3, local_rank=1, local_size=3))
    try:
        ours = quantized_weights(load_model(model_dir, torch.float32, torch.device("cpu")), model_dir, 4)
    finally:
        parallel.destroy_group()
    # Rank 1's query heads 3-5 (rows 192-383), KV head 1 (64 rows each of k and v), MLP columns 512-1023 of 1536,
    # vocabulary rows 16384-32767; o and down take the matching input columns.
    q, k, v = range(192, 384), range(576 + 64, 576 + 128), range(576 + 192 + 64, 576 + 192 + 128)
    mlp = range(512, 1024)
    cuts = {
        "layers.0.self_attn.qkv_proj": (0, [*q, *k, *v]),
        "layers.0.self_attn.o_proj": (1, list(q)),
        "layers.0.gate_up_proj": (0, [*mlp, *(i + 1536 for i in mlp)]),
        "layers.0.down_proj": (1, list(mlp)),
        "lm_head": (0, list(range(16384, 32768))),
    }
    for name, (dim, index) in cuts.items():
        assert torch.equal(dequantize(ours[name]), dequantize(full[name]).index_select(dim, torch.tensor(index))), name


def test_a_size_that_does_not_split_the_heads_is_refused(tiny_tp_llm_dir, monkeypatch):
    # Refused before any worker starts: starting them fails the test.
    monkeypatch.setattr(Workers, "__init__", lambda *_: pytest.fail("workers started for a size that does not fit"))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not fit the model: its 8 query heads are not"):
        LLM(str(tiny_tp_llm_dir), **tiny_args(3))


class FailingWorkerLlama(LlamaForCausalLM):
    """A Llama whose ranks other than 0 cannot load their shard (registered, so the spawned workers import it)."""

    def load_weights(self, weights) -> None:
        """Fail on a worker; load as a Llama on rank 0."""
        if parallel.current().rank:
            raise OSError(f"rank {parallel.current().rank} cannot read its shard")
        super().load_weights(weights)


def test_a_worker_that_fails_to_load_fails_the_start_with_its_error(tiny_tp_llm_dir, tmp_path):
    model_dir = shutil.copytree(tiny_tp_llm_dir, tmp_path / "failing")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "architectures": ["FailingWorkerLlama"]}))
    ModelRegistry.register_model("FailingWorkerLlama", FailingWorkerLlama)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed to start: OSError: rank 1 cannot read"):
        LLM(str(model_dir), **tiny_args(2))


def test_killing_a_worker_ends_every_stream(tiny_tp_llm_dir):
    engine = AsyncLLMEngine.from_args(
        model=str(tiny_tp_llm_dir),
        dtype="float32",
        kv_cache_memory="4MiB",
        tensor_parallel_size=2,
        resume_streams=False,  # the streams end with the backend, as they do without resumption (test_resume)
    )
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def scenario():
        first = asyncio.Event()

        async def stream(i):
            async for _ in engine.generate({"prompt_token_ids": [3 + i, 4, 5]}, long, f"tp{i}"):
                first.set()

        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        await first.wait()
        backend = psutil.Process(engine.client.connection.process.pid)
        (worker,) = [p for p in backend.children() if "spawn_main" in " ".join(p.cmdline())]
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        # The backend's watcher wakes on the worker's exit and the backend exits, which its frontend sees at once.
        assert time.monotonic() - killed < SLACK

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


COLLECTIVE_TIMEOUT = 3.0  # seconds: short, so that the tests below wait several of them


async def restarted(engine: AsyncLLMEngine) -> bool:
    """Whether a new backend serves ``engine`` now, in place of the first."""
    return engine.num_backend_restarts == 1 and not engine.is_dead


async def gone(process: psutil.Process) -> bool:
    """Whether ``process`` has exited (a zombie too: whoever reaps it may not have yet)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_idle_engine_outlives_the_collective_timeout(tiny_tp_llm_dir):
    """The workers wait for the next step longer than a collective may take: rank 0's keep-alives span the idle time.

    A 15-minute idle engine with the default ``collective_timeout`` of 10 minutes, at a few seconds' scale.
    """
    llm = LLM(str(tiny_tp_llm_dir), **tiny_args(2), collective_timeout=COLLECTIVE_TIMEOUT)
    try:
        prompt = tiny_prompts()[:1]
        before = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        time.sleep(4 * COLLECTIVE_TIMEOUT)  # the idle time is what is tested, not a wait for something
        after = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.llm_engine.engine_core.close()
    assert after == before and len(after) == GREEDY.max_tokens


@pytest.mark.parametrize("busy", [True, False], ids=["streaming", "idle"])
def test_a_stopped_worker_fails_the_engine_which_is_replaced(tiny_tp_llm_dir, busy):
    """A wedged rank (SIGSTOP: alive, silent) fails the engine within ``collective_timeout``, mid-step or idle."""
    engine = AsyncLLMEngine.from_args(
        model=str(tiny_tp_llm_dir),
        dtype="float32",
        kv_cache_memory="4MiB",
        tensor_parallel_size=2,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def stream(i: int, first: asyncio.Event) -> None:
        async for _ in engine.generate({"prompt_token_ids": [3 + i, 4, 5]}, long, f"tp{i}"):
            first.set()

    async def scenario() -> int:
        first = asyncio.Event()
        tasks = [asyncio.create_task(stream(i, first)) for i in range(4 if busy else 1)]
        await first.wait()
        if not busy:  # the engine idles once the one stream is cancelled
            tasks[0].cancel()
            await settled_stats(engine)
        backend = psutil.Process(engine.client.connection.process.pid)
        (worker,) = [p for p in backend.children() if "spawn_main" in " ".join(p.cmdline())]
        os.kill(worker.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        await wait_until_async(lambda: gone(backend), "the backend exits", COLLECTIVE_TIMEOUT + SLACK)
        # Within the timeout, and the keep-alives' interval when idle, of the stop.
        assert time.monotonic() - stopped < COLLECTIVE_TIMEOUT + SLACK
        # The kernel killed the stopped worker with its parent: nothing of the old engine is left.
        await wait_until_async(lambda: gone(worker), "the stopped worker is killed")
        await wait_until_async(lambda: restarted(engine), "a new backend serves")
        for task in tasks:  # what became of the streams is not this test's business
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tokens = [output async for output in engine.generate({"prompt_token_ids": [3, 4, 5]}, GREEDY, "after")]
        return len(tokens[-1].outputs[0].token_ids)

    try:
        assert asyncio.run(scenario()) == GREEDY.max_tokens
    finally:
        engine.shutdown()
