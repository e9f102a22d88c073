"""The engine on a CUDA GPU (Triton kernels, decode CUDA graphs) against the same engine on the CPU (torch kernels).

Skipped without CUDA. Run: ``.venv/bin/python -m pytest tests/gpu tests/test_kernels_triton.py`` (the second file
then runs the kernel grid compiled on the GPU). Both sides run in float32, where the only differences are
summation orders, so the greedy tokens must be identical and the log-probabilities close; bfloat16 on the GPU is
checked against float32 on the CPU with teacher forcing (prompt log-probabilities), so that one near-tie cannot make
the two runs part ways.
"""

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from spindle.backend.engine_core import EngineCore
from spindle.kernels.linear import MAX_QUANTIZED_TOKENS
from spindle.shared import SamplingParams, TokenLogprobs
from spindle.shared.config import EngineConfig
from spindle.shared.protocol import EngineRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

Outputs = dict[str, tuple[list[TokenLogprobs], list[TokenLogprobs]]]
"""Per request: (generated-token log-probabilities, prompt log-probabilities)."""


def run(config: EngineConfig, prompts: list[list[int]], params: Callable[[int], SamplingParams]) -> Outputs:
    """Generate every prompt to the end; with ``enforce_eager`` the GPU decodes without CUDA graphs."""
    core = EngineCore(config)
    if config.model.device == "cuda":
        assert (core.runner.decode_graphs is None) == config.model.enforce_eager
    return run_on(core, prompts, params)


def run_on(core: EngineCore, prompts: list[list[int]], params: Callable[[int], SamplingParams]) -> Outputs:
    """Generate every prompt to the end on a started engine."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(str(i), prompt, params(i), arrival_time=0.0))
    generated: dict[str, list[TokenLogprobs]] = {str(i): [] for i in range(len(prompts))}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            generated[delta.request_id] += delta.new_logprobs or []
            if delta.prompt_logprobs is not None:
                prompt_logprobs[delta.request_id] = delta.prompt_logprobs
    return {key: (generated[key], prompt_logprobs.get(key, [])) for key in generated}


def assert_same_generation(gpu: Outputs, cpu: Outputs, atol: float) -> None:
    for (gpu_tokens, _), (cpu_tokens, _) in zip(gpu.values(), cpu.values(), strict=True):
        assert [t.token_ids[0] for t in gpu_tokens] == [t.token_ids[0] for t in cpu_tokens]
        torch.testing.assert_close(
            torch.tensor([t.logprobs for t in gpu_tokens]),
            torch.tensor([t.logprobs for t in cpu_tokens]),
            atol=atol,
            rtol=0,
        )


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    # Long enough to need several 64-key tiles and, at block size 16, to cross many blocks.
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (3, 17, 64, 150, 301, 9, 40)]


def tiny_params(i: int) -> SamplingParams:
    # Different lengths shrink the decode batch through sizes that are not captured (7, 6, 5, 3): padding.
    return SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("eager", [False, True], ids=["decode_graphs", "eager"])
def test_tiny_llama_gpu_matches_cpu(eager: bool, tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> None:
    common = dict(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
    cpu = run(EngineConfig.of(device="cpu", kv_cache_memory="16MiB", **common), tiny_prompts, tiny_params)

    gpu_config = EngineConfig.of(device="cuda", gpu_memory_utilization=0.3, enforce_eager=eager, **common)
    gpu = run(gpu_config, tiny_prompts, tiny_params)

    assert_same_generation(gpu, cpu, atol=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tiny_llama_quantized_and_speculating_gpu_matches_cpu(
    quantization: str, tiny_llama_dir: Path, tiny_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton quantized GEMM (every call on the GPU) and speculative steps give the CPU's greedy tokens.

    The CPU runs its quantized kernels for every call too, not only for small batches, so both use the same weights.
    """
    for key in MAX_QUANTIZED_TOKENS:
        monkeypatch.setitem(MAX_QUANTIZED_TOKENS, key, 10**9)
    common = dict(
        model=str(tiny_llama_dir), dtype="float32", quantization=quantization, max_num_batched_tokens=64, max_num_seqs=8
    )

    def params(i: int) -> SamplingParams:
        return msgspec.structs.replace(tiny_params(i), num_speculative_tokens=3)

    cpu = run(EngineConfig.of(device="cpu", kv_cache_memory="16MiB", **common), tiny_prompts, params)

    gpu = run(EngineConfig.of(device="cuda", gpu_memory_utilization=0.3, **common), tiny_prompts, params)

    assert_same_generation(gpu, cpu, atol=1e-4)


