"""The gRPC server's limits, tenancy and trust, through a real server and real connections.

Each connection here is a channel of its own (``grpc.use_local_subchannel_pool``: channels to one address would
otherwise share one connection), as the server tells callers apart by their connection.
"""

import os
import subprocess
import threading
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_grpc import LONG, REPO, ServerThread, assert_invalid, collect, settled_info, tiny_config
from waiting import wait_until

from spindle.client import sampling_params
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.grpc.args import ServerConfig
from spindle.frontend.grpc.servicer import TOKENIZER_NICENESS
from spindle.shared.protocol import EngineStats
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

SPINDLE = REPO / ".venv" / "bin" / "spindle"


@pytest.fixture(scope="module")
def backend(tiny_llm_dir):
    # One sequence at a time: a second request waits in the backend while the first one runs.
    process, address = start_backend(tiny_config(tiny_llm_dir, max_num_seqs=1))
    yield address
    process.terminate()
    process.wait(30)


@pytest.fixture
def make_server(backend) -> Iterator:
    """``make_server(**config)``: a server on the module's backend, closed after the test."""
    servers = []

    def make(**config) -> ServerThread:
        servers.append(ServerThread(backend, **config))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def connect() -> Iterator:
    """``connect(server, *options)``: a channel on a connection of its own to ``server``, closed after the test."""
    channels = []

    def open_channel(server: ServerThread, *options: tuple[str, object]) -> grpc.Channel:
        options = [("grpc.use_local_subchannel_pool", 1), *options]
        channels.append(grpc.insecure_channel(server.address, options=options))
        return channels[-1]

    yield open_channel
    for channel in channels:
        channel.close()


def generate(channel: grpc.Channel, prompt: str, request_id: str = "", **params) -> Iterator:
    request = spindle_pb2.GenerateRequest(
        prompt=spindle_pb2.Prompt(text=prompt), request_id=request_id, sampling_params=sampling_params(**params)
    )
    return spindle_pb2_grpc.SpindleServiceStub(channel).Generate(request, timeout=120)


def abort(channel: grpc.Channel, request_id: str) -> bool:
    request = spindle_pb2.AbortRequest(request_id=request_id)
    return spindle_pb2_grpc.SpindleServiceStub(channel).Abort(request, timeout=30).aborted


def refusal(call) -> grpc.RpcError:
    """The error that ends ``call()`` (a unary call, or a stream read to its end)."""
    with pytest.raises(grpc.RpcError) as error:
        list(call())
    return error.value


def text(responses) -> str:
    choices, _ = collect(responses)
    return choices[0]["text"]


