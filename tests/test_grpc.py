"""The gRPC service over a real loopback channel: parity with ``LLM.generate``, errors, health, reflection, stubs."""

import asyncio
import contextlib
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status
from waiting import SLACK, wait_until

from spindle import LLM
from spindle.client import SpindleClient
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine
from spindle.frontend.engine.connection import EngineDeadError, ping_backend, start_backend
from spindle.frontend.grpc.admission_control import QueueFullError
from spindle.frontend.grpc.args import ServerConfig
from spindle.frontend.grpc.mapping import messages_from_proto, prompt_inputs_from_proto, sampling_params_from_proto
from spindle.frontend.grpc.server import GrpcServer
from spindle.frontend.grpc.servicer import status_for
from spindle.shared import SamplingParams
from spindle.shared.config import EngineConfig
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.protocol import HEARTBEAT_TIMEOUT
from spindle.v1 import spindle_pb2

REPO = Path(__file__).resolve().parents[1]
LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


def tiny_config(model_dir: Path, **kwargs) -> EngineConfig:
    return EngineConfig.of(**{"model": str(model_dir), "dtype": "float32", "kv_cache_memory": "4MiB", **kwargs})


class ServerThread:
    """A GrpcServer and its AsyncLLMEngine on an event loop of their own, as in ``spindle serve``."""

    def __init__(self, backend_address: str, engine_args: dict | None = None, **config) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            self.engine = AsyncLLMEngine.from_args(backend_address=backend_address, **(engine_args or {}))
            self.server = GrpcServer(self.engine, ServerConfig(port=0, **config))
            return await self.server.start()

        self.port = self.run(start())
        self.address = f"127.0.0.1:{self.port}"

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def client(self, **kwargs) -> SpindleClient:
        return SpindleClient(self.address, **kwargs)

    def close(self) -> None:
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.engine.shutdown)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def backend_of(model_dir: Path, **backend_args) -> Iterator[str]:
    """The address of a backend child serving the tiny model in ``model_dir``, stopped on leaving."""
    process, address = start_backend(tiny_config(model_dir, **backend_args))
    try:
        yield address
    finally:
        process.terminate()
        process.wait(30)


@contextlib.contextmanager
def served(
    model_dir: Path, engine_args: dict | None = None, backend_args: dict | None = None, **config
) -> Iterator[ServerThread]:
    """A backend of the tiny model in ``model_dir`` and a server in front of it, both stopped on leaving."""
    with backend_of(model_dir, **(backend_args or {})) as address:
        server = ServerThread(address, engine_args, **config)
        try:
            yield server
        finally:
            server.close()


@pytest.fixture(scope="module")
def backend(tiny_llm_dir):
    with backend_of(tiny_llm_dir) as address:
        yield address


@pytest.fixture(scope="module")
def server(backend):
    server = ServerThread(backend, max_n=4, max_tokens_limit=450, max_message_bytes=64 * 1024)
    yield server
    server.close()


@pytest.fixture
def client(server):
    with server.client(timeout=30) as client:
        yield client


def callers_id(engine_id: str) -> str:
    """The id a caller gave its request, from the engine's id of it (the server scopes it: ``<caller digest>-<id>``)."""
    return re.sub(r"^[0-9a-f]{16}-", "", engine_id)


def collect(responses) -> tuple[dict[int, dict], list]:
    """Join a stream's deltas per choice; returns the choices and the messages."""
    messages = list(responses)
    choices: dict[int, dict] = {}
    for message in messages:
        for delta in message.choices:
            choice = choices.setdefault(delta.index, {"text": "", "token_ids": [], "logprobs": [], "finish": []})
            choice["text"] += delta.text
            choice["token_ids"] += delta.token_ids
            choice["logprobs"] += delta.logprobs
            if delta.finish_reason:
                choice["finish"].append((delta.finish_reason, delta.WhichOneof("stop_reason")))
    return choices, messages


def settled_info(client: SpindleClient) -> spindle_pb2.GetServerInfoResponse:
    """The server's info once nothing runs or waits in the backend (which its stats say a step or a heartbeat late)."""

    def settled() -> spindle_pb2.GetServerInfoResponse | None:
        info = client.server_info()
        return None if info.num_running_requests or info.num_waiting_requests else info

    return wait_until(settled, "nothing runs or waits in the backend")


