"""Multi-LoRA: greedy tokens against transformers + PEFT with mixed batches, slots and eviction, refusals, the
prefix cache's isolation by adapter, unloading under load, and the batched LoRA kernels against a reference.

The adapters are PEFT's own (``get_peft_model`` + ``save_pretrained``) with every LoRA matrix drawn at random: PEFT
initialises ``lora_B`` to zeros, and such an adapter would change nothing.
"""

import json
import shutil
from collections.abc import Callable
from itertools import count, cycle
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from scheduler_harness import fake_step, make_scheduler
from transformers import AutoModelForCausalLM, AutoTokenizer

import spindle.kernels
from spindle.backend.block_manager import root_hash
from spindle.backend.engine_core import EngineCore
from spindle.backend.models.loader import resolve_model
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.backend.sequence import Sequence
from spindle.kernels import lora as lora_kernels
from spindle.kernels.linear import FLOAT_ACTIVATIONS
from spindle.kernels.lora import LoraMapping, LoraSlots
from spindle.shared import SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.errors import AlreadyExistsError, InvalidRequestError, NotFoundError
from spindle.shared.lora import LoraAdapterInfo
from spindle.shared.protocol import EngineRequest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_TOKENS = 10
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, lora_alpha, targets, extra LoraConfig): every projection at the top rank, and a smaller rank on
# some of the fused parts (q and v of qkv, no gate/up) with rsLoRA's scale.
TINY_ADAPTERS = {
    "a": (8, 16, ALL_TARGETS, {}),
    "b": (4, 8, ["q_proj", "v_proj", "down_proj"], {"use_rslora": True}),
}
PROMPT_LENGTHS = [5, 17, 9, 33, 12, 24]
_request_ids = count()


