"""Every Triton kernel variant a served model launches is compiled at start-up: quantized and LoRA models.

As ``test_kernels_triton``'s check of the attention kernels, without the interpreter: launches are recorded, not
compiled or run (``compile_check.record_only``), on CPU tensors sent to Triton (``force_triton``). The model runner's
start-up warm-up is recorded, then a varied workload served by an engine core (every step eager: the decode graphs'
steps are among them); a variant only the workload launched would compile mid-request on a GPU, stalling the batch.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_lora import TINY_ADAPTERS, save_random_adapter

SERVE = """
import json, random, sys
from spindle.backend.engine_core import EngineCore
from spindle.kernels import eager, force_triton
from spindle.kernels.linear import Projection
from spindle.kernels.triton import compile_check
from spindle.shared import PoolingParams, SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.protocol import EngineRequest

sys.modules["spindle.kernels.triton.decode_attention"]._multiprocessors = lambda device: 132  # an H200's SMs
model_dir, quantization, adapters = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = EngineConfig.of(
    model=model_dir, dtype="bfloat16", device="cpu", enforce_eager=True, quantization=quantization,
    max_num_seqs=48, max_num_batched_tokens=256, kv_cache_memory="16MiB", lora_modules=adapters or None,
)
core = EngineCore(config)
embedding = core.runner.is_pooling_model
# The projections as CUDA prepares them: the quantized form alone, which the Triton kernel runs at every size.
with eager():
    for module in core.runner.model.modules():
        prepared = getattr(module, "prepared", {})
        for name, projection in prepared.items():
            if projection.quantized is not None:
                prepared[name] = Projection(None, projection.bias, projection.quantized)

warmed, served = set(), set()
compile_check.record_only(warmed)  # what the runner's start-up on CUDA runs: the profile pass, then the warm-up
with force_triton():
    core.runner._profile_run(core.max_model_len, sample=not embedding)
    core.runner._warm_up_kernels()
compile_check.record_only(served)
rng = random.Random(0)
names = [None, *adapters]
with force_triton():  # arrivals between steps: batches of 1-48 sequences, decodes beside prefill chunks
    for i in range(80):
        prompt_logprobs = 1 if i % 9 == 0 and not embedding else None
        params = SamplingParams(
            temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=True, prompt_logprobs=prompt_logprobs
        )
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 300))]
        pooling = PoolingParams() if embedding else None
        name = rng.choice(names)
        core.add_request(EngineRequest(str(i), prompt, params, arrival_time=0.0, lora_name=name, pooling=pooling))
        for _ in range(rng.randint(0, 3)):
            core.step()
    while core.has_unfinished_requests():
        core.step()
new = sorted(served - warmed)
print(len(warmed), len(served), [name for name, _ in new])
assert not new, new
"""


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("warm-up-adapters")
    return {
        name: str(save_random_adapter(tiny_llama_dir, root / name, rank, alpha, targets, seed=i, std=0.1, **extra))
        for i, (name, (rank, alpha, targets, extra)) in enumerate(TINY_ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def embedding_model_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved as transformers' ``LlamaModel``: an embedding model, without an LM head."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("warm-up-embedding")
    transformers.LlamaModel.from_pretrained(tiny_llama_dir, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("model", "quantization"),
    [("llama", "int8"), ("llama", "int4"), ("lora", "none"), ("embedding", "int8")],
    ids=["int8", "int4", "lora", "embedding_int8"],
)
def test_serving_compiles_nothing_after_warm_up(
    model: str, quantization: str, request: pytest.FixtureRequest, adapters: dict[str, str]
) -> None:
    """int8 and int4 projections (the LM head int8 in both), a LoRA model's adapter kernels, an embedding model.

    Before the warm-up ran the model at every row count, the quantized GEMM's 16- and 32-row tiles (the LM head's
    at every small decode, the layers' wherever decodes run eagerly) and the LoRA kernels' were compiled by the
    first steps that launched them. An embedding model has no LM head to warm up.
    """
    model_dir = request.getfixturevalue("embedding_model_dir" if model == "embedding" else "tiny_llama_dir")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    loras = json.dumps(adapters if model == "lora" else {})
    command = [sys.executable, "-c", SERVE, str(model_dir), quantization, loras]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