PROMPTS = ["hello world", "The quick brown fox", "a"]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0, "max_tokens": 24},
        {"temperature": 0.8, "top_k": 20, "seed": 7, "n": 3, "max_tokens": 12},
        {"temperature": 0.8, "seed": 7, "n": 2, "best_of": 4, "max_tokens": 12},
        {"temperature": 0, "max_tokens": 8, "logprobs": 2, "prompt_logprobs": 1},
    ],
    ids=["greedy", "n3-seeded", "best-2-of-4", "logprobs"],
)
def test_streams_equal_llm_generate(client, tiny_llm_dir, params):
    llm = LLM(**tiny_config(tiny_llm_dir).settings())
    expected = llm.generate(PROMPTS, SamplingParams(**params), use_tqdm=False)
    for prompt, reference in zip(PROMPTS, expected, strict=True):
        choices, messages = collect(client.generate(prompt, **params))
        assert sorted(choices) == list(range(params.get("n", 1)))
        for completion in reference.outputs:
            got = choices[completion.index]
            assert got["text"] == completion.text and got["token_ids"] == completion.token_ids
            assert len(got["finish"]) == 1  # the end is reported once, in the message where it happens
            if params.get("logprobs") is not None:
                assert [[t.token_id for t in p.tokens] for p in got["logprobs"]] == [
                    list(d) for d in completion.logprobs
                ]
                assert [p.tokens[0].logprob for p in got["logprobs"]] == pytest.approx(
                    [d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids, strict=True)], abs=1e-5
                )
        final = messages[-1]
        assert final.finished and not any(m.finished for m in messages[:-1])
        assert final.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert final.usage.completion_tokens == sum(len(c.token_ids) for c in reference.outputs)
        if params.get("prompt_logprobs") is not None:
            sent = [m for m in messages if m.prompt_logprobs]
            assert len(sent) == 1 and len(sent[0].prompt_logprobs) == len(reference.prompt_token_ids)
            assert [p.tokens[0].token_id for p in sent[0].prompt_logprobs[1:]] == reference.prompt_token_ids[1:]


def test_cache_salt_isolates_the_prefix_cache(client):
    prompt = [3 + (11 * i) % 250 for i in range(40)]  # two full blocks of 16 tokens

    def cached_tokens(salt: str) -> int:
        _, messages = collect(client.generate(prompt, temperature=0, max_tokens=2, cache_salt=salt))
        return messages[-1].usage.cached_tokens

    assert [cached_tokens(salt) for salt in ("a", "a", "b")] == [0, 32, 0]


def test_chat_tokenize_detokenize_and_info(client, server):
    tokenizer = server.engine.tokenizer
    ids = client.tokenize("hello there")
    assert ids == tokenizer.encode("hello there") and client.detokenize(ids) == "hello there"
    info = client.model_info()
    assert (info.vocab_size, info.max_model_len) == (server.engine.info.vocab_size, server.engine.max_model_len)
    assert list(info.eos_token_ids) == server.engine.info.eos_token_ids
    assert {t.name for t in info.special_tokens} == set(tokenizer.special_tokens)
    server_info = client.server_info()
    assert server_info.num_total_kv_blocks == server.engine.info.num_kv_blocks and server_info.uptime_seconds > 0
    if info.has_chat_template:
        choices, _ = collect(client.chat([{"role": "user", "content": "hi"}], temperature=0, max_tokens=4))
        assert len(choices[0]["token_ids"]) == 4
    else:  # the tiny model has no template: Chat refuses with a field violation on messages
        with pytest.raises(grpc.RpcError) as error:
            list(client.chat([{"role": "user", "content": "hi"}]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violated_fields(error.value) == ["messages"]


def test_cancel_deadline_and_abort_free_the_backend(client, server):
    stream = client.generate("cancel me", **LONG)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as error:
        list(stream)
    assert error.value.code() == grpc.StatusCode.CANCELLED
    with server.client(timeout=0.2) as hurried, pytest.raises(grpc.RpcError) as error:
        list(hurried.generate("too slow", **LONG))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream = client.generate("abort me", request_id="to-abort", **LONG)
    next(stream)
    assert client.abort("to-abort") and not client.abort("no-such-request")
    choices, _ = collect(stream)
    assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_ABORT, None)]
    info = settled_info(client)
    assert info.num_free_kv_blocks == info.num_total_kv_blocks