def save_random_adapter(
    base_dir: Path, out_dir: Path, rank: int, alpha: int, targets: list[str], seed: int, std: float, **config: object
) -> Path:
    """A PEFT LoRA adapter of the model in ``base_dir`` with random ``lora_A`` and ``lora_B``, saved to ``out_dir``."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **config)
    peft_model = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_model(base_dir: Path, adapters: dict[str, Path]) -> PeftModel:
    """transformers' model of ``base_dir`` with every adapter loaded (unmerged) by PEFT under its name."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    (first, first_dir), *rest = adapters.items()
    model = PeftModel.from_pretrained(base, first_dir, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    return model


def peft_greedy(model: PeftModel, ids: list[int], name: str | None) -> list[int]:
    """transformers + PEFT's greedy tokens after ``ids`` with the adapter ``name`` (None: the base model)."""
    kwargs = dict(max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    with torch.inference_mode():
        if name is None:
            with model.disable_adapter():
                out = model.generate(input_ids=torch.tensor([ids]), **kwargs)
        else:
            model.set_adapter(name)
            out = model.generate(input_ids=torch.tensor([ids]), **kwargs)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    # One that repeats itself, where prompt lookup (speculative decoding) finds drafts.
    prompts[4] = prompts[4][:4] * 3
    return prompts


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        name: save_random_adapter(tiny_llama_dir, root / name, rank, alpha, targets, seed=i, std=0.1, **extra)
        for i, (name, (rank, alpha, targets, extra)) in enumerate(TINY_ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, adapters: dict[str, Path], prompts: list[list[int]]) -> dict[str | None, list]:
    model = peft_model(tiny_llama_dir, adapters)
    tokens = {name: [peft_greedy(model, ids, name) for ids in prompts] for name in [*adapters, None]}
    # Random adapters this strong change every greedy continuation: a path that ignored them could not pass.
    assert all(tokens[name][i] != tokens[None][i] for name in adapters for i in range(len(prompts)))
    return tokens


def tiny_core(model_dir: Path, **kwargs: object) -> EngineCore:
    config = {"model": str(model_dir), "dtype": "float32", "device": "cpu", "kv_cache_memory": "4MiB", **kwargs}
    return EngineCore(EngineConfig.of(**config))


def generate(
    core: EngineCore, jobs: list[tuple[list[int], str | None]], num_speculative_tokens: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of every ``(prompt, lora_name)``, all queued at once; and each one's prefix-cache hit."""
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, num_speculative_tokens=num_speculative_tokens
    )
    ids = [f"request-{next(_request_ids)}" for _ in jobs]
    for request_id, (prompt, name) in zip(ids, jobs, strict=True):
        core.add_request(EngineRequest(request_id, prompt, params, arrival_time=0.0, lora_name=name))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    cached: dict[str, int] = {}
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
            cached.setdefault(delta.request_id, delta.num_cached_tokens)
    return [tokens[i] for i in ids], [cached[i] for i in ids]


def record_steps(core: EngineCore) -> list[set[int | None]]:
    """From now on, the adapter ids (None: the base model) of every step's sequences, one set per step."""
    steps: list[set[int | None]] = []
    runner, execute = core.runner, core.runner.execute

    def recording_execute(scheduled: SchedulerOutput) -> None:
        execute(scheduled)
        steps.append({runner.states[seq_id].lora_id for seq_id in scheduled.num_scheduled_tokens})

    runner.execute = recording_execute
    return steps


@pytest.mark.parametrize(
    ("engine_args", "speculative"),
    [(dict(), 0), (dict(max_num_batched_tokens=16), 0), (dict(adaptive_drafts=False), 4)],
    ids=["one_batch", "chunked_prefill", "ngram4"],
)
def test_a_batch_of_two_adapters_and_the_base_matches_peft(
    engine_args, speculative, tiny_llama_dir, adapters, prompts, expected
):
    """With a small token budget, prefill chunks and decodes of different adapters share steps too; with n-gram
    speculation, decodes verify drafts (several tokens a sequence) under their adapters."""
    core = tiny_core(tiny_llama_dir, lora_modules={n: str(p) for n, p in adapters.items()}, **engine_args)
    steps = record_steps(core)
    names = [name for name, _ in zip(cycle(["a", "b", None]), prompts)]

    got, _ = generate(core, list(zip(prompts, names, strict=True)), num_speculative_tokens=speculative)

    assert got == [expected[name][i] for i, name in enumerate(names)]
    ids = {core.runner.lora.lookup("a"), core.runner.lora.lookup("b")}
    assert any(step == ids | {None} for step in steps), "no step mixed both adapters and the base model"
    assert core.block_manager.num_free_blocks == core.num_blocks
    assert (core.stats().num_draft_tokens > 0) == bool(speculative)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the Triton kernels are the serving path")
def test_the_triton_path_matches_peft(tiny_llama_dir, adapters, prompts, expected):
    """The whole engine on the Triton kernels (interpreted on the CPU), one step mixing both adapters and the base."""
    core = tiny_core(tiny_llama_dir, lora_modules={n: str(p) for n, p in adapters.items()})
    steps = record_steps(core)
    names = ["a", "b", None]

    with spindle.kernels.force_triton():
        got, _ = generate(core, list(zip(prompts[:3], names, strict=True)))

    assert got == [expected[name][i] for i, name in enumerate(names)]
    assert len(steps[0]) == 3


def test_list_loras_describes_the_adapters(tiny_llama_dir, adapters):
    core = tiny_core(tiny_llama_dir, lora_modules={"b": str(adapters["b"])})
    info = core.add_lora("a", str(adapters["a"]))

    assert info == LoraAdapterInfo("a", str(adapters["a"]), 8, ALL_TARGETS)
    assert core.list_loras() == [LoraAdapterInfo("b", str(adapters["b"]), 4, ["q_proj", "v_proj", "down_proj"]), info]


def test_one_slot_serves_two_adapters_in_turn(tiny_llama_dir, adapters, prompts, expected):
    """``max_loras=1``: a sequence whose adapter has no slot waits, the base model's runs beside the adapter's."""
    core = tiny_core(tiny_llama_dir, lora_modules={n: str(p) for n, p in adapters.items()}, max_loras=1)
    steps = record_steps(core)
    rounds = [["a", "b", None, "a", "b", None], ["b", "a", "a", None, "b", "b"]]

    for names in rounds:
        got, _ = generate(core, list(zip(prompts, names, strict=True)))
        assert got == [expected[name][i] for i, name in enumerate(names)]

    assert all(len(step - {None}) <= 1 for step in steps)
    assert any(len(step) == 2 for step in steps), "the base model never ran beside an adapter"
    # a, then b; then b is still resident for the second round's first sequences, then a again.
    assert core.runner.lora.num_slot_loads == 3


def test_least_recently_used_slot_not_pinned_is_replaced(tiny_llama_dir, adapters, tmp_path):
    core = tiny_core(tiny_llama_dir, max_loras=2)
    lora = core.runner.lora
    # c is adapter a's weights scaled otherwise: a third adapter (a's own directory would be another name for a).
    c_dir = shutil.copytree(adapters["a"], tmp_path / "c")
    config = json.loads((c_dir / "adapter_config.json").read_text())
    (c_dir / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 2 * config["lora_alpha"]}))
    a, b, c = (
        lora.lookup(core.add_lora(name, str(path)).name)
        for name, path in zip("abc", [adapters["a"], adapters["b"], c_dir], strict=True)
    )

    assert lora.assign([a, None]) == [0, -1]
    assert lora.assign([b]) == [1]
    assert lora.assign([a]) == [0]  # a is now the most recently used
    assert lora.assign([c, None, c]) == [1, -1, 1]  # b was the least recently used
    assert lora.assign([b], pinned={a}) == [1]  # a is older, but running sequences need it: c leaves
    assert lora.num_slot_loads == 4
    # The slots hold the adapters' host weights and ranks, and zeros where the adapter has none (b: q and v only).
    name = "layers.1.self_attn.qkv_proj"
    qkv = core.runner.model.layers[1].self_attn.lora["qkv_proj"]
    assert torch.equal(qkv.lora_a[1], lora.adapters[b].weights[name][0])
    assert torch.equal(qkv.lora_b[0], lora.adapters[a].weights[name][1])
    assert qkv.ranks.tolist() == [[8, 8, 8], [4, 0, 4]]
    gate_up = core.runner.model.layers[0].lora["gate_up_proj"]
    assert gate_up.lora_b[0].any() and not gate_up.lora_b[1].any() and gate_up.ranks.tolist() == [[8, 8], [0, 0]]


