"""Our Llama-family model over the paged cache gives the logits of Hugging Face transformers' own implementation."""

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import pytest
import safetensors.torch
import torch
import transformers
from conftest import compute_as_served

from spindle.backend.models import CheckpointConfig, LlamaForCausalLM, load_model, resolve_dtype, resolve_model
from spindle.backend.models.loader import (
    QUANTIZATION_FILE,
    embedded_gguf,
    gguf_read_once,
    quantized_weights,
    resolve_quantization,
)
from spindle.kernels import AttentionMetadata, cpu, eager
from spindle.kernels.linear import MAX_QUANTIZED_TOKENS, weight_only

BLOCK_SIZE = 8
PROMPT_LENS = (13, 21, 6)

# A schedule is a list of steps; a step feeds (sequence, number of its next tokens) for some sequences.
# Every schedule feeds every token of every prompt exactly once.
SCHEDULES = {
    "one_batch": [[(0, 13), (1, 21), (2, 6)]],
    "two_chunks": [[(0, 5), (1, 16)], [(0, 8), (1, 5), (2, 6)]],
    "decode": [[(0, 10), (1, 18), (2, 3)]] + [[(0, 1), (1, 1), (2, 1)]] * 3,
    "mixed": [[(0, 11), (1, 20)], [(0, 1), (1, 1), (2, 4)], [(0, 1), (2, 2)]],
}