def violated_fields(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)
    fields = []
    for detail in status.details if status else []:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request)
        fields += [violation.field for violation in bad_request.field_violations]
    return fields


def refusal(call) -> grpc.RpcError:
    """The error that ends ``call()`` (a unary call, or a stream read to its end)."""
    with pytest.raises(grpc.RpcError) as error:
        list(call())  # a unary call raises before its result would be listed
    return error.value


def assert_invalid(error: grpc.RpcError, fields: list[str], message: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details() and violated_fields(error) == fields


PNG_ITEM = spindle_pb2.MultiModalItem(mime_type="image/png", data=b"\x89PNG")
AUDIO_ITEM = spindle_pb2.MultiModalItem(mime_type="audio/wav", data=b"RIFF")


def image_prompt(*items: spindle_pb2.MultiModalItem) -> spindle_pb2.GenerateRequest:
    return spindle_pb2.GenerateRequest(prompt=spindle_pb2.Prompt(text="look", multi_modal_data=items))


def chat_parts(*parts: spindle_pb2.ContentPart, content: str = "") -> spindle_pb2.ChatRequest:
    return spindle_pb2.ChatRequest(messages=[spindle_pb2.ChatMessage(role="user", content=content, parts=parts)])


@pytest.mark.parametrize(
    "call,fields,message",
    [
        (lambda c: c.generate("hi", temperature=-1), ["sampling_params.temperature"], "temperature=-1"),
        (lambda c: c.generate("hi", temperature=float("inf")), ["sampling_params.temperature"], "finite"),
        (lambda c: c.generate("hi", top_p=0), ["sampling_params.top_p"], "top_p"),
        (lambda c: c.generate("hi", logit_bias={300: 1.0}), ["sampling_params.logit_bias"], "outside the vocabulary"),
        (lambda c: c.generate("hi", n=5), ["sampling_params.n"], "limit of 4"),
        (lambda c: c.generate("hi", best_of=5), ["sampling_params.best_of"], "best_of=5 is above this server's limit"),
        (lambda c: c.generate("hi", max_tokens=451), ["sampling_params.max_tokens"], "limit of 450"),
        (lambda c: c.generate([1, 999]), ["prompt.token_ids[1]"], "outside the vocabulary"),
        (lambda c: c.generate(""), ["prompt"], "empty"),
        (
            lambda c: c.generate("x" * 300, max_tokens=300),
            ["prompt", "sampling_params.max_tokens"],
            "has 300 tokens and max_tokens=300",
        ),
        (lambda c: c.chat([]), ["messages"], "non-empty list"),
        (lambda c: c.detokenize([5, 256]), ["token_ids"], "outside the vocabulary"),
        (
            lambda c: c.stub.Generate(image_prompt(PNG_ITEM, AUDIO_ITEM), timeout=30),
            ["prompt.multi_modal_data[1]"],
            "prompt.multi_modal_data[1] has mime_type 'audio/wav': only images (image/png, image/jpeg, ...) are taken",
        ),
        (lambda c: c.stub.Generate(image_prompt(PNG_ITEM), timeout=30), ["prompt.multi_modal_data"], "text only"),
        (
            lambda c: c.stub.Chat(chat_parts(spindle_pb2.ContentPart(image=AUDIO_ITEM)), timeout=30),
            ["messages[0].parts[0]"],
            "has mime_type 'audio/wav'",
        ),
        (
            lambda c: c.stub.Chat(chat_parts(spindle_pb2.ContentPart(text="a"), content="b"), timeout=30),
            ["messages[0].content"],
            "messages[0] has both content and parts",
        ),
        (
            lambda c: c.stub.Chat(chat_parts(spindle_pb2.ContentPart(text="a"), spindle_pb2.ContentPart()), timeout=30),
            ["messages[0].parts[1]"],
            "messages[0].parts[1] is empty: set its text or its image",
        ),
        (
            lambda c: c.stub.Chat(chat_parts(spindle_pb2.ContentPart(image=PNG_ITEM)), timeout=30),
            ["messages[0].parts[0]"],
            "this model takes text only: messages[0].parts[0] is an image part",
        ),
    ],
    ids=[
        "temperature",
        "temperature-inf",
        "top_p",
        "logit-bias",
        "n-limit",
        "best-of-limit",
        "max-tokens-limit",
        "token-id",
        "empty",
        "too-long",
        "no-messages",
        "detokenize",
        "prompt-not-an-image",
        "prompt-image-to-a-text-model",
        "part-not-an-image",
        "content-and-parts",
        "empty-part",
        "part-image-to-a-text-model",
    ],
)
def test_bad_fields_are_invalid_argument_with_field_violations(client, call, fields, message):
    assert_invalid(refusal(lambda: call(client)), fields, message)


def test_prompt_images_and_message_parts_map_in_order():
    jpeg = spindle_pb2.MultiModalItem(mime_type="image/jpeg", data=b"\xff\xd8")
    prompt = spindle_pb2.Prompt(token_ids=spindle_pb2.TokenIds(ids=[5, 6]), multi_modal_data=[PNG_ITEM, jpeg])
    assert prompt_inputs_from_proto(prompt) == {
        "prompt_token_ids": [5, 6],
        "multi_modal_data": {"image": [b"\x89PNG", b"\xff\xd8"]},
    }
    request = chat_parts(spindle_pb2.ContentPart(text="Compare "), spindle_pb2.ContentPart(image=jpeg))
    request.messages.append(spindle_pb2.ChatMessage(role="assistant", content="Same."))
    assert messages_from_proto(request) == [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "image": b"\xff\xd8"}]},
        {"role": "assistant", "content": "Same."},
    ]


