"""``vllm.grpc.engine.VllmEngine`` on Spindle's port, through the stubs of ``smg-grpc-proto`` as a gateway uses them."""

import hashlib
import io
import zipfile

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from test_data_parallel import DataParallelServer
from test_grpc import ServerThread, assert_invalid, backend, collect, refusal, tiny_config  # noqa: F401 - backend: a fixture
from waiting import wait_until

from spindle.frontend.engine.connection import start_backend
from spindle.frontend.grpc.vllm_servicer import _Completions
from spindle.shared import SamplingParams
from spindle.shared.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

PROMPT = [5, 17, 99, 3, 42, 8, 120, 64]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(backend):  # noqa: F811 - the imported fixture
    server = ServerThread(backend, max_n=4, max_tokens_limit=450)
    yield server
    server.close()


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def vllm(channel):
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


def generate(vllm, prompt: list[int] = PROMPT, stream: bool = False, **sampling) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=prompt), sampling_params=pb.SamplingParams(**sampling), stream=stream
    )
    return list(vllm.Generate(request, timeout=60))


def completes(responses: list[pb.GenerateResponse]) -> dict[int, pb.GenerateComplete]:
    ends = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    assert len({c.index for c in ends}) == len(ends)
    return {c.index: c for c in ends}


def streamed_ids(responses: list[pb.GenerateResponse]) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for response in responses:
        if response.WhichOneof("response") == "chunk":
            ids.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
    return ids


def spindle_greedy_ids(channel, prompt: spindle_pb2.Prompt) -> list[int]:
    stub = spindle_pb2_grpc.SpindleServiceStub(channel)
    request = spindle_pb2.GenerateRequest(prompt=prompt, sampling_params=spindle_pb2.SamplingParams(**GREEDY))
    choices, _ = collect(stub.Generate(request, timeout=60))
    return choices[0]["token_ids"]


def test_greedy_token_ids_equal_spindle_generate_streamed_or_not(vllm, channel):
    expected = spindle_greedy_ids(channel, spindle_pb2.Prompt(token_ids=spindle_pb2.TokenIds(ids=PROMPT)))
    assert len(expected) == GREEDY["max_tokens"]
    whole = completes(generate(vllm, **GREEDY))[0]
    assert list(whole.output_ids) == expected
    assert (whole.finish_reason, whole.prompt_tokens, whole.completion_tokens) == ("length", len(PROMPT), 12)
    streamed = generate(vllm, stream=True, **GREEDY)
    assert streamed_ids(streamed) == {0: expected}
    end = completes(streamed)[0]
    assert streamed[-1].complete == end and (end.finish_reason, end.completion_tokens) == ("length", 12)


def test_text_input_is_tokenized_by_the_server(vllm, channel):
    expected = spindle_greedy_ids(channel, spindle_pb2.Prompt(text="hello there"))
    request = pb.GenerateRequest(text="hello there", sampling_params=pb.SamplingParams(**GREEDY))
    assert list(completes(list(vllm.Generate(request, timeout=60)))[0].output_ids) == expected


def test_n_completions_come_by_index(vllm):
    sampling = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 6, "ignore_eos": True}
    streamed = generate(vllm, stream=True, **sampling)
    ends = completes(streamed)
    assert sorted(ends) == [0, 1] and all(end.completion_tokens == 6 for end in ends.values())
    assert {index: len(ids) for index, ids in streamed_ids(streamed).items()} == {0: 6, 1: 6}
    assert {i: list(end.output_ids) for i, end in completes(generate(vllm, **sampling)).items()} == streamed_ids(
        streamed
    )


def test_a_stop_token_is_reported_as_matched(vllm):
    ids = list(completes(generate(vllm, **GREEDY))[0].output_ids)
    stop = ids[3]
    end = completes(generate(vllm, **GREEDY | {"stop_token_ids": [stop]}))[0]
    assert end.finish_reason == "stop" and end.WhichOneof("matched_stop") == "matched_token_id"
    assert end.matched_token_id == stop and list(end.output_ids)[:-1] == ids[: ids.index(stop)]


def test_a_repeated_prompt_reports_its_cached_tokens(vllm):
    prompt = list(range(30, 70))  # 40 tokens: two full 16-token blocks to share
    generate(vllm, prompt, **GREEDY)
    end = completes(generate(vllm, prompt, **GREEDY))[0]
    assert end.prompt_tokens == 40 and end.cached_tokens >= 32


def test_logprobs_carry_the_chosen_and_top_tokens(vllm):
    end = completes(generate(vllm, **GREEDY | {"logprobs": 2, "prompt_logprobs": 1}))[0]
    logprobs = end.output_logprobs
    assert list(logprobs.token_ids) == list(end.output_ids) and len(logprobs.token_logprobs) == 12
    for token, value, top in zip(logprobs.token_ids, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top.token_ids) == 2 and top.token_ids[0] == token and top.values[0] == pytest.approx(value)
    prompt = end.input_logprobs
    assert list(prompt.token_ids) == PROMPT and not prompt.token_logprobs[0].HasField("value")
    assert all(position.HasField("value") for position in prompt.token_logprobs[1:])