def test_scheduler_passes_over_a_sequence_whose_adapter_has_no_slot():
    scheduler = make_scheduler(num_blocks=64, block_size=4, budget=64, max_loras=1)
    seqs = [
        Sequence(f"r{i}", 0, [5, 6, 7], SamplingParams(max_tokens=100), 0.0, lora_id=lid)
        for i, lid in enumerate([1, 2, None, 1])
    ]
    for seq in seqs:
        scheduler.add_request([seq])

    assert fake_step(scheduler).seqs == [seqs[0], seqs[2], seqs[3]] and scheduler.running_loras == {1: 2}
    assert list(scheduler.waiting) == [seqs[1]]
    scheduler.finish_sequence(seqs[0].request_id, 0)
    assert fake_step(scheduler).seqs == [seqs[2], seqs[3]]  # adapter 1 still runs in seqs[3]
    scheduler.abort_requests([seqs[3].request_id])
    assert fake_step(scheduler).seqs == [seqs[2], seqs[1]] and scheduler.running_loras == {2: 1}


def test_preemption_gives_the_adapter_slot_back():
    # 4 blocks of 4 tokens: two 5-token prompts (of different adapters: their first blocks are not shared) take two
    # each, and the decode that needs a third block preempts the other sequence, whose adapter leaves the running set.
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64, max_loras=2)
    first, second = (
        Sequence(f"r{i}", 0, [5] * 5, SamplingParams(max_tokens=100), 0.0, lora_id=i + 1) for i in range(2)
    )
    scheduler.add_request([first])
    scheduler.add_request([second])
    assert fake_step(scheduler).seqs == [first, second] and scheduler.running_loras == {1: 1, 2: 1}

    while not (step := fake_step(scheduler)).out.num_preempted:
        assert step.seqs == [first, second]

    assert step.seqs == [first] and scheduler.running_loras == {1: 1}
    scheduler.finish_sequence(first.request_id, 0)
    assert fake_step(scheduler).seqs == [second] and scheduler.running_loras == {2: 1}