def test_a_request_id_in_use_is_a_field_violation(client):
    busy = client.generate("busy", request_id="busy", **LONG)
    next(busy)
    try:
        assert_invalid(refusal(lambda: client.generate("again", request_id="busy")), ["request_id"], "already in use")
    finally:
        busy.cancel()


@pytest.mark.parametrize(
    "method,kind",
    [("/spindle.v1.SpindleService/Generate", "unary_stream"), ("/spindle.v1.SpindleService/Tokenize", "unary_unary")],
)
@pytest.mark.parametrize("api_key", [None, "s3cret"])
def test_a_request_that_does_not_parse_is_invalid_argument(backend, server, method, kind, api_key):
    garbage = b"\x0a\xff\xff\xff\x0fnot a message"  # field 1, with a length far beyond the message's end
    target = server if api_key is None else ServerThread(backend, api_key=api_key)
    try:
        with target.client(api_key=api_key) as client:
            call = getattr(client.channel, kind)(method)  # no serializers: the bytes go out as they are
            error = refusal(lambda: call(garbage, metadata=client.metadata, timeout=30))
    finally:
        if target is not server:
            target.close()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "does not parse as a spindle.v1." in error.details()


@pytest.mark.parametrize(
    "error,code,fields",
    [
        (
            InvalidRequestError("prompt", "too long", also=["sampling_params.max_tokens"]),
            "INVALID_ARGUMENT",
            ["prompt", "sampling_params.max_tokens"],
        ),
        (EngineUnavailableError("draining"), "UNAVAILABLE", []),
        (EngineDeadError("gone"), "UNAVAILABLE", []),
        (QueueFullError("full"), "RESOURCE_EXHAUSTED", []),
        (KeyError("boom"), "INTERNAL", []),
    ],
    ids=["invalid", "unavailable", "dead", "queue-full", "bug"],
)
def test_status_for_maps_exception_types_to_codes(error, code, fields):
    status, message, violations = status_for(error)
    assert status == getattr(grpc.StatusCode, code) and message
    assert [v.field for v in violations] == fields and all(v.description == str(error) for v in violations)


def test_every_proto_sampling_param_is_a_sampling_params_attribute():
    # sampling_params_from_proto passes every proto field by its name: a field SamplingParams lacks would fail there.
    proto_fields = [field.name for field in spindle_pb2.SamplingParams.DESCRIPTOR.fields]
    assert set(proto_fields) - set(SamplingParams.__struct_fields__) == set()