class PagedRunner:
    """Feeds token chunks of several sequences through the model, the way the engine will: one flat batch a step."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64) -> None:
        config = model.config
        dtype = model.embed_tokens.dtype
        self.model = model
        # Finite garbage, not zeros: padding and unwritten slots are read and must be masked out.
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.randn(shape, dtype=dtype) * 100, torch.randn(shape, dtype=dtype) * 100)
            for _ in range(config.num_layers)
        ]
        # Shuffled so that every sequence's blocks are scattered over the cache.
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, prompts: list[list[int]], chunks: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Run one step; returns the logits of each chunk's tokens, in the order of ``chunks``."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i][1] != 1)  # decodes first
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for i in order:
            seq, n = chunks[i]
            start = self.num_computed.get(seq, 0)
            table = self.block_tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + n:
                table.append(self.free_blocks.pop())
            input_ids += prompts[seq][start : start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            self.num_computed[seq] = start + n
        meta = AttentionMetadata.from_lists(query_lens, seq_lens, tables, BLOCK_SIZE)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), meta, self.kv_caches)
            logits = self.model.compute_logits(hidden)
        by_chunk = dict(zip(order, logits.split(query_lens), strict=True))
        return [by_chunk[i] for i in range(len(chunks))]


def run_schedule(model: LlamaForCausalLM, prompts: list[list[int]], schedule: list[list[tuple[int, int]]]):
    """Feed the prompts as the schedule says; returns each prompt's logits ``[len, vocab]`` over all its tokens."""
    runner = PagedRunner(model)
    logits: dict[int, list[torch.Tensor]] = {seq: [] for seq in range(len(prompts))}
    for chunks in schedule:
        for (seq, _), chunk_logits in zip(chunks, runner.step(prompts, chunks), strict=True):
            logits[seq].append(chunk_logits)
    return [torch.cat(logits[seq]) for seq in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def hf_logits(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits from transformers' model, run alone and whole."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0].float() for p in prompts]


@pytest.fixture(
    scope="module",
    params=["llama", "llama3_tied", "qwen2", "llama_yarn", "qwen3", "phi3", "phi4_mini", "gemma2", "gemma3"],
)
def tiny_pair(request: pytest.FixtureRequest, make_tiny_model: Callable[[str], Path], prompts: list[list[int]]):
    """(our fp32 model, transformers' logits of each prompt) for one tiny variant."""
    model_dir = make_tiny_model(request.param)
    return load_model(model_dir, torch.float32, torch.device("cpu")), hf_logits(model_dir, prompts)


@pytest.mark.parametrize("path", ["kernels", "eager"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_logits_match_transformers(
    schedule: str, path: str, tiny_pair: tuple[LlamaForCausalLM, list[torch.Tensor]], prompts: list[list[int]]
) -> None:
    """On the C++ kernels and on the torch references (``--enforce-eager``)."""
    model, reference = tiny_pair
    steps = SCHEDULES[schedule]
    assert [sum(n for s, n in sum(steps, []) if s == seq) for seq in range(len(prompts))] == list(PROMPT_LENS)
    with eager(path == "eager"):
        logits = run_schedule(model, prompts, steps)
    for ours, theirs in zip(logits, reference, strict=True):
        # Measured max |diff| 2e-6 (logits have std ~0.85): only summation order differs.
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_config_reads_both_transformers_layouts(make_tiny_model: Callable[[str], Path]) -> None:
    model_dir = make_tiny_model("llama3_tied")
    v5 = json.loads((model_dir / "config.json").read_text())
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = v5["rope_parameters"]["rope_theta"]
    v4["rope_scaling"] = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
    generation = {"eos_token_id": [2, 7]}
    assert CheckpointConfig.from_dict(v4, generation) == CheckpointConfig.from_dict(v5, generation)
    config = CheckpointConfig.from_dict(v5, generation)
    assert (config.eos_token_ids, config.rope_theta, config.rope_scaling["rope_type"]) == ([2, 7], 10000.0, "llama3")
    assert (config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (2, 16, True)
    with pytest.raises(ValueError, match="unsupported architecture"):
        CheckpointConfig.from_dict({**v5, "architectures": ["GPT2LMHeadModel"]})


def test_resolve_model_rejects_what_it_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_resolve_dtype(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("float32", "cuda") == torch.float32
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": True})
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16  # measured faster with bench/dtype.py
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False})
    assert resolve_dtype("auto", "cpu") == torch.float32
    fp16_checkpoint = dataclasses.replace(CheckpointConfig.from_dir(tiny_llama_dir), dtype="float16")
    assert resolve_dtype("auto", "cuda", fp16_checkpoint) == torch.float16
    with pytest.raises(ValueError, match="not one of"):
        resolve_dtype("int8", "cpu")


def test_load_weights_refuses_incomplete_or_foreign_checkpoints(tiny_llama_dir: Path) -> None:
    weights = safetensors.torch.load_file(tiny_llama_dir / "model.safetensors")
    model = LlamaForCausalLM(CheckpointConfig.from_dir(tiny_llama_dir), torch.float32)
    with pytest.raises(ValueError, match=r"unloaded.*layers\.1\.self_attn\.qkv_proj"):
        model.load_weights((k, v) for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="extra"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])


@dataclasses.dataclass
class Converted:
    """The embedded GGUF converted into a fresh cache: where, how often ``gguf`` parsed the file, the cache hit's s."""

    model_dir: Path
    parses: int
    second_resolve_s: float


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Converted]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPINDLE_CACHE_DIR", str(tmp_path_factory.mktemp("spindle-cache")))
        parses = []
        parse = gguf.GGUFReader.__init__

        def counted_parse(self: gguf.GGUFReader, *args: object, **kwargs: object) -> None:
            parses.append(args)
            parse(self, *args, **kwargs)

        patch.setattr(gguf.GGUFReader, "__init__", counted_parse)
        model_dir = resolve_model(None)
        start = time.perf_counter()
        assert resolve_model(None) == model_dir
        yield Converted(model_dir, len(parses), time.perf_counter() - start)


@pytest.mark.slow
def test_smollm2_gguf_conversion(smollm2: Converted) -> None:
    model_dir = smollm2.model_dir
    assert smollm2.second_resolve_s < 5
    # transformers reads the file for the config, the tensors and the tokenizer, we for its quantized blocks: one
    # parse serves them all (a parse of the 49,152-token vocabulary takes seconds).
    assert smollm2.parses == 1
    config = CheckpointConfig.from_dir(model_dir)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.tie_word_embeddings, config.eos_token_ids) == (49152, True, [2])
    assert "<|im_start|>" in json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert {"generation_config.json", "tokenizer.json", "model.safetensors"} <= {p.name for p in model_dir.iterdir()}
    # The file's Q4_1 projections and Q8_0 embedding are kept (checked against transformers' copy while converting).
    assert json.loads((model_dir / QUANTIZATION_FILE).read_text()) == {"gguf_type": "Q4_1", "bits": 4}
    assert resolve_quantization("auto", model_dir) == 4
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
    weights = quantized_weights(model, model_dir, 4)
    assert (weights["layers.0.gate_up_proj"].bits, weights["layers.0.gate_up_proj"].group_size) == (4, 32)
    assert (weights["lm_head"].bits, weights["lm_head"].group_size) == (8, 32)  # the tied embedding's Q8_0 blocks
    assert quantized_weights(model, model_dir, 8)["layers.0.down_proj"].group_size == 1536  # int8 at load, per row


@pytest.fixture(scope="module")
def smollm2_reference(smollm2: Converted) -> tuple[int, list[int], torch.Tensor]:
    """transformers' fp32 model on the same GGUF: (prompt length, prompt + 8 greedy tokens, logits at every token)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2.model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    file = embedded_gguf()
    with gguf_read_once(file):
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=torch.float32
        ).eval()
    with torch.inference_mode():
        tokens = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        return len(prompt), tokens, reference(torch.tensor([tokens])).logits[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "bits"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 4), (torch.bfloat16, 8)],
    ids=["fp32", "bf16", "bf16-int4", "bf16-int8"],
)
def test_smollm2_matches_transformers_on_the_gguf(
    dtype: torch.dtype,
    bits: int | None,
    smollm2: Converted,
    smollm2_reference: tuple[int, list[int], torch.Tensor],
) -> None:
    """Unquantized, and int4 from the file's own blocks (the weights transformers dequantizes) or int8 requantized.

    The decode steps (one token) run the weight-only kernels; the prompt's prefill the panel kernel (no dense copy).
    """
    prompt_len, tokens, reference = smollm2_reference
    model = load_model(smollm2.model_dir, dtype, torch.device("cpu"))
    if bits:
        model.prepare_weights(quantized_weights(model, smollm2.model_dir, bits))
    # The prompt in one prefill, then the greedy tokens one decode step each.
    ours = run_schedule(model, [tokens], [[(0, prompt_len)]] + [[(0, 1)]] * (len(tokens) - prompt_len))[0]
    generated = slice(prompt_len - 1, len(tokens) - 1)
    if dtype == torch.float32:
        # Measured max |diff| 7e-5 (logits span about +-30): only summation order differs.
        torch.testing.assert_close(ours, reference, atol=5e-4, rtol=1e-4)
        assert ours[generated].argmax(-1).tolist() == tokens[prompt_len:]
    else:
        # bf16 moves logits by up to ~1.5 (measured), so only clear winners must agree: every greedy token whose
        # fp32 lead over the runner-up is above 1, and most positions overall (measured 98%).
        top2 = reference[generated].topk(2).values
        clear = (top2[:, 0] - top2[:, 1] > 1).tolist()
        chosen = ours[generated].argmax(-1).tolist()
        assert [c for c, keep in zip(chosen, clear, strict=True) if keep] == [
            t for t, keep in zip(tokens[prompt_len:], clear, strict=True) if keep
        ]
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["llama", "llama3_tied"])
def test_prepared_weights_give_the_same_logits(
    variant: str, dtype: torch.dtype, make_tiny_model: Callable[[str], Path], prompts: list[list[int]]
) -> None:
    """Prepared projections (the CPU serving path) compute what plain F.linear does.

    bf16 runs our kernel on a CPU with AVX-512 bf16 (another summation order than oneDNN's: to bf16 rounding), else
    oneDNN's packed matmul (exactly: F.linear runs the same kernel); float32 oneDNN's packed matmul (to rounding,
    against MKL's).
    """
    tiled = dtype == torch.bfloat16 and cpu.bf16_linear_supported()
    packed_by_onednn = not tiled and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not (tiled or packed_by_onednn):
        pytest.skip("no prepared form of bf16 weights on this CPU: both paths run F.linear")
    model_dir = make_tiny_model(variant)
    plain = load_model(model_dir, dtype, torch.device("cpu"))
    prepared = load_model(model_dir, dtype, torch.device("cpu"))
    prepared.prepare_weights()
    projections = [prepared.prepared["lm_head"], *prepared.layers[0].prepared.values()]
    assert not plain.prepared
    assert all((p.tiled is not None, p.packed is not None) == (tiled, packed_by_onednn) for p in projections)

    expected = run_schedule(plain, prompts, SCHEDULES["mixed"])
    for want, got in zip(expected, run_schedule(prepared, prompts, SCHEDULES["mixed"]), strict=True):
        if tiled:
            # Another summation order, rounded to bf16 after every projection: a logit may land a rounding or two
            # away, each a bf16 ulp (8 significant bits) at the logits' largest magnitude. Measured: 1 ulp (0.015625
            # at a largest logit of 3.1, on a Xeon with AMX); 0.5% of the largest logit had allowed 0.99 of it.
            ulp = 2.0 ** (math.floor(math.log2(float(want.abs().max()))) - 7)
            torch.testing.assert_close(got, want, atol=2 * ulp, rtol=0)
        elif dtype == torch.bfloat16:
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "phi3"])
def test_quantized_projections_compute_their_dequantized_weights(
    variant: str,
    bits: int,
    make_tiny_model: Callable[[str], Path],
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every call on the quantized kernels, the model's logits are those of its dequantized weights run dense.

    The activations stay float (weight_only): quantized, a value at a rounding boundary moves a level on a float32
    rounding difference between the schedules' attention orders, and the logits by ~1e-2; those kernels are checked
    against their references in test_kernels_cpu, and the default's greedy tokens in test_model_families.
    """
    for key in MAX_QUANTIZED_TOKENS:  # (dtype, bits): the lm head is int8 under int4 too
        monkeypatch.setitem(MAX_QUANTIZED_TOKENS, key, 10**9)
    model_dir = make_tiny_model(variant)
    quantized_model = load_model(model_dir, torch.float32, torch.device("cpu"))
    weights = quantized_weights(quantized_model, model_dir, bits)
    with weight_only():
        quantized_model.prepare_weights(weights)
    reference = load_model(model_dir, torch.float32, torch.device("cpu"))
    compute_as_served(reference, quantized_model, weights)
    assert weights["lm_head"].bits == 8 and weights["layers.0.down_proj"].bits == bits

    expected = run_schedule(reference, prompts, SCHEDULES["mixed"])
    for want, got in zip(expected, run_schedule(quantized_model, prompts, SCHEDULES["mixed"]), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_resolve_quantization(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert resolve_quantization("auto", tiny_llama_dir) is None
    assert (resolve_quantization("none", tiny_llama_dir), resolve_quantization("int4", tiny_llama_dir)) == (None, 4)
    (tmp_path / QUANTIZATION_FILE).write_text(json.dumps({"gguf_type": "Q8_0", "bits": 8}))
    assert resolve_quantization("auto", tmp_path) == 8
    with pytest.raises(ValueError, match="quantization 'fp8'"):
        resolve_quantization("fp8", tmp_path)