def test_prefix_hits_and_preemption_match_cpu(
    tiny_llama_dir: Path, tiny_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache of 32 blocks for 7 sequences of 138 tokens sharing a 48-token prefix: hits, preemptions, same tokens.

    The GPU's budget is pinned to the CPU's cache size, so both schedule (and preempt) the same way.
    """
    # 32 blocks (one max_model_len sequence) of the tiny model: 2 layers x 2 KV heads x 16 x 16 tokens x fp32, K and V
    cache_bytes = 32 * 8192
    monkeypatch.setattr("spindle.backend.model_runner.kv_cache_budget", lambda *_: cache_bytes)
    prefix = tiny_prompts[3][:48]
    prompts = [prefix + prompt[:10] for prompt in tiny_prompts]
    common = dict(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
    cores = {
        "cpu": EngineCore(EngineConfig.of(device="cpu", kv_cache_memory=cache_bytes, **common)),
        "cuda": EngineCore(EngineConfig.of(device="cuda", **common)),
    }
    hits: dict[str, list[int]] = {device: [] for device in cores}
    for device, core in cores.items():
        match = core.block_manager.match_prefix
        monkeypatch.setattr(core.block_manager, "match_prefix", lambda seq, d=device, m=match: _noted(hits[d], m(seq)))
    params = msgspec.structs.replace(tiny_params(0), max_tokens=80)
    outputs = {device: run_on(core, prompts, lambda _: params) for device, core in cores.items()}

    assert hits["cuda"] == hits["cpu"] and max(hits["cuda"]) >= 48
    for core in cores.values():
        assert core.num_blocks == 32 and core.stats().num_preemptions > 0
        assert core.block_manager.num_free_blocks == 32
    assert_same_generation(outputs["cuda"], outputs["cpu"], atol=1e-4)


def _noted(values: list[int], value: int) -> int:
    values.append(value)
    return value


def sampled(i: int) -> SamplingParams:
    """Seeded sampling through every stage: temperature, top-k, the three penalties and a logit bias."""
    return SamplingParams(
        temperature=0.8,
        top_k=20,
        seed=i,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={5: 3.0},
        max_tokens=24,
        ignore_eos=True,
        logprobs=2,
    )


@pytest.mark.parametrize("variant", ["llama_h128_g4", "llama_h128_g8"])
def test_big_heads_long_contexts_high_blocks_and_sampling_match_cpu(
    variant: str, make_tiny_model: Callable[[str], Path]
) -> None:
    """Head size 128 with GQA 4 and 8, contexts past 2k tokens (several decode splits), the cache's highest block
    ids, prompts sharing a 2,048-token prefix (prefix-cache hits for those admitted after the first), and seeded
    sampling with penalties and a bias: the GPU samples the CPU's tokens."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 256, (2048,), generator=generator).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 60, 300)]
    prompts.append(torch.randint(3, 256, (2500,), generator=generator).tolist())
    common = dict(model=str(make_tiny_model(variant)), dtype="float32", max_model_len=4096, max_num_batched_tokens=512)
    cpu = run(EngineConfig.of(device="cpu", kv_cache_memory="256MiB", **common), prompts, sampled)

    core = EngineCore(EngineConfig.of(device="cuda", gpu_memory_utilization=0.3, **common))
    # The free list reversed: every sequence lives in the highest block ids (offsets past 2**31 elements, if the
    # cache is that large).
    core.block_manager.free = OrderedDict.fromkeys(reversed(range(core.num_blocks)))
    gpu = run_on(core, prompts, sampled)

    assert_same_generation(gpu, cpu, atol=1e-3)


def test_bf16_decode_graphs_over_many_steps_match_eager(tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> None:
    """bf16 decodes replayed from CUDA graphs for 200 steps follow the eager GPU run token for token, but where the
    two runs' top two tokens were within 0.05 nats (the graphs split the context by max_model_len, eager by the
    step's longest context: the sums' order differs)."""
    common = dict(model=str(tiny_llama_dir), dtype="bfloat16", max_num_seqs=8, gpu_memory_utilization=0.3)

    def params(_: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logprobs=2)

    graphs = run(EngineConfig.of(device="cuda", **common), tiny_prompts, params)
    eager = run(EngineConfig.of(device="cuda", enforce_eager=True, **common), tiny_prompts, params)

    for (replayed, _), (plain, _) in zip(graphs.values(), eager.values(), strict=True):
        assert len(replayed) == len(plain) == 200
        for a, b in zip(replayed, plain, strict=True):
            if a.token_ids[0] != b.token_ids[0]:
                assert b.logprobs[1] - b.logprobs[2] < 0.05 or b.logprobs[0] - b.logprobs[1] < 0.05
                break


def test_no_triton_compile_after_start_up(
    make_tiny_model: Callable[[str], Path], tiny_prompts: list[list[int]]
) -> None:
    """The start-up warm-up compiled every variant a varied workload needs: no request waits on Triton's compiler."""
    import triton

    model = str(make_tiny_model("llama_h128_g4"))
    config = EngineConfig.of(model=model, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=64)
    core = EngineCore(config)
    compiled: list[str] = []

    def count(*, fn: object, **_: object) -> bool:
        compiled.append(fn.name)  # type: ignore[attr-defined]
        return False  # compile as usual

    triton.knobs.runtime.jit_cache_hook = count
    try:
        run_on(core, tiny_prompts, tiny_params)
        run_on(core, [p * 10 for p in tiny_prompts], sampled)  # contexts up to 3,010 tokens: more decode splits
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert not compiled, compiled


CHAT_PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Write a haiku about the sea, the wind and the gulls that follow the fishing boats home at dusk.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Explain in one sentence why the sky is blue during the day and red at sunset.",
]


@pytest.fixture(scope="module")
def smollm2_prompts() -> list[list[int]]:
    from spindle.backend.models.loader import resolve_model
    from spindle.frontend.processing.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model(None))
    return [tokenizer.encode(text) for text in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def smollm2_cpu(smollm2_prompts: list[list[int]]) -> Outputs:
    # Unquantized: the CPU runs a prompt's chunks on the dense weights, the GPU everything on the quantized ones.
    config = EngineConfig.of(
        dtype="float32", device="cpu", quantization="none", kv_cache_memory="256MiB", max_model_len=512
    )
    return run(config, smollm2_prompts, lambda _: SamplingParams(temperature=0, max_tokens=32, logprobs=3))


def test_smollm2_gpu_matches_cpu(smollm2_prompts: list[list[int]], smollm2_cpu: Outputs) -> None:
    config = EngineConfig.of(
        dtype="float32", device="cuda", quantization="none", max_model_len=512, gpu_memory_utilization=0.3
    )

    gpu = run(config, smollm2_prompts, lambda _: SamplingParams(temperature=0, max_tokens=32, logprobs=3))

    assert_same_generation(gpu, smollm2_cpu, atol=1e-3)


def test_smollm2_bf16_gpu_prompt_logprobs_near_fp32_cpu(smollm2_prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cpu_config = EngineConfig.of(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory="256MiB")
    cpu = run(cpu_config, smollm2_prompts, lambda _: params)

    gpu = run(EngineConfig.of(dtype="bfloat16", device="cuda", max_model_len=512), smollm2_prompts, lambda _: params)

    diffs = torch.tensor(
        [g.logprobs[0] - c.logprobs[0] for key in cpu for g, c in zip(gpu[key][1], cpu[key][1], strict=True)]
    ).abs()
    # On the CPU, bf16 against fp32 measured a mean of 0.04 nats and a max of 0.27 on these prompts; a broken kernel
    # is off by whole nats.
    assert diffs.numel() == sum(len(p) - 1 for p in smollm2_prompts)
    assert diffs.mean() < 0.15 and diffs.max() < 1.0, f"mean {diffs.mean():.3f}, max {diffs.max():.3f}"


def test_two_engines_share_one_device(tiny_llama_dir: Path) -> None:
    """A second engine at 0.3 beside a first at 0.3 gets a cache of the same size: its budget counts its own use."""
    config = EngineConfig.of(model=str(tiny_llama_dir), device="cuda", gpu_memory_utilization=0.3)
    first = EngineCore(config)
    second = EngineCore(config)
    assert first.num_blocks > 0
    assert abs(second.num_blocks - first.num_blocks) <= 0.05 * first.num_blocks


def test_kv_cache_and_graphs_stay_within_gpu_memory_utilization(tiny_llama_dir: Path) -> None:
    utilization = 0.2
    free, total = torch.cuda.mem_get_info()
    budget = utilization * total - (total - free)  # what is left to us once the CUDA context and others are counted
    config = EngineConfig.of(model=str(tiny_llama_dir), device="cuda", gpu_memory_utilization=utilization)

    core = EngineCore(config)

    assert core.runner.decode_graphs is not None and core.runner.decode_graphs.max_batch == 256
    # The tiny model's weights and activations are a few MiB, so the cache takes nearly all of the budget; the
    # cache, the graphs' pool and all else this process's allocator holds stay under the utilization (the margin
    # left is the CUDA context, which the budget counted and the allocator does not hold).
    assert 0.8 * budget <= core.num_blocks * core.runner.block_bytes
    assert torch.cuda.memory_reserved() <= utilization * total
