"""Requests crafted to take a shared server down, slow it or forge its log, against a real server and backend.

A request whose output cannot be processed fails alone, and ordinary streams beside it come back as they would alone;
JSON nested too deep, caps overrun, a priority out of range and a request id that is not one are refused with
``INVALID_ARGUMENT`` naming the field, through gRPC and through the Python API; and the server's log keeps one line a
record whatever a request carries.
"""

import json
import logging
import re
import shutil
from pathlib import Path

import grpc
import pytest
from test_grpc import ServerThread, assert_invalid, callers_id, collect, refusal, settled_info, tiny_config
from test_process_split import private_tmp  # noqa: F401 - a fixture: short ipc paths, cleaned up
from test_recovery import serve_logging_to

from spindle import LLMEngine, SamplingParams, StructuredOutput
from spindle.client import SpindleClient
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared.errors import InvalidRequestError, OutputProcessingError
from spindle.shared.json_depth import MAX_JSON_DEPTH
from spindle.shared.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from spindle.v1 import spindle_pb2

CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONTEXT = 2048
"""The chat model's context: room for a reply nested deeper than Python's recursion limit (1000)."""

TOOLS = [{"name": "lookup", "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}]
QUESTION = [{"role": "user", "content": "Look it up."}]
ORDINARY = [("hello world", 48), ("The quick brown fox", 64)]
"""Greedy prompts that run beside a hostile request, and how many tokens each generates."""


@pytest.fixture(scope="module")
def chat_model_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a chat template and a context of :data:`CONTEXT` tokens (its rotary embedding has no
    learned positions, so a longer context only changes the config)."""
    path = tmp_path_factory.mktemp("tiny-chat-llm")
    shutil.copytree(tiny_llm_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def server(chat_model_dir: Path):
    process, address = start_backend(tiny_config(chat_model_dir))
    server = ServerThread(address, max_n=4)
    yield server
    server.close()
    process.terminate()
    process.wait(30)


@pytest.fixture
def client(server: ServerThread):
    with server.client(timeout=120) as client:
        yield client


def ordinary_streams(client: SpindleClient) -> list:
    """Start the ordinary greedy streams (gRPC starts a call at once; it runs while its responses wait to be read)."""
    return [client.generate(prompt, temperature=0, max_tokens=tokens, ignore_eos=True) for prompt, tokens in ORDINARY]


def texts(streams: list) -> list[str]:
    """Each stream's text, read to its end."""
    return [collect(stream)[0][0]["text"] for stream in streams]


def test_a_tool_reply_nested_past_the_recursion_limit_finishes_as_text_beside_ordinary_streams(client, alone):
    [bracket] = client.tokenize("[", add_special_tokens=False)
    nested = client.chat(
        QUESTION, tools=TOOLS, temperature=0, max_tokens=1500, ignore_eos=True, logit_bias={bracket: 100.0}
    )
    beside = ordinary_streams(client)
    choices, messages = collect(nested)
    assert choices[0]["text"] == "[" * 1500 and choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]
    assert not any(delta.tool_calls for message in messages for delta in message.choices)
    assert texts(beside) == alone


def test_a_request_whose_output_cannot_be_processed_fails_alone(client, server, alone, monkeypatch, caplog):
    aborted = spy_on_aborts(monkeypatch, server.engine.client)

    def broken(self: Tokenizer, token_id: int) -> str:
        raise RuntimeError("a bug in the tokenizer")

    # Only a request that asks for logprobs decodes its candidates' text: the doomed one.
    monkeypatch.setattr(Tokenizer, "id_to_text", broken)
    doomed = client.generate("doomed", "doomed", temperature=0, max_tokens=1000, ignore_eos=True, logprobs=1)
    beside = ordinary_streams(client)
    with caplog.at_level(logging.ERROR):
        error = refusal(lambda: doomed)
        assert texts(beside) == alone
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "the output of this request could not be processed (RuntimeError: a bug in the tokenizer)" in (
        error.details()
    )
    logged = [record for record in caplog.records if record.levelno >= logging.ERROR]
    # The server scopes the caller's id to its connection: "<caller>-doomed".
    assert [(record.getMessage().split(" (")[0], callers_id(record.request_id)) for record in logged] == [
        ("The output of the request could not be processed", "doomed")
    ]
    assert "doomed" in map(callers_id, aborted)  # in the backend, where it would run on
    settled_info(client)


def spy_on_aborts(monkeypatch: pytest.MonkeyPatch, engine_client: object) -> list[str]:
    """The ids the engine aborts in its backend from now on (it still aborts them)."""
    aborted: list[str] = []
    abort = engine_client.abort_requests

    def recording(request_ids: list[str]) -> None:
        aborted.extend(request_ids)
        abort(request_ids)

    monkeypatch.setattr(engine_client, "abort_requests", recording)
    return aborted


def test_the_sync_engine_fails_that_request_alone_too(chat_model_dir, monkeypatch):
    engine = LLMEngine.from_args(**tiny_config(chat_model_dir).settings())
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        engine.add_request("alone", "hello world", params)
        expected = run_to_end(engine)
        monkeypatch.setattr(Tokenizer, "id_to_text", lambda self, token_id: {}[token_id])
        engine.add_request("doomed", "doomed", SamplingParams(max_tokens=500, ignore_eos=True, logprobs=1))
        engine.add_request("ordinary", "hello world", params)
        with pytest.raises(OutputProcessingError, match="the output of this request could not be processed") as error:
            run_to_end(engine)
        assert error.value.request_id == "doomed"
        core = engine.engine_core
        assert not core.has_request("doomed") and core.has_request("ordinary")  # aborted where it would run on
        assert run_to_end(engine)["ordinary"] == expected["alone"]
        assert not core.has_unfinished_requests()
    finally:
        engine.shutdown()


def run_to_end(engine: LLMEngine) -> dict[str, str]:
    """Step until nothing is in flight; the text each finished request ended with."""
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].text
    return finished