@pytest.mark.parametrize(
    "fields",
    [
        {},  # unset optional fields keep the defaults (temperature 1, max_tokens 16, ...), not zero
        {"cache_salt": "tenant-a"},
        {"temperature": 0, "max_tokens": 5, "top_k": 3, "seed": 0},
        {"stop": ["a", "b"], "stop_token_ids": [7]},
        {"logit_bias": {3: 2.5}, "skip_special_tokens": False},
    ],
    ids=["defaults", "cache-salt", "scalars", "repeated", "map-and-bool"],
)
def test_sampling_params_from_proto(fields):
    assert sampling_params_from_proto(spindle_pb2.SamplingParams(**fields)) == SamplingParams(**fields)


def test_a_message_over_the_size_limit_is_resource_exhausted(client):
    with pytest.raises(grpc.RpcError) as error:
        list(client.generate("x" * 70_000))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_unexpected_exception_is_internal(client, server, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(server.engine.tokenizer, "convert_ids_to_tokens", broken)
    with pytest.raises(grpc.RpcError) as error:
        client.tokenize("hi")
    assert error.value.code() == grpc.StatusCode.INTERNAL and "bug in Spindle" in error.value.details()


def test_api_key(backend):
    server = ServerThread(backend, api_key="s3cret")
    try:
        for api_key in (None, "wrong"):
            with server.client(api_key=api_key) as client, pytest.raises(grpc.RpcError) as error:
                client.tokenize("hi")
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ("wrong" if api_key else "missing") in error.value.details()
        with server.client(api_key="s3cret") as client:
            assert client.tokenize("hi") and client.health() == "SERVING"
        with server.client() as client:
            assert client.health() == "SERVING"  # probes need no key
    finally:
        server.close()


def test_tls(backend, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server = ServerThread(backend, tls_cert=str(cert), tls_key=str(key))
    try:
        with SpindleClient(f"localhost:{server.port}", tls_ca=str(cert)) as client:
            assert client.detokenize(client.tokenize("tls")) == "tls"
        with SpindleClient(f"localhost:{server.port}", timeout=30) as plain, pytest.raises(grpc.RpcError) as error:
            plain.tokenize("tls")
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()


def test_a_full_queue_is_resource_exhausted_and_a_dead_backend_flips_health(tiny_llm_dir):
    # One sequence at a time: the second request waits in the backend while the first one runs.
    process, address = start_backend(tiny_config(tiny_llm_dir, max_num_seqs=1))
    # Streams fail with their backend, as test_resume's do with resumption off: this one never comes back.
    server = ServerThread(address, {"resume_streams": False}, max_queued_requests=1)
    try:
        with server.client(timeout=30) as client:
            running = client.generate("first", **LONG)
            next(running)
            waiting = client.generate("second", **LONG)
            # The third goes in as soon as the second is accepted, long before the first's 400 tokens are done (a
            # fixed pause raced them: on a fast machine the first finished and the second left the queue first).
            wait_until(
                lambda: server.server.servicer.admission_control.num_queued == 1,
                "the second request is queued",
                interval=0.005,
            )
            with pytest.raises(grpc.RpcError) as error:
                list(client.generate("third"))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 1" in error.value.details()
            watch = health_pb2_grpc.HealthStub(client.channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            process.kill()
            killed = time.monotonic()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # Noticed by the heartbeats' silence (this server did not start the backend, so cannot see it exit).
            assert time.monotonic() - killed < HEARTBEAT_TIMEOUT + SLACK
            assert client.health() == "NOT_SERVING" and client.health("spindle.v1.SpindleService") == "NOT_SERVING"
            for stream in (running, waiting, client.generate("late")):
                with pytest.raises(grpc.RpcError) as error:
                    list(stream)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "backend is down" in error.value.details()
    finally:
        server.close()
        process.wait(10)


SERVICES = [
    "spindle.v1.SpindleService",
    "vllm.grpc.engine.VllmEngine",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_as_v1_and_v1alpha(server, version):
    # The two protos are wire-identical, so v1alpha's message classes speak v1 too; only the method path differs.
    info = grpc.insecure_channel(server.address).stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    symbols = ["spindle.v1.SpindleService", f"grpc.reflection.{version}.ServerReflection"]
    requests = [reflection_pb2.ServerReflectionRequest(list_services="")]
    requests += [reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol) for symbol in symbols]
    listed, *files = list(info(iter(requests), timeout=30))
    assert sorted(service.name for service in listed.list_services_response.service) == sorted(SERVICES)
    for symbol, response in zip(symbols, files, strict=True):
        assert response.WhichOneof("message_response") == "file_descriptor_response", response
        descriptor = descriptor_pb2.FileDescriptorProto.FromString(
            response.file_descriptor_response.file_descriptor_proto[0]
        )
        package, service = symbol.rsplit(".", 1)
        assert descriptor.package == package and service in [s.name for s in descriptor.service]


def test_a_draining_backend_makes_new_streams_unavailable(tiny_llm_dir):
    process, address = start_backend(tiny_config(tiny_llm_dir), grace_period=30)
    server = ServerThread(address)
    try:
        with server.client(timeout=60) as client:
            running = client.generate("first", **LONG)
            next(running)
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: ping_backend(address).draining, "the backend drains")
            error = refusal(lambda: client.generate("late"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "engine is shutting down" in error.details()
            assert violated_fields(error) == []
            choices, _ = collect(running)  # the stream in flight still finishes
            assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]
    finally:
        server.close()
        process.wait(30)


def grpcurl(*args: str) -> str:
    binary = shutil.which("grpcurl", path=str(REPO / ".venv" / "bin") + os.pathsep + os.environ["PATH"])
    result = subprocess.run([binary, "-plaintext", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_describes_and_streams_without_proto_files(server):
    services = grpcurl(server.address, "list").split()
    assert set(SERVICES) <= set(services)
    assert "rpc Generate ( .spindle.v1.GenerateRequest ) returns ( stream .spindle.v1.GenerateResponse )" in grpcurl(
        server.address, "describe", "spindle.v1.SpindleService"
    )
    request = {"prompt": {"text": "hello world"}, "samplingParams": {"temperature": 0, "maxTokens": 6}}
    output = grpcurl("-d", json.dumps(request), server.address, "spindle.v1.SpindleService/Generate")
    messages = [json.loads(chunk) for chunk in output.replace("}\n{", "}\0{").split("\0")]
    text = "".join(c.get("text", "") for m in messages for c in m.get("choices", []))
    expected = server.run(reference_completion(server.engine, "hello world", 6))
    assert text == expected.text and messages[-1]["finished"]
    assert messages[-1]["usage"].get("completion_tokens", 0) == len(expected.token_ids)  # JSON omits zeros


async def reference_completion(engine: AsyncLLMEngine, prompt: str, max_tokens: int):
    final = None
    async for output in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
        final = output
    return final.outputs[0]


def test_committed_stubs_are_fresh(tmp_path):
    generate = runpy.run_path(str(REPO / "protos" / "generate.py"))
    for path in generate["generate"](tmp_path):
        committed = generate["OUT_ROOT"] / path.relative_to(tmp_path)
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run `make protos`"


def test_buf_lint():
    buf = shutil.which("buf", path=str(REPO / ".tools" / "node_modules" / ".bin") + os.pathsep + os.environ["PATH"])
    if buf is None:
        pytest.skip("buf is not installed: `make test` installs it with npm into .tools/")
    result = subprocess.run([buf, "lint"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sigterm_drains_then_exits(tiny_llm_dir):
    """``spindle serve`` on SIGTERM: NOT_SERVING first, new streams refused, the stream in flight finishes."""
    env = {**os.environ, "SPINDLE_MODEL": str(tiny_llm_dir), "SPINDLE_KV_CACHE_MEMORY": "4MiB", "SPINDLE_PORT": "0"}
    process = subprocess.Popen(
        [str(REPO / ".venv" / "bin" / "spindle"), "serve", "--dtype", "float32", "--grace-period", "30"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        with SpindleClient(f"127.0.0.1:{port}", timeout=60) as client:
            # As long as the context allows, so the stream is still running while the checks below happen.
            stream = client.generate("drain", temperature=0, max_tokens=500, ignore_eos=True)
            next(stream)
            process.send_signal(signal.SIGTERM)
            wait_until(lambda: client.health() == "NOT_SERVING", "the server reports NOT_SERVING")
            with pytest.raises(grpc.RpcError) as error:
                list(client.generate("late"))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.value.details()
            choices, _ = collect(stream)
            assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
