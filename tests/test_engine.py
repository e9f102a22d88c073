"""The engine end to end on a tiny random Llama: greedy parity with transformers, chunking, preemption, aborts."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from spindle import LLM, FinishReason, LLMEngine, RequestOutputKind, SamplingParams

MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 5, 15, 16, 17, 33, 48, 70, 101]


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="session")
def expected(tiny_llm_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens per prompt; min_new_tokens masks eos exactly as our min_tokens does."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llm_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        tokens = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
        out.append(tokens[0, len(ids) :].tolist())
    return out


def tiny_engine(model_dir: Path, **kwargs) -> LLMEngine:
    return LLMEngine.from_args(**{"model": str(model_dir), "dtype": "float32", "kv_cache_memory": "4MiB", **kwargs})


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)

# block bytes of the tiny model: 2 (K, V) x 2 layers x 2 KV heads x head 16 x 16 tokens x 4 B = 8 KiB
SCENARIOS = {
    "one_batch": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(kv_cache_memory=12 * 8192, max_model_len=128),
    "no_prefix_caching_small_blocks": dict(enable_prefix_caching=False, block_size=8),
    # A step budget past the context: the start-up profile pass splits it into sequences the model can hold.
    "budget_past_the_context": dict(max_model_len=128, max_num_batched_tokens=1000),
    # The serving default's decode-latency bound (LLM turns it off), on every prompt longer than 16 tokens.
    "decode_bound": dict(max_num_batched_tokens=64, max_decode_slowdown=2.0, long_prefill_token_threshold=16),
    # torch's ops alone (the reference path): the attention over each gathered context, no C++ kernel.
    "enforce_eager": dict(enforce_eager=True, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("speculative", [0, 4], ids=["plain", "ngram4"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_matches_transformers(scenario, speculative, tiny_llm_dir, prompts, expected):
    """Also with n-gram speculation: the same tokens, and every block back once done (rejected drafts' included)."""
    # Every draft verified (not only those this machine's step times make worth it): the rollback always runs.
    args = {"dtype": "float32", "kv_cache_memory": "4MiB", "adaptive_drafts": False, **SCENARIOS[scenario]}
    llm = LLM(str(tiny_llm_dir), **args)
    params = msgspec.structs.replace(GREEDY, num_speculative_tokens=speculative)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == prompts
    core = llm.llm_engine.engine_core
    assert (core.scheduler.num_preemptions > 0) == (scenario == "preemption")
    # Under the bound the engine core times its steps: the last ones, decodes alone, give a decode unit's seconds.
    assert (core.scheduler.decode_unit_seconds is not None) == (scenario == "decode_bound")
    assert core.block_manager.num_free_blocks == core.num_blocks
    stats = core.stats()
    # The tiny model's greedy output repeats itself, so drafts are found; some are rejected.
    assert (stats.num_draft_tokens > stats.num_accepted_draft_tokens > 0) == bool(speculative)


NO_COMPILER_RUN = """
import json, sys
from spindle import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="4MiB", enforce_eager=sys.argv[2] == "eager")
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), min_tokens=int(sys.argv[3]))
outputs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[4])], params, use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


def test_enforce_eager_serves_without_a_compiler(tiny_llm_dir, prompts, expected, tmp_path):
    """A machine without a C++ compiler: the default start says how to serve anyway, and enforce_eager does."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "SPINDLE_CACHE_DIR": str(tmp_path / "cache")}

    def run(mode: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-c", NO_COMPILER_RUN, str(tiny_llm_dir), mode, str(MAX_TOKENS), json.dumps(prompts)]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)

    compiled = run("compiled")
    assert compiled.returncode != 0
    assert "Building the CPU kernels failed" in compiled.stderr and "--enforce-eager" in compiled.stderr
    eager = run("eager")
    assert eager.returncode == 0, eager.stderr
    assert json.loads(eager.stdout.splitlines()[-1]) == expected
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_abort_mid_generation_frees_every_block(tiny_llm_dir, prompts, expected):
    engine = tiny_engine(tiny_llm_dir)
    for i, ids in enumerate(prompts[:6]):
        engine.add_request(str(i), {"prompt_token_ids": ids}, GREEDY)
    for _ in range(4):
        engine.step()
    free_before = engine.engine_core.block_manager.num_free_blocks
    engine.abort_request(["1", "3"])
    engine.abort_request("no-such-request")
    assert engine.engine_core.block_manager.num_free_blocks > free_before
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["0", "2", "4", "5"]
    assert all(finished[str(i)].outputs[0].token_ids == expected[i] for i in (0, 2, 4, 5))
    assert engine.engine_core.block_manager.num_free_blocks == engine.num_kv_blocks
    engine.add_request("late", {"prompt_token_ids": prompts[3]}, GREEDY)
    engine.step()
    engine.abort_request("late")
    assert engine.engine_core.block_manager.num_free_blocks == engine.num_kv_blocks
    assert not engine.has_unfinished_requests()


def test_n_completions_share_the_prompt_blocks(tiny_llm_dir, prompts):
    engine = tiny_engine(tiny_llm_dir, block_size=16)
    prompt = prompts[-1]  # 101 tokens: 6 full blocks
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    engine.step()
    seqs = engine.engine_core.scheduler.requests["r"]
    shared = seqs[0].block_table[:6]
    assert all(seq.block_table[:6] == shared for seq in seqs)
    assert all(engine.engine_core.block_manager.blocks[b].ref_count == 3 for b in shared)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert final.num_cached_tokens == 96
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3  # seed + index: the samples differ
    assert engine.engine_core.block_manager.num_free_blocks == engine.num_kv_blocks


def test_cache_salt_isolates_the_prefix_cache(tiny_llm_dir):
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB")  # block_size 16
    prompt = {"prompt_token_ids": [random.Random(7).randrange(3, 256) for _ in range(40)]}

    def run(salt: str | None) -> tuple[int, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=4, cache_salt=salt)
        output = llm.generate(prompt, params, use_tqdm=False)[0]
        return output.num_cached_tokens, output.outputs[0].token_ids

    cached, tokens = zip(*(run(salt) for salt in ("a", "a", "b", None, None, "b")), strict=True)
    assert cached == (0, 32, 0, 0, 32, 32)  # two full blocks shared only under the same salt
    assert len(set(map(tuple, tokens))) == 1  # the salt changes what is shared, never what is generated
    core = llm.llm_engine.engine_core
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_llm_dir, prompts):
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB")
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10)
    alone = llm.generate({"prompt_token_ids": prompts[4]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = [{"prompt_token_ids": p} for p in prompts[:6]]
    params = [SamplingParams(temperature=1.0, max_tokens=10), GREEDY, SamplingParams(temperature=1.2, seed=9)] * 2
    params[4] = seeded
    mixed = llm.generate(batch, params, use_tqdm=False)
    assert mixed[4].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=10)
    assert llm.generate({"prompt_token_ids": prompts[4]}, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("asked_by", ["keywords", "output_kind"])
def test_step_streams_cumulative_delta_and_final_only_outputs(tiny_llm_dir, prompts, expected, asked_by):
    """Asked by ``add_request``'s keywords, or by vLLM's ``SamplingParams.output_kind``."""
    engine = tiny_engine(tiny_llm_dir)
    prompt = {"prompt_token_ids": prompts[2]}
    engine.add_request("cum", prompt, GREEDY)
    if asked_by == "keywords":
        engine.add_request("delta", prompt, GREEDY, delta=True)
        engine.add_request("final", prompt, GREEDY, final_only=True)
    else:
        engine.add_request("delta", prompt, msgspec.structs.replace(GREEDY, output_kind=RequestOutputKind.DELTA))
        engine.add_request("final", prompt, msgspec.structs.replace(GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"cum": [], "delta": [], "final": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert [len(o.outputs[0].token_ids) for o in seen["cum"]] == list(range(1, MAX_TOKENS + 1))
    assert sum((o.outputs[0].token_ids for o in seen["delta"]), []) == expected[2]
    assert "".join(o.outputs[0].text for o in seen["delta"]) == seen["cum"][-1].outputs[0].text
    final = seen["cum"][-1]
    assert final.finished and final.outputs[0].finish_reason == "length"
    # One output, decoded once at the end: the same tokens and text as the cumulative stream's last.
    [only] = seen["final"]
    assert only.finished and only.outputs[0].token_ids == expected[2] and only.outputs[0].text == final.outputs[0].text
    assert final.metrics.arrival_time <= final.metrics.first_token_time <= final.metrics.finished_time


def test_bad_requests_are_refused_and_lose_nothing(tiny_llm_dir, prompts):
    engine = tiny_engine(tiny_llm_dir, max_model_len=64)
    engine.add_request("ok", {"prompt_token_ids": prompts[1]}, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", {"prompt_token_ids": prompts[1]}, GREEDY)
    with pytest.raises(ValueError, match="70"):
        engine.add_request("long", {"prompt_token_ids": prompts[7]}, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", {"prompt_token_ids": [5, 300]}, GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == "ok" and len(outputs[-1].outputs[0].token_ids) == MAX_TOKENS


def test_cache_that_cannot_hold_one_sequence_is_a_clear_error(tiny_llm_dir):
    with pytest.raises(ValueError, match="max_model_len=512 sequence needs 32"):
        tiny_engine(tiny_llm_dir, kv_cache_memory=8 * 8192)


@pytest.mark.parametrize("logprobs", [None, 2])
def test_best_of_keeps_the_n_completions_of_highest_cumulative_logprob(tiny_llm, prompts, logprobs):
    """best_of=4, n=2 gives the best two of the four completions that n=4 (the same seed) gives, best first."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, logprobs=logprobs)
    prompt = {"prompt_token_ids": prompts[2]}
    all_four = tiny_llm.generate(prompt, msgspec.structs.replace(params, n=4, logprobs=0), use_tqdm=False)
    ranked = sorted(all_four[0].outputs, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in ranked}) > 1  # they differ: the choice of the best two means something
    best = tiny_llm.generate(prompt, msgspec.structs.replace(params, n=2, best_of=4), use_tqdm=False)[0].outputs
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert all((c.logprobs is None) == (logprobs is None) for c in best)


def test_best_of_streams_one_output_when_the_request_ends(tiny_llm_dir):
    engine = tiny_engine(tiny_llm_dir)
    try:
        engine.add_request(
            "r",
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=4),
            delta=True,
        )
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].outputs) == 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("delta", [False, True], ids=["final", "streamed"])
def test_detokenize_false_gives_the_same_tokens_and_no_text(tiny_llm_dir, prompts, expected, delta):
    engine = tiny_engine(tiny_llm_dir)
    try:
        engine.add_request(
            "r", {"prompt_token_ids": prompts[3]}, msgspec.structs.replace(GREEDY, detokenize=False), delta=delta
        )
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        engine.shutdown()
    tokens = [t for out in outputs for t in out.outputs[0].token_ids] if delta else outputs[-1].outputs[0].token_ids
    assert tokens == expected[3] and all(out.outputs[0].text == "" for out in outputs)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(detokenize=False, stop=["x"]), "detokenize=False is invalid: it must be True when stop strings"),
        (dict(n=3, best_of=2), "best_of=2 is invalid: it must be None or an integer >= n"),
        (dict(best_of=2, temperature=0), "best_of=2 is invalid: it must be n (or None) when decoding greedily"),
    ],
)
def test_bad_best_of_or_detokenize_is_refused(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**fields)


def test_the_engine_reports_how_cache_initialisation_sized_the_cache(tiny_llm_dir):
    """The report's arithmetic, from the checkpoint's config.json: 4 MiB of 8 KiB blocks, and it crosses the socket."""
    config = json.loads((tiny_llm_dir / "config.json").read_text())
    engine = tiny_engine(tiny_llm_dir, max_model_len=100)
    try:
        report = engine.kv_cache_report
        kv_heads, head_dim = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
        block_bytes = 2 * config["num_hidden_layers"] * kv_heads * head_dim * 16 * 4
        assert (report.num_layers, report.num_kv_heads, report.head_dim) == (2, kv_heads, head_dim)
        assert (report.device, report.dtype, report.block_size, report.element_bytes) == ("cpu", "float32", 16, 4)
        assert report.block_bytes == block_bytes == 8192 and report.budget_bytes == 4 * 2**20
        assert report.num_blocks == engine.num_kv_blocks == 512 and report.num_tokens == 512 * 16
        assert report.full_sequences == 512 / 7 and report.device_terms == {}  # 100 tokens take 7 blocks
        assert report.explain().splitlines()[1:] == [
            "block_bytes = 2 (K, V) x 2 layers x 2 KV heads x 16 head_dim x 16 tokens x 4 bytes = 8,192",
            "budget = kv_cache_memory = 4,194,304 bytes",
            "num_blocks = 4,194,304 // 8,192 = 512",
            "max_model_len=100 takes 7 blocks: 73.1 such sequences fit at once",
        ]
        info = engine.client.info
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=type(info)).kv_cache == report
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def tiny_llm(tiny_llm_dir: Path) -> LLM:
    return LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB")


def test_generate_accepts_every_prompt_form_and_keeps_input_order(tiny_llm, prompts, expected):
    text = "hello there"
    text_ids = tiny_llm.get_tokenizer().encode(text)
    forms = [text, {"prompt": text}, {"prompt_token_ids": text_ids}]
    outputs = tiny_llm.generate(forms, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == [text, text, None]
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert all(o.prompt_token_ids == text_ids for o in outputs)
    single = tiny_llm.generate({"prompt_token_ids": prompts[3]}, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == expected[3]
    per_prompt = [SamplingParams(temperature=0, max_tokens=n) for n in (1, 2, 3)]
    lengths = [len(o.outputs[0].token_ids) for o in tiny_llm.generate(forms, per_prompt, use_tqdm=False)]
    assert lengths == [1, 2, 3]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        tiny_llm.generate(forms, per_prompt[:2], use_tqdm=False)
    assert tiny_llm.generate(text, use_tqdm=False)[0].outputs[0].token_ids  # default SamplingParams()


@pytest.mark.parametrize(
    "legacy,replacement,inputs",
    [
        (dict(prompt="hello there"), "LLM.generate(prompt)", "hello there"),
        (dict(prompt=["hi", "yo"]), "LLM.generate(prompt)", ["hi", "yo"]),
        (dict(prompts="hello there"), "LLM.generate(prompts)", "hello there"),
        (dict(prompts=["hi", {"prompt_token_ids": [7]}]), "LLM.generate(prompts)", ["hi", {"prompt_token_ids": [7]}]),
        (dict(prompt_token_ids=[5, 6, 7]), "{'prompt_token_ids': ids}", {"prompt_token_ids": [5, 6, 7]}),
        (
            dict(prompt_token_ids=[[5, 6], [7]]),
            "{'prompt_token_ids': ids}",
            [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}],
        ),
    ],
)
def test_deprecated_keywords_still_work_and_name_the_replacement(tiny_llm, legacy, replacement, inputs):
    with pytest.warns(DeprecationWarning, match=re.escape(replacement)):
        old = tiny_llm.generate(sampling_params=GREEDY, use_tqdm=False, **legacy)
    new = tiny_llm.generate(inputs, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in old] == [o.outputs[0].token_ids for o in new]


@pytest.mark.parametrize(
    "keywords,conflict",
    [
        (dict(prompt="a", prompts=["b"]), "prompt=, prompts="),
        (dict(prompts="a", prompt_token_ids=[5]), "prompts=, prompt_token_ids="),
        (dict(inputs="a", prompts=["b"]), "either inputs or the deprecated"),
    ],
)
def test_a_prompt_given_twice_is_refused(tiny_llm, keywords, conflict):
    with pytest.raises(TypeError, match=re.escape(conflict)):
        tiny_llm.generate(use_tqdm=False, **keywords)


@pytest.mark.parametrize("token_ids", [[5, 6, 7], [[5, 6], [7]]], ids=["one", "batch"])
def test_token_ids_as_the_third_positional_argument_are_refused(tiny_llm, token_ids):
    """vLLM's old third positional argument was prompt_token_ids; here it is use_tqdm, which a list must not reach."""
    with pytest.raises(TypeError, match=re.escape("third positional argument is use_tqdm")) as refused:
        tiny_llm.generate(None, GREEDY, token_ids)
    assert "{'prompt_token_ids': ids}" in str(refused.value)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "batch",
    [[b"img0", b"img1", b"img2"], torch.arange(12).reshape(3, 2, 2)],
    ids=["list", "tensor"],
)
def test_deprecated_multi_modal_data_is_split_per_prompt(tiny_llm, monkeypatch, batch):
    """As vLLM's old API did: prompt i gets entry i of each value, with a batch dimension of one."""
    seen = []
    monkeypatch.setattr(tiny_llm.llm_engine, "add_request", lambda inputs, **_: seen.append(inputs))
    with pytest.warns(DeprecationWarning) as warned:
        tiny_llm.generate(prompt=["a", "b", "c"], multi_modal_data={"image": batch, "audio": batch}, use_tqdm=False)
    assert any("LLM.generate(multi_modal_data=...) is deprecated" in str(w.message) for w in warned)
    assert [item["prompt"] for item in seen] == ["a", "b", "c"]
    for i, item in enumerate(seen):
        assert item["multi_modal_data"].keys() == {"image", "audio"}
        for value in item["multi_modal_data"].values():
            assert type(value) is type(batch) and len(value) == 1
            assert torch.equal(value[0], batch[i]) if isinstance(batch, torch.Tensor) else value == batch[i : i + 1]


@pytest.mark.parametrize(
    "data,message",
    [
        ({"image": [b"img0", b"img1", b"img2"]}, "multi_modal_data['image'] holds 3 entries"),
        ({"image": [b"img0", b"img1"], "audio": b"ab"}, "multi_modal_data['audio'] is not a batch"),
    ],
    ids=["length", "not-a-batch"],
)
def test_deprecated_multi_modal_data_without_one_entry_per_prompt_is_refused(tiny_llm, data, message):
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=re.escape(message)) as refused:
        tiny_llm.generate(prompt=["a", "b"], multi_modal_data=data, use_tqdm=False)
    assert "one entry per prompt (2)" in str(refused.value)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_finish_reasons_are_finish_reason_members_that_equal_vllm_strings(tiny_llm, prompts, expected):
    stop_at = expected[3][2]
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at]),
    ]
    inputs = [{"prompt_token_ids": prompts[3]}] * 2
    length, stop = (o.outputs[0] for o in tiny_llm.generate(inputs, params, use_tqdm=False))
    assert type(length.finish_reason) is FinishReason and length.finish_reason is FinishReason.LENGTH
    assert type(stop.finish_reason) is FinishReason and stop.finish_reason is FinishReason.STOP
    # The compatibility promise: vLLM's string finish reasons still compare, format and hash as before.
    assert length.finish_reason == "length" and f"{stop.finish_reason}" == "stop"
    assert {"stop": 1}[stop.finish_reason] == 1


def test_multi_modal_data_is_refused_by_a_text_only_model(tiny_llm):
    with pytest.raises(ValueError, match="text only"):
        tiny_llm.generate({"prompt": "look", "multi_modal_data": {"image": b"..."}}, use_tqdm=False)
    with pytest.warns(DeprecationWarning) as warned, pytest.raises(ValueError, match="text only"):
        tiny_llm.generate(prompt="look", multi_modal_data={"image": b"..."}, use_tqdm=False)
    assert any("{'prompt': ..., 'multi_modal_data': data}" in str(w.message) for w in warned)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_queues_nothing(tiny_llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate(["fine", {"prompt_token_ids": [1, 999]}], use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()
    core = tiny_llm.llm_engine.engine_core
    assert core.block_manager.num_free_blocks == core.num_blocks