DEEP = 5000
"""Levels of nesting past Python's recursion limit (1000): ``json`` would raise ``RecursionError`` on them."""
DEEP_SCHEMA = '{"type": "array", "items": ' * DEEP + "{}" + "}" * DEEP
DEEP_ARGUMENTS = '{"a": ' * DEEP + "1" + "}" * DEEP


def deep_parameters(depth: int) -> dict:
    """Tool parameters nested ``depth`` levels deep, as a dict (built by a loop: ``json`` could not build it)."""
    value: dict = {"type": "object"}
    for _ in range(depth - 1):
        value = {"type": "object", "properties": {"a": value}}
    return value


CALLED = [
    *QUESTION,
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "lookup", "arguments": DEEP_ARGUMENTS}]},
]


def generate(**request: object) -> dict[str, object]:
    """A ``Generate`` of ``prompt`` with ``params`` (SamplingParams fields), ``request_id`` and ``priority``."""
    return {"rpc": "generate", "prompt": "hi", "params": {}, **request}


def chat(**request: object) -> dict[str, object]:
    """A ``Chat`` of ``messages`` with ``tools`` and ``params``."""
    return {"rpc": "chat", "messages": QUESTION, "tools": None, "params": {}, **request}


HOSTILE = {
    "json_schema": (
        generate(params={"structured_output": {"json_schema": DEEP_SCHEMA}}),
        "sampling_params.structured_output.json_schema",
        f"is nested deeper than {MAX_JSON_DEPTH} levels",
    ),
    "tool_parameters": (
        # 200 levels: past the limit, and still within what the client's json.dumps can send.
        chat(tools=[{"name": "deep", "parameters": deep_parameters(200)}]),
        "tools[0].parameters",
        "is nested deeper than",
    ),
    "tool_call_arguments": (
        chat(messages=CALLED, tools=TOOLS),
        "messages[1].tool_calls[0].arguments",
        f"is nested deeper than {MAX_JSON_DEPTH} levels",
    ),
    "stop_strings": (
        generate(params={"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}),
        "sampling_params.stop",
        f"more than the limit of {MAX_STOP_STRINGS}",
    ),
    "stop_length": (generate(params={"stop": ["x" * 257]}), "sampling_params.stop", "has a string of 257 characters"),
    "stop_token_ids": (
        generate(params={"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}),
        "sampling_params.stop_token_ids",
        f"more than the limit of {MAX_STOP_TOKEN_IDS}",
    ),
    "logit_bias": (
        generate(params={"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)}),
        "sampling_params.logit_bias",
        f"more than the limit of {MAX_LOGIT_BIAS}",
    ),
    "priority_low": (generate(priority=-(2**31)), "priority", "priority=-2147483648 is outside [-100, 100]"),
    "priority_high": (generate(priority=101), "priority", "priority=101 is outside [-100, 100]"),
    "request_id_newline": (
        generate(request_id="ok\n2099-01-01 00:00:00,000 INFO spindle: forged"),
        "request_id",
        "printable characters (no newlines or other control characters)",
    ),
    "request_id_escape": (generate(request_id="ok\x1b[2K"), "request_id", "printable characters"),
    "request_id_long": (generate(request_id="x" * 257), "request_id", "give at most 256 printable characters"),
}


@pytest.fixture(scope="module")
def alone(server: ServerThread) -> list[str]:
    """The ordinary streams' texts, run with nothing beside them."""
    with server.client(timeout=120) as client:
        return texts(ordinary_streams(client))


def over_grpc(client: SpindleClient, request: dict) -> grpc.RpcError:
    params = dict(request["params"])
    if "structured_output" in params:
        params["structured_output"] = spindle_pb2.StructuredOutput(**params["structured_output"])
    if request["rpc"] == "chat":
        return refusal(lambda: client.chat(request["messages"], tools=request["tools"], **params))
    return refusal(
        lambda: client.generate(
            request["prompt"], request.get("request_id", ""), priority=request.get("priority", 0), **params
        )
    )


def over_python(server: ServerThread, request: dict) -> InvalidRequestError:
    def call() -> None:
        params = dict(request["params"])
        if "structured_output" in params:
            params["structured_output"] = StructuredOutput(**params["structured_output"])
        if request["rpc"] == "chat":
            stream = server.engine.chat(request["messages"], SamplingParams(**params), tools=request["tools"])
        else:
            stream = server.engine.generate(
                request["prompt"],
                SamplingParams(**params),
                request.get("request_id"),
                priority=request.get("priority", 0),
            )
        server.run(first(stream))

    with pytest.raises(InvalidRequestError) as error:
        call()
    return error.value


async def first(stream) -> None:
    async for _ in stream:
        return


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_field_is_invalid_argument_naming_it_and_costs_nothing_else(client, server, alone, case):
    request, field, message = HOSTILE[case]
    beside = ordinary_streams(client)
    assert_invalid(over_grpc(client, request), [field], message)
    error = over_python(server, request)
    assert error.fields == (field,) and message in str(error)
    assert texts(beside) == alone
    settled_info(client)


def test_a_request_id_cannot_forge_a_line_of_the_server_log(chat_model_dir, tmp_path, private_tmp):  # noqa: F811
    log = tmp_path / "serve.log"
    forged = "2099-01-01 00:00:00,000 INFO spindle.frontend: forged"
    with serve_logging_to(log, chat_model_dir, "text") as client:
        for request_id in (f"a\n{forged}", f"b\r\n{forged}", f"c\u2028{forged}", f"d\x85{forged}"):
            error = refusal(lambda request_id=request_id: client.generate("hi", request_id, max_tokens=2))
            assert_invalid(error, ["request_id"], "printable characters")
        collect(client.generate("hi", "ünïcode id ok", max_tokens=2))
    lines = log.read_text().splitlines()
    record = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")
    assert all(record.match(line) or line.startswith(" ") for line in lines), lines
    assert not any(line.startswith(forged) for line in lines)
    # The server scopes a caller's id to its connection: "<caller>-<id>".
    assert any(line.endswith("-ünïcode id ok]") and "Request finished" in line for line in lines)