def long_request(request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    return pb.GenerateRequest(
        request_id=request_id, tokenized=pb.TokenizedInput(input_ids=PROMPT), sampling_params=sampling, stream=True
    )


def test_abort_ends_a_stream(vllm):
    stream = vllm.Generate(long_request("long"), timeout=60)
    assert next(stream).chunk.token_ids
    vllm.Abort(pb.AbortRequest(request_ids=["long"]), timeout=10)
    end = completes(list(stream))[0]
    assert end.finish_reason == "abort" and end.completion_tokens < 400


def test_model_info_and_loads_match_the_engine(vllm, server):
    info = server.engine.info
    model = vllm.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert (model.served_model_name, model.max_context_length, model.vocab_size) == (
        info.model_name,
        info.max_model_len,
        info.vocab_size,
    )
    assert list(model.eos_token_ids) == info.eos_token_ids
    assert vllm.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy
    loads = vllm.GetLoads(pb.GetLoadsRequest(), timeout=10)
    assert loads.dp_rank_count == 1 and [load.dp_rank for load in loads.loads] == [0]
    assert loads.loads[0].max_total_num_tokens == info.num_kv_blocks * info.block_size

    def rank_load() -> pb.SchedulerLoad:
        return vllm.GetLoads(pb.GetLoadsRequest(dp_rank=0), timeout=10).loads[0]

    stream = vllm.Generate(long_request("busy"), timeout=60)
    next(stream)
    busy = wait_until(lambda: (load := rank_load()).num_running_reqs == 1 and load, "the stream shows in the load")
    assert busy.num_used_tokens >= len(PROMPT) and 0 < busy.token_usage <= 1
    stream.cancel()
    wait_until(lambda: rank_load().num_total_reqs == 0, "the cancelled stream leaves the load")
    server_info = vllm.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert server_info.data_parallel_size == 1 and server_info.block_size == info.block_size


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kv_transfer_params_json": "{}"}, "kv_transfer_params_json"),
        ({"data_parallel_rank": 0}, "data_parallel_rank"),
        ({"media_refs": pb.MediaRefs(items=[pb.MediaRef(url="http://x/a.png")])}, "media_refs"),
        # A structural tag without its format: xgrammar's compile refuses it, as spindle.v1's would.
        (
            {"sampling_params": pb.SamplingParams(structural_tag="{}")},
            "sampling_params.structured_output.structural_tag",
        ),
        ({"sampling_params": pb.SamplingParams(n=5)}, "sampling_params.n"),  # over the server's max_n, as spindle.v1
    ],
)
def test_what_spindle_cannot_honour_is_refused(vllm, fields, field):
    request = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=PROMPT), **fields)
    assert_invalid(refusal(lambda: vllm.Generate(request, timeout=10)), [field], field.rsplit(".", 1)[-1])


def test_reflection_lists_the_service(server):
    info = grpc.insecure_channel(server.address).stream_stream(
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")]
    (listed,) = list(info(iter(requests), timeout=30))
    assert "vllm.grpc.engine.VllmEngine" in [service.name for service in listed.list_services_response.service]


def test_get_tokenizer_streams_the_files_the_frontend_loaded(vllm, server):
    chunks = list(vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(chunk.data for chunk in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as files:
        assert {name: files.read(name) for name in files.namelist()} == server.engine.info.tokenizer_files
    assert "tokenizer.json" in server.engine.info.tokenizer_files


def test_loads_come_per_data_parallel_engine(tiny_llm_dir):
    backends = [start_backend(tiny_config(tiny_llm_dir)) for _ in range(2)]
    server = DataParallelServer("--backend-address", ",".join(address for _, address in backends))
    try:
        with grpc.insecure_channel(server.address) as channel:
            vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            loads = vllm.GetLoads(pb.GetLoadsRequest(), timeout=10)
            assert loads.dp_rank_count == 2 and [load.dp_rank for load in loads.loads] == [0, 1]
            for load, rank in zip(loads.loads, range(2), strict=True):
                stats = server.stats(rank)
                assert load.max_total_num_tokens == stats.num_total_blocks * server.engine.info.block_size
            (only,) = vllm.GetLoads(pb.GetLoadsRequest(dp_rank=1), timeout=10).loads
            assert only.dp_rank == 1
            assert vllm.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).data_parallel_size == 2
            error = refusal(lambda: vllm.GetLoads(pb.GetLoadsRequest(dp_rank=2), timeout=10))
            assert_invalid(error, ["dp_rank"], "dp_rank=2")
    finally:
        server.close()
        for process, _ in backends:
            process.terminate()
            process.wait(30)


@pytest.mark.parametrize("stream", [False, True])
def test_the_complete_message_carries_the_completions_draft_counts(stream):
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=[3, 4, 5],
        finish_reason=FinishReason.LENGTH,
        num_draft_tokens=6,
        num_accepted_draft_tokens=2,
    )
    output = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
        metrics=RequestMetrics(arrival_time=0.0),
    )
    complete = _Completions(SamplingParams(max_tokens=3), stream).take(output)[-1].complete
    assert (complete.spec_draft_tokens, complete.spec_accepted_tokens) == (6, 2)
    assert list(complete.output_ids) == ([] if stream else [3, 4, 5])