def test_the_prefix_cache_is_shared_within_an_adapter_only(tiny_llama_dir, adapters, prompts, expected):
    core = tiny_core(tiny_llama_dir, lora_modules={n: str(p) for n, p in adapters.items()})
    prompt = prompts[3]  # 33 tokens: two full blocks of 16 can be cached

    def run(name: str | None) -> int:
        got, cached = generate(core, [(prompt, name)])
        assert got == [expected[name][3]]
        return cached[0]

    assert run("a") == 0
    assert run("b") == 0
    assert run(None) == 0
    assert [run("a"), run("b"), run(None)] == [32, 32, 32]


def test_root_hashes_differ_by_adapter_and_salt():
    roots = [root_hash(salt, lora_id) for salt in (None, "s") for lora_id in (None, 1, 2)]
    assert len(set(roots)) == len(roots)
    assert root_hash(None) == root_hash(None, None)


def test_remove_lora_while_a_request_runs(tiny_llama_dir, adapters, prompts, expected):
    """The running request finishes with its adapter; the name is refused, then free for other weights."""
    core = tiny_core(tiny_llama_dir, lora_modules={"a": str(adapters["a"])})
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    core.add_request(EngineRequest("running", prompts[0], params, 0.0, lora_name="a"))
    tokens = {"running": [], "new": []}
    for _ in range(3):
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    old = core.runner.lora.lookup("a")

    core.remove_lora("a")

    assert core.list_loras() == []
    with pytest.raises(NotFoundError) as refused:
        core.add_request(EngineRequest("refused", prompts[1], params, 0.0, lora_name="a"))
    assert refused.value.field == "lora_name" and "unknown LoRA adapter 'a'; loaded: none" in str(refused.value)
    core.add_lora("a", str(adapters["b"]))
    core.add_request(EngineRequest("new", prompts[1], params, 0.0, lora_name="a"))
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
    assert tokens == {"running": expected["a"][0], "new": expected["b"][1]}
    assert list(core.runner.lora.adapters) == [core.runner.lora.lookup("a")] != [old]
    with pytest.raises(NotFoundError) as unknown:
        core.remove_lora("nope")
    assert unknown.value.field == "name"


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = safetensors.torch.load_file(path / "adapter_model.safetensors")
    edit(tensors)
    safetensors.torch.save_file(tensors, path / "adapter_model.safetensors")


