"""Request priority end to end: the Python APIs and the gRPC servicer carry it, and the engine serves by it."""

import argparse
import asyncio
from pathlib import Path

import pytest

from spindle import LLM, LLMEngine, SamplingParams
from spindle.frontend.grpc.args import ServerConfig
from spindle.frontend.grpc.servicer import SpindleServicer
from spindle.shared.config import EngineConfig, add_engine_args, config_from_args, config_from_json, config_to_json
from spindle.shared.protocol import EngineInfo
from spindle.v1 import spindle_pb2


def tiny_engine(model_dir: Path, **kwargs: object) -> LLMEngine:
    return LLMEngine.from_args(model=str(model_dir), dtype="float32", kv_cache_memory="4MiB", **kwargs)


@pytest.mark.parametrize(
    "policy,expected",
    [("fcfs", ["0", "1", "2", "3", "late"]), ("priority", ["1", "late", "3", "0", "2"])],
)
def test_priority_order_is_observable_in_first_token_times_under_load(tiny_llm_dir, policy, expected):
    """One slot, five requests: under priority the first tokens come by priority then arrival, and a late request
    of the best priority takes the slot from a worse running one; fcfs serves in arrival order."""
    engine = tiny_engine(tiny_llm_dir, max_num_seqs=1, scheduling_policy=policy)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for request_id, priority in zip("0123", [2, 1, 2, 1], strict=True):
        engine.add_request(request_id, {"prompt_token_ids": [5, 6, 7, int(request_id) + 8]}, params, priority=priority)
    first_token_times: dict[str, float] = {}

    def step() -> None:
        for output in engine.step():
            if output.outputs[0].token_ids:
                first_token_times.setdefault(output.request_id, output.metrics.first_token_time)

    step()
    engine.add_request("late", {"prompt_token_ids": [5, 6, 7, 20]}, params, priority=0)
    while engine.has_unfinished_requests():
        step()
    assert sorted(first_token_times, key=first_token_times.get) == expected
    core = engine.engine_core
    assert core.scheduler.num_preemptions == (policy == "priority")  # the late request's room
    assert core.block_manager.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("method", ["generate", "chat"])
def test_llm_takes_one_priority_per_prompt(tiny_llm_dir, monkeypatch, method):
    llm = LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="4MiB", scheduling_policy="priority")
    seen: list[int] = []
    add_request = llm.llm_engine.add_request

    def recording_add(request_id: str, params: SamplingParams, priority: int = 0, **inputs: object) -> str:
        seen.append(priority)
        # The tiny tokenizer has no chat template: a conversation goes in as its one message's text.
        prompt = inputs["inputs"] if method == "generate" else inputs["messages"][0]["content"]
        return add_request(request_id, prompt, params, priority=priority)

    monkeypatch.setattr(llm.llm_engine, "add_request" if method == "generate" else "add_chat_request", recording_add)
    run = getattr(llm, method)
    prompts = ["a", "b", "c"] if method == "generate" else [[{"role": "user", "content": t}] for t in "abc"]
    params = SamplingParams(temperature=0, max_tokens=2)
    outputs = run(prompts, params, use_tqdm=False, priority=[2, 0, 1])
    assert seen == [2, 0, 1] and [len(o.outputs[0].token_ids) for o in outputs] == [2, 2, 2]
    run(prompts[:2], params, use_tqdm=False)
    assert seen[3:] == [0, 0]
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        run(prompts[:2], params, use_tqdm=False, priority=[1])
    assert not llm.llm_engine.has_unfinished_requests()


class RecordingEngine:
    """Stands in for AsyncLLMEngine: records the keywords each stream starts with, and streams nothing."""

    # What the servicer reads of the engine when it starts (its served name, the generation config's files).
    info = EngineInfo(
        "tiny", max_model_len=128, vocab_size=256, eos_token_ids=[2], num_kv_blocks=8, block_size=16, tokenizer_files={}
    )

    def __init__(self) -> None:
        self.keywords: list[dict[str, object]] = []

    def generate(self, inputs: object, params: SamplingParams, request_id: str, **keywords: object):
        self.keywords.append(keywords)
        return self._nothing()

    chat = generate

    async def _nothing(self):
        return
        yield


class PeerContext:
    """Stands in for a gRPC call's context: the servicer reads only the caller's address."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


@pytest.mark.parametrize(
    "method,request_message",
    [
        ("Generate", spindle_pb2.GenerateRequest(prompt=spindle_pb2.Prompt(text="hi"), priority=-3)),
        ("Chat", spindle_pb2.ChatRequest(messages=[spindle_pb2.ChatMessage(role="user", content="hi")], priority=-3)),
    ],
)
def test_the_servicer_passes_the_request_priority_to_the_engine(method, request_message):
    engine = RecordingEngine()
    servicer = SpindleServicer(engine, ServerConfig())

    async def call() -> list:
        return [response async for response in getattr(servicer, method)(request_message, PeerContext())]

    assert asyncio.run(call()) == []
    assert [keywords["priority"] for keywords in engine.keywords] == [-3]


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(scheduling_policy="lottery"), "scheduling_policy='lottery' must be one of fcfs, priority"),
        (dict(priority_aging=-1.0), "priority_aging=-1.0 must be >= 0"),
        (dict(priority_aging=float("nan")), "priority_aging=nan must be >= 0"),
        (dict(max_decode_slowdown=0.5), r"max_decode_slowdown=0.5 must be 0 \(no bound\) or >= 1"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold=-1 must be >= 0"),
    ],
)
def test_bad_scheduling_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.of(**fields)


def test_the_scheduling_flags_reach_the_config_and_a_backend_started_with_it():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    argv = ["--scheduling-policy", "priority", "--priority-aging", "2.5", "--long-prefill-token-threshold", "64"]
    config = config_from_args(parser.parse_args(argv))
    scheduler = config.scheduler
    assert (scheduler.scheduling_policy, scheduler.priority_aging, scheduler.long_prefill_token_threshold) == (
        "priority",
        2.5,
        64,
    )
    assert config_from_json(config_to_json(config)) == config