def test_an_embed_over_the_free_queue_is_refused_and_the_stream_beside_it_keeps_its_text(make_server):
    server = make_server(max_queued_requests=3)
    with server.client(timeout=120) as client:
        solo = text(client.generate("beside", temperature=0, max_tokens=24))
        running = client.generate("first", **LONG)
        next(running)
        waiting = client.generate("beside", temperature=0, max_tokens=24)
        wait_until(lambda: server.server.servicer.admission_control.num_queued == 1, "the second request is queued")
        # 3 inputs need 3 slots, and 1 of the 3 is taken.
        error = refusal(lambda: client.embed(["a", "b", "c"]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 3" in error.details()
        running.cancel()
        assert text(waiting) == solo
        # More inputs than the queue could ever hold are a bad argument, not a reason to retry.
        error = refusal(lambda: client.embed(["x"] * 4))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit of 3" in error.details()


def test_the_tokenizer_threads_yield_the_cpu_to_serving(make_server):
    threads = make_server().server.servicer._tokenizer_threads
    niceness = threads.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result(30)
    assert niceness == TOKENIZER_NICENESS > os.getpriority(os.PRIO_PROCESS, 0)


def test_a_long_tokenize_runs_off_the_loop_and_the_excess_is_refused(make_server, monkeypatch):
    server = make_server(tokenizer_threads=1, max_queued_requests=1)
    release, entered = threading.Event(), threading.Semaphore(0)
    encode = server.engine.tokenizer.encode

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "slow":
            entered.release()
            release.wait(120)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(server.engine.tokenizer, "encode", slow_encode)
    with server.client(timeout=120) as client:
        busy = client.stub.Tokenize.future(spindle_pb2.TokenizeRequest(text="slow"), timeout=120)
        assert entered.acquire(timeout=60)
        waiting = client.stub.Tokenize.future(spindle_pb2.TokenizeRequest(text="slow"), timeout=120)
        try:
            calls = server.server.servicer.tokenizer_calls
            wait_until(lambda: calls.counts[""] == 2, "the second Tokenize waits for the thread")
            # The one thread is busy, the one waiting place taken.
            error = refusal(lambda: client.tokenize("third"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Tokenize and Detokenize calls" in error.details()
            # Streams go on meanwhile: on the event loop, the blocked tokenizer would stall this one for good.
            choices, _ = collect(client.generate("meanwhile", temperature=0, max_tokens=16))
            assert len(choices[0]["token_ids"]) == 16 and not busy.done()
        finally:
            release.set()
        assert busy.result().token_ids == waiting.result().token_ids == encode("slow")


def watch_load(channel: grpc.Channel) -> Iterator:
    return spindle_pb2_grpc.SpindleServiceStub(channel).WatchLoad(spindle_pb2.WatchLoadRequest(), timeout=120)


def watch_health(channel: grpc.Channel) -> Iterator:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)


@pytest.mark.parametrize("watch", [watch_load, watch_health], ids=["load", "health"])
def test_watchers_are_capped_over_all_connections(make_server, connect, watch):
    server = make_server(max_watchers=2)
    first, second = watch_load(connect(server)), watch_health(connect(server))
    next(first), next(second)
    error = refusal(lambda: watch(connect(server)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "load and health watches" in error.details()
    first.cancel()
    wait_until(lambda: server.server.servicer.watchers.counts[""] < 2, "the cancelled watch is closed")
    assert next(watch(connect(server)))


def test_streams_are_capped_per_connection(make_server, connect):
    server = make_server(max_streams_per_connection=2)
    # Unread, big outputs fill the connection's window (BDP probing off keeps it at 64 KiB): both calls stay open.
    channel = connect(server, ("grpc.http2.bdp_probe", 0))
    streams = [generate(channel, f"stream {i}", n=4, logprobs=20, **LONG) for i in range(2)]
    next(streams[0])
    connections = server.server.servicer.connections
    wait_until(lambda: list(connections.counts.values()) == [2], "both streams are open on the connection")
    error = refusal(lambda: generate(channel, "one too many", max_tokens=4))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams on this connection" in error.details()
    # Another connection has its own streams.
    choices, _ = collect(generate(connect(server), "other", temperature=0, max_tokens=4))
    assert len(choices[0]["token_ids"]) == 4
    for stream in streams:
        stream.cancel()


def test_a_stream_its_client_does_not_read_is_aborted_and_frees_its_blocks(make_server, connect, caplog):
    server = make_server(max_unread_outputs=4, unread_timeout=1.0)
    # Without BDP probing the connection keeps HTTP/2's 64 KiB window, which a few big outputs fill.
    unread = generate(connect(server, ("grpc.http2.bdp_probe", 0)), "never read", n=4, logprobs=20, **LONG)
    with server.client(timeout=30) as client:
        wait_until(lambda: "its client left 4 outputs unread" in caplog.text, "the unread stream is aborted")
        info = settled_info(client)
        assert info.num_free_kv_blocks == info.num_total_kv_blocks
        wait_until(lambda: not server.server.servicer.connections.counts, "the call has ended on the server")
    with pytest.raises(grpc.RpcError) as error:
        list(unread)  # what came before the abort, then the end
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "outputs unread" in error.value.details()


def test_a_stream_its_client_does_not_read_is_paused_and_gives_way_to_another(make_server, connect):
    server = make_server(engine_args={"stream_buffer_outputs": 4}, max_unread_outputs=4)
    unread = generate(connect(server, ("grpc.http2.bdp_probe", 0)), "never read", n=4, logprobs=20, **LONG)

    async def generated() -> int:
        (state,) = server.engine.output_processor.requests.values()  # the unread request's, alone in flight
        return sum(len(completion.token_ids) for completion in state.completions)

    def paused() -> EngineStats | None:
        stats = server.run(server.engine.get_stats())
        return stats if stats.num_paused_requests == 1 else None

    stats = wait_until(paused, "the unread stream's request is paused")
    assert stats.num_free_blocks < stats.num_total_blocks  # it keeps its blocks while nothing else needs them
    stalled_at = server.run(generated())
    # The backend runs one sequence at a time: another stream runs because the paused one gives way.
    choices, _ = collect(generate(connect(server), "other", temperature=0, max_tokens=4))
    assert len(choices[0]["token_ids"]) == 4
    assert server.run(generated()) == stalled_at < 4 * LONG["max_tokens"] // 2
    unread.cancel()


ADMIN_CALLS = {
    "load": lambda client: client.load_lora_adapter("sql", "sql"),
    "unload": lambda client: client.unload_lora_adapter("sql"),
}


@pytest.mark.parametrize("call", ADMIN_CALLS.values(), ids=ADMIN_CALLS.keys())
def test_adapter_calls_need_the_admin_key(make_server, call):
    tenant_only = make_server(api_key="tenant")
    with tenant_only.client(api_key="tenant") as client:
        error = refusal(lambda: call(client))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "no admin key" in error.details()
    server = make_server(api_key="tenant", admin_api_key="admin")
    for api_key, code in [(None, "UNAUTHENTICATED"), ("tenant", "PERMISSION_DENIED"), ("wrong", "UNAUTHENTICATED")]:
        with server.client(api_key=api_key) as client:
            assert refusal(lambda: call(client)).code().name == code
    with server.client(api_key="admin") as admin:
        # Past the keys: this backend does not load adapters at run time.
        assert refusal(lambda: call(admin)).code() == grpc.StatusCode.FAILED_PRECONDITION
        assert admin.tokenize("hi")  # the admin key opens every other call too


@pytest.mark.parametrize(
    "argv,env",
    [
        (["--api-key", ""], {}),
        (["--admin-api-key", ""], {}),
        ([], {"SPINDLE_API_KEY": ""}),
        ([], {"SPINDLE_ADMIN_API_KEY": ""}),
    ],
    ids=["api-key-flag", "admin-key-flag", "api-key-env", "admin-key-env"],
)
def test_the_server_refuses_to_start_with_an_empty_key(argv, env, tiny_llm_dir):
    environment = {key: value for key, value in os.environ.items() if not key.startswith("SPINDLE_")} | env
    command = [SPINDLE, "serve", "--model", str(tiny_llm_dir), *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 2
    assert "is set but empty: give the key, or unset it" in result.stderr


LOWERED = {"max_stop_strings": 2, "max_stop_string_length": 4, "max_stop_token_ids": 2, "max_logit_bias": 2}
"""Per-request limits a server lowers below SamplingParams' own."""

PAST_LOWERED = {
    "max_stop_strings": ({"stop": ["a", "b", "c"]}, {"stop": ["a", "b"]}, "stop", "has 3 stop strings"),
    "max_stop_string_length": ({"stop": ["abcde"]}, {"stop": ["abcd"]}, "stop", "has a string of 5 characters"),
    "max_stop_token_ids": ({"stop_token_ids": [1, 2, 3]}, {"stop_token_ids": [1, 2]}, "stop_token_ids", "has 3"),
    "max_logit_bias": ({"logit_bias": dict.fromkeys([1, 2, 3], 1.0)}, {"logit_bias": {1: 1.0}}, "logit_bias", "has 3"),
}
"""For each lowered limit: a request just past it, one within it, the field and the start of the refusal."""


@pytest.mark.parametrize("setting", PAST_LOWERED)
def test_a_server_lowers_the_per_request_limits(make_server, connect, setting):
    channel = connect(make_server(**LOWERED))
    past, within, field, message = PAST_LOWERED[setting]
    error = refusal(lambda: generate(channel, "past", max_tokens=2, **past))
    flag = "--" + setting.replace("_", "-")
    assert_invalid(error, [f"sampling_params.{field}"], message)
    assert f"this server's limit of {LOWERED[setting]} ({flag})" in error.details()
    assert collect(generate(channel, "within", max_tokens=2, **within))


@pytest.mark.parametrize("setting", PAST_LOWERED)
def test_a_per_request_limit_cannot_exceed_sampling_params_own(setting):
    with pytest.raises(ValueError, match=f"{setting}=100000 must be in"):
        ServerConfig(**{setting: 100_000})


def test_a_key_equal_to_the_admin_key_is_refused():
    with pytest.raises(ValueError, match="must differ"):
        ServerConfig(api_key="same", admin_api_key="same")


def test_a_caller_cannot_abort_or_collide_with_another_callers_request(make_server, connect):
    server = make_server()
    owner, other = connect(server), connect(server)
    stream = generate(owner, "mine", request_id="shared", **LONG)
    next(stream)
    assert not abort(other, "shared")
    # The same id is free on the other connection: its request is another one, queued behind the first.
    theirs = generate(other, "theirs", request_id="shared", temperature=0, max_tokens=2)
    wait_until(lambda: server.server.servicer.admission_control.num_queued == 1, "the other request is queued")
    assert next(stream).request_id == "shared"  # still streaming
    assert abort(owner, "shared")
    choices, _ = collect(stream)
    assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_ABORT, None)]
    choices, messages = collect(theirs)
    assert len(choices[0]["token_ids"]) == 2 and {message.request_id for message in messages} == {"shared"}