Q_PROJ_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _add_embedding_matrix(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = tensors[Q_PROJ_A].clone()


def _narrow_q_proj(tensors: dict[str, torch.Tensor]) -> None:
    tensors[Q_PROJ_A] = tensors[Q_PROJ_A][:, :32].contiguous()


# Each breaks a copy of adapter "a" (rank 8, every projection); the engine's max_lora_rank is 8.
REFUSALS: dict[str, tuple[Callable[[Path], None], str]] = {
    "no_directory": (lambda p: shutil.rmtree(p), "is not a directory"),
    "no_weights": (lambda p: (p / "adapter_model.safetensors").unlink(), "lacks adapter_model.safetensors"),
    "no_config": (lambda p: (p / "adapter_config.json").unlink(), "lacks adapter_config.json"),
    "rank_too_big": (lambda p: _edit_config(p, r=16), "has rank 16, above max_lora_rank=8"),
    "lm_head_target": (lambda p: _edit_config(p, target_modules=["q_proj", "lm_head"]), "targets ['lm_head']"),
    "embedding_matrix": (
        lambda p: _edit_weights(p, _add_embedding_matrix),
        "embed_tokens.lora_A.weight, which is not a LoRA matrix",
    ),
    "dora": (lambda p: _edit_config(p, use_dora=True), "sets use_dora: DoRA"),
    "shape_mismatch": (
        lambda p: _edit_weights(p, _narrow_q_proj),
        "is [8, 32], but a rank-8 adapter of this model's q_proj needs [8, 64]",
    ),
    "damaged_weights": (
        lambda p: (p / "adapter_model.safetensors").write_bytes(b"\0" * 8),
        "is not a readable safetensors file",
    ),
}


def test_unusable_adapters_are_refused_by_path(tiny_llama_dir, adapters, tmp_path):
    core = tiny_core(tiny_llama_dir, max_lora_rank=8)
    for case, (breaks, reason) in REFUSALS.items():
        path = shutil.copytree(adapters["a"], tmp_path / case)
        breaks(path)

        with pytest.raises(InvalidRequestError) as refused:
            core.add_lora(case, str(path))

        assert refused.value.field == "path" and reason in str(refused.value), case
    assert core.list_loras() == []


def test_taken_names_and_unknown_adapters_are_refused(tiny_llama_dir, adapters, prompts):
    core = tiny_core(tiny_llama_dir, lora_modules={n: str(p) for n, p in adapters.items()})
    with pytest.raises(AlreadyExistsError) as taken:
        core.add_lora("a", str(adapters["b"]))
    assert taken.value.field == "name"

    with pytest.raises(NotFoundError) as unknown:
        core.add_request(EngineRequest("r", prompts[0], SamplingParams(), 0.0, lora_name="c"))

    assert unknown.value.field == "lora_name" and "unknown LoRA adapter 'c'; loaded: a, b" in str(unknown.value)
    assert not core.has_unfinished_requests()


def test_lora_modules_that_do_not_load_stop_the_start(tiny_llama_dir, adapters):
    with pytest.raises(ValueError, match="above max_lora_rank=4"):
        tiny_core(tiny_llama_dir, lora_modules={"a": str(adapters["a"])}, max_lora_rank=4)


def test_steps_without_adapters_skip_lora(tiny_llama_dir, adapters, prompts, expected, monkeypatch):
    calls = []
    monkeypatch.setattr("spindle.backend.models.llama.add_lora", lambda *args: calls.append(args))
    core = tiny_core(tiny_llama_dir, lora_modules={"a": str(adapters["a"])})

    assert generate(core, [(prompts[0], None)])[0] == [expected[None][0]]
    assert calls == []
    generate(core, [(prompts[0], "a")])
    # 2 layers x 4 projections, in each of the request's MAX_TOKENS steps.
    assert len(calls) == 2 * 4 * MAX_TOKENS


def reference_lora(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: list[int]
) -> torch.Tensor:
    """``y`` plus each token's delta, token by token in float64 (``lora_b`` holds ``B.T``)."""
    out = y.double()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            out[t] += (x[t].double() @ lora_a[slot].double().T) @ lora_b[slot].double()
    return out


# (in_features, the parts' end columns, each slot's rank per part (rank blocks of 16, resp. 12), sequences as (slot,
# new tokens)): decodes of three slots (a fused q/k/v-like projection, full and partial ranks, untargeted parts) and
# the base, one slot's tokens in several runs; and groups that span several M tiles and token blocks (and the C++
# kernel's threads), with feature counts that are no multiple of the vector width or the tiles.
KERNEL_CASES = {
    "decodes": (
        64,
        [48, 72, 96],
        [[16, 16, 16], [5, 0, 9], [16, 3, 0], [0, 0, 0]],
        [(0, 1), (0, 1), (2, 1), (-1, 1), (1, 1), (2, 1), (2, 1), (-1, 1)],
    ),
    "mixed": (72, [24, 40], [[12, 12], [7, 12], [0, 0], [3, 1]], [(1, 1), (-1, 1), (3, 37), (1, 70), (0, 5), (-1, 9)]),
}


def random_slots(in_features: int, part_ends: list[int], ranks: list[list[int]], dtype: torch.dtype) -> LoraSlots:
    """Slots as the engine fills them: random within each slot's ranks, zeros past them and off the diagonal."""
    generator = torch.Generator().manual_seed(len(part_ends))
    parts, block = len(part_ends), 16 if len(part_ends) == 3 else 12
    lora_a = torch.zeros(len(ranks), parts * block, in_features)
    lora_b = torch.zeros(len(ranks), parts * block, part_ends[-1])
    for slot, slot_ranks in enumerate(ranks):
        for part, (rank, start, end) in enumerate(zip(slot_ranks, [0, *part_ends], part_ends, strict=False)):
            rows = slice(part * block, part * block + rank)
            lora_a[slot, rows] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            lora_b[slot, rows, start:end] = torch.randn(rank, end - start, generator=generator) / block**0.5
    return LoraSlots(lora_a.to(dtype), lora_b.to(dtype), part_ends, torch.tensor(ranks))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_add_lora_paths_match_the_reference(case: str, dtype: torch.dtype) -> None:
    """The torch reference, the C++ kernel (the CPU path) and the Triton kernels (compiled on a GPU, else under the
    interpreter) against the delta computed token by token in float64."""
    in_features, part_ends, ranks, seqs = KERNEL_CASES[case]
    generator = torch.Generator().manual_seed(len(seqs))
    num_tokens = sum(n for _, n in seqs)
    x = torch.randn(num_tokens, in_features, generator=generator).to(dtype)
    y = torch.randn(num_tokens, part_ends[-1], generator=generator).to(dtype)
    slots = random_slots(in_features, part_ends, ranks, dtype)
    token_slots = [slot for slot, n in seqs for _ in range(n)]
    expected = reference_lora(y, x, slots.lora_a, slots.lora_b, token_slots)
    unit = 1e-5 if dtype == torch.float32 else 2 * 2**-7
    base_rows = torch.tensor(token_slots) < 0

    ours = {"torch": y.clone(), "cpu": y.clone(), "triton": y.to(DEVICE)}
    cpu_mapping = LoraMapping.build(*zip(*seqs, strict=True))
    lora_kernels.add_lora(ours["torch"], x, slots, cpu_mapping)
    spindle.kernels.add_lora(ours["cpu"], x, slots, cpu_mapping)
    mapping = LoraMapping.build(*zip(*seqs, strict=True), device=DEVICE)
    device_slots = LoraSlots(slots.lora_a.to(DEVICE), slots.lora_b.to(DEVICE), part_ends, slots.ranks)
    with spindle.kernels.force_triton():
        spindle.kernels.add_lora(ours["triton"], x.to(DEVICE), device_slots, mapping)

    for path, out in ours.items():
        out = out.cpu()
        torch.testing.assert_close(out.double(), expected, atol=unit * expected.abs().max().item(), rtol=unit)
        assert torch.equal(out[base_rows], y[base_rows]), path


def test_lora_mapping_groups_tokens_by_slot():
    mapping = LoraMapping.build([2, 2, -1, 0, 2], [1, 3, 2, 4, 1])

    assert mapping.segments == [(0, 4, 2), (6, 10, 0), (10, 11, 2)]
    assert mapping.slots == [0, 2] and mapping.slot_ids.tolist() == [0, 2] and mapping.max_group == 5
    assert mapping.token_indices.tolist() == [6, 7, 8, 9, 0, 1, 2, 3, 10]
    assert mapping.group_starts.tolist() == [0, 4, 9]
    assert LoraMapping.build([-1, -1], [3, 1]) is None


@pytest.mark.slow
def test_smollm2_with_random_rank8_adapters_matches_peft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two random rank-8 adapters on all seven projections and the base model, in one batch (fp32), the quantized
    base projections' activations float as PEFT's are."""
    monkeypatch.setenv(FLOAT_ACTIVATIONS, "1")
    base_dir = resolve_model(None)
    paths = {
        name: save_random_adapter(base_dir, tmp_path / name, 8, 16, ALL_TARGETS, seed=i, std=0.05)
        for i, name in enumerate(["x", "y"])
    }
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    prompts = [tokenizer.encode(text) for text in texts]
    names = ["x", "y", None, "x"]
    model = peft_model(base_dir, paths)
    expected = [peft_greedy(model, ids, name) for ids, name in zip(prompts, names, strict=True)]
    # The adapters change the continuation: the base model's would differ.
    assert peft_greedy(model, prompts[0], None) != expected[0]
    assert peft_greedy(model, prompts[1], None) != expected[1]
    core = EngineCore(
        EngineConfig.of(
            dtype="float32",
            kv_cache_memory="256MiB",
            max_model_len=512,
            lora_modules={name: str(path) for name, path in paths.items()},
            max_lora_rank=8,
        )
    )
    steps = record_steps(core)

    got, _ = generate(core, list(zip(prompts, names, strict=True)))

    assert got == expected
    assert any(len(step) == 3 for step in steps)
