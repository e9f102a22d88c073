"""The OpenAI-compatible API on ``--http-port``, driven by OpenAI's own SDK, against the same server's gRPC answers."""

import base64
import json
import struct
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from test_grpc import ServerThread, collect, tiny_config
from test_lora_api import model_dir, save_adapter  # noqa: F401 - model_dir: a fixture
from waiting import wait_until

from spindle.frontend.engine.connection import start_backend
from spindle.frontend.http.app import _ChatShaper
from spindle.frontend.processing.tools import ChatTools
from spindle.shared import CompletionOutput, FinishReason, SamplingParams, ToolCall

KEY = "http-test-key"
GREEDY = {"temperature": 0.0, "max_tokens": 12}
IGNORE_EOS = {"ignore_eos": True}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "What is the weather?"}]
EOS_TEXT = ["#"]
"""The tiny tokenizer's eos, an ordinary byte token whose text ends a constrained reply: cut there, as a stop."""


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):  # noqa: F811 - the imported fixture
    adapter = save_adapter(model_dir, tmp_path_factory.mktemp("lora") / "sql", seed=1)
    process, address = start_backend(tiny_config(model_dir, lora_modules={"sql": str(adapter)}))
    server = ServerThread(
        address, http_port=0, api_key=KEY, max_n=4, max_tokens_limit=450, max_queued_requests=8, max_message_bytes=2**16
    )
    yield server
    server.close()
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"http://127.0.0.1:{server.server.http.port}"


@pytest.fixture(scope="module")
def api(base_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(server):
    with server.client(api_key=KEY, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.engine.info.model_name


def fetch(url: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, bytes]:
    """The status and body of a GET (or, with ``body``, a JSON POST) to the HTTP port, errors included."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def grpc_text(responses) -> str:
    return collect(responses)[0][0]["text"]


def test_completions_greedy_text_equals_grpc_generate_streamed_or_not(api, grpc_client, model):
    expected = grpc_text(grpc_client.generate("hello there", **GREEDY, **IGNORE_EOS))
    whole = api.completions.create(model=model, prompt="hello there", **GREEDY, extra_body=IGNORE_EOS)
    assert whole.object == "text_completion" and whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (12, 12 + whole.usage.prompt_tokens)
    chunks = list(
        api.completions.create(
            model=model,
            prompt="hello there",
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            extra_body=IGNORE_EOS,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_prompt_lists_and_n_give_a_choice_each(api, grpc_client, model):
    ids = [[5, 17, 99, 3], [42, 8, 120, 64, 7]]
    expected = [grpc_text(grpc_client.generate(prompt, **GREEDY, **IGNORE_EOS)) for prompt in ids]
    response = api.completions.create(model=model, prompt=ids, n=2, **GREEDY, extra_body=IGNORE_EOS)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [expected[0]] * 2 + [expected[1]] * 2
    assert response.usage.prompt_tokens == 9 and response.usage.completion_tokens == 48
    sampled = api.completions.create(model=model, prompt=["a", "b"], n=2, max_tokens=6, seed=3, stream=True)
    texts: dict[int, str] = {}
    for chunk in sampled:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == [0, 1, 2, 3]
    echoed = api.completions.create(model=model, prompt="hello there", echo=True, **GREEDY, extra_body=IGNORE_EOS)
    assert echoed.choices[0].text == "hello there" + response_text(api, model)


def response_text(api, model) -> str:
    return api.completions.create(model=model, prompt="hello there", **GREEDY, extra_body=IGNORE_EOS).choices[0].text


def test_best_of_returns_the_best_n_as_grpc_does(api, grpc_client, model):
    sampled = {"temperature": 1.0, "seed": 3, "max_tokens": 8, "n": 2}
    response = api.completions.create(model=model, prompt="hello there", best_of=4, **sampled)
    choices, _ = collect(grpc_client.generate("hello there", best_of=4, **sampled))
    assert [c.text for c in response.choices] == [choices[i]["text"] for i in range(2)]


def test_logprobs_in_completions_and_chat(api, model):
    response = api.completions.create(model=model, prompt="hello", logprobs=2, **GREEDY, extra_body=IGNORE_EOS)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text and len(logprobs.tokens) == 12
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert value <= 0 and top[token] == pytest.approx(value) and max(top.values()) == pytest.approx(value)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[-1] == len(response.choices[0].text) - len(token)
    chat = api.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 12
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_a_stop_string_ends_the_text_and_is_reported(api, model):
    text = response_text(api, model)
    stop = text[4:6]
    response = api.completions.create(model=model, prompt="hello there", stop=[stop], **GREEDY)
    choice = response.choices[0]
    assert choice.text == text[: text.index(stop)] and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_chat_greedy_text_equals_grpc_chat_streamed_or_not(api, grpc_client, model):
    expected = grpc_text(grpc_client.chat(MESSAGES, **GREEDY, **IGNORE_EOS))
    whole = api.chat.completions.create(model=model, messages=MESSAGES, **GREEDY, extra_body=IGNORE_EOS)
    assert whole.object == "chat.completion" and whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 12
    stream = api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        n=2,
        max_completion_tokens=12,
        temperature=0.0,
        extra_body=IGNORE_EOS,
    )
    chunks = list(stream)
    assert [c.delta.role for c in chunks[0].choices] == ["assistant", "assistant"]
    for index in (0, 1):
        deltas = [c for chunk in chunks[1:] for c in chunk.choices if c.index == index]
        assert "".join(d.delta.content or "" for d in deltas) == expected
        assert deltas[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_gives_tool_calls_whose_arguments_validate(api, model, stream):
    # A named choice constrains the reply to the tool's arguments ("required", to an array of calls of a length
    # that a random model does not bound).
    request = {
        "model": model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 60,
        "stop": EOS_TEXT,
    }
    if stream:
        deltas = [c for chunk in api.chat.completions.create(**request, stream=True) for c in chunk.choices]
        fragments = [call for d in deltas for call in d.delta.tool_calls or []]
        finish = deltas[-1].finish_reason
        assert not any(d.delta.content for d in deltas)
        # The head (index, id, name), then the arguments as they are written, as OpenAI's SDK accumulates them.
        assert fragments[0].id and all(f.index == 0 and f.id is None for f in fragments[1:])
        name, call_id = fragments[0].function.name, fragments[0].id
        arguments = "".join(f.function.arguments for f in fragments)
    else:
        choice = api.chat.completions.create(**request).choices[0]
        [call], finish = choice.message.tool_calls, choice.finish_reason
        name, call_id, arguments = call.function.name, call.id, call.function.arguments
        assert choice.message.content is None
    assert finish == "tool_calls" and name == "get_weather" and call_id.startswith("call_")
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("parallel, expected", [(None, ["a", "b"]), (1, ["a"])])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, expected):
    calls = [ToolCall("call_1", "a", "{}"), ToolCall("call_2", "b", "{}")]
    reply = CompletionOutput(0, "[...]", [1, 2], finish_reason=FinishReason.STOP, tool_calls=calls)
    tools = ChatTools.from_request([{"name": "a"}, {"name": "b"}], "auto", SamplingParams())
    shaper = _ChatShaper("chatcmpl-1", "m", SamplingParams(), 0, tools, max_calls=parallel)
    streamed = shaper.part(0, reply, None)
    assert [call["function"]["name"] for call in streamed["delta"]["tool_calls"]] == expected
    message = shaper.response()["choices"][0]["message"]
    assert [call["function"]["name"] for call in message["tool_calls"]] == expected and message["content"] is None


@pytest.mark.parametrize("parse_tools", [False, True], ids=["streamed", "held-for-tools"])
def test_reasoning_content_comes_beside_the_content_as_vllm_gives_it(parse_tools):
    """Deltas (``--reasoning-parser``: thoughts, then the answer) become ``reasoning_content`` and ``content``."""
    pieces = [("Two and ", ""), ("two is four.", ""), (None, "Four"), (None, ".")]
    tools = ChatTools.from_request([{"name": "a"}], "auto", SamplingParams()) if parse_tools else None
    shaper = _ChatShaper("chatcmpl-1", "m", SamplingParams(), 0, tools)
    streamed = []
    for i, (thoughts, text) in enumerate(pieces):
        ending = FinishReason.STOP if i == len(pieces) - 1 else None
        delta = shaper.part(0, CompletionOutput(0, text, [i], finish_reason=ending, reasoning_content=thoughts), None)
        if delta is not None:
            streamed.append(delta["delta"])
    if parse_tools:  # held until the reply ends: one delta with all of it
        assert streamed == [{"reasoning_content": "Two and two is four.", "content": "Four."}]
    else:
        assert [d.get("reasoning_content") for d in streamed] == ["Two and ", "two is four.", None, None]
        assert "".join(d["content"] for d in streamed) == "Four."
    message = shaper.response()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two and two is four.", "Four.")


def test_response_format_json_schema_output_validates(api, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    response = api.chat.completions.create(
        model=model, messages=MESSAGES, response_format=response_format, max_tokens=60, seed=1, stop=EOS_TEXT
    )
    jsonschema.validate(json.loads(response.choices[0].message.content), WEATHER)
    # Any JSON object: the random model writes one string key for ever, and max_tokens would cut it; the object
    # closes in time instead, unless close_at_max_tokens is false.
    any_object = {"messages": MESSAGES, "response_format": {"type": "json_object"}, "max_tokens": 12, "temperature": 0}
    closed = api.chat.completions.create(model=model, **any_object).choices[0].message.content
    assert isinstance(json.loads(closed.removesuffix(EOS_TEXT[0])), dict)
    cut = api.chat.completions.create(model=model, **any_object, extra_body={"close_at_max_tokens": False})
    assert cut.choices[0].message.content.startswith('{"') and cut.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="needs a response_format") as caught:
        api.chat.completions.create(model=model, messages=MESSAGES, extra_body={"close_at_max_tokens": False})
    assert caught.value.param == "close_at_max_tokens"


def test_embeddings_equal_grpc_embed_as_floats_or_base64(api, grpc_client, model):
    inputs = ["The quick brown fox", "jumps"]
    expected = [list(e.values) for e in grpc_client.embed(inputs).embeddings]
    floats = api.embeddings.create(model=model, input=inputs, encoding_format="float")
    assert [d.embedding for d in floats.data] == [pytest.approx(values, abs=1e-6) for values in expected]
    assert floats.usage.prompt_tokens == sum(len(text) for text in inputs)  # one byte-level token per character
    raw = api.embeddings.with_raw_response.create(model=model, input=[5, 6, 7], encoding_format="base64")
    encoded = json.loads(raw.text)["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(base64.b64decode(encoded)) // 4}f", base64.b64decode(encoded))
    assert list(decoded) == pytest.approx(list(grpc_client.embed([5, 6, 7]).embeddings[0].values), abs=1e-6)


def test_models_list_the_adapter_and_model_chooses_it(api, grpc_client, model):
    listed = {m.id: m for m in api.models.list().data}
    assert set(listed) == {model, "sql"} and listed["sql"].model_extra["parent"] == model
    expected = grpc_text(grpc_client.generate("hello there", lora_name="sql", **GREEDY, **IGNORE_EOS))
    response = api.completions.create(model="sql", prompt="hello there", **GREEDY, extra_body=IGNORE_EOS)
    assert response.choices[0].text == expected != response_text(api, model)


def test_errors_are_openai_shaped(api, base_url, model):
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt="hi", temperature=-1.0)
    assert caught.value.param == "temperature" and "temperature" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=30)
    assert caught.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model=model, prompt="hi", n=5)  # the server's max_n is 4
    assert caught.value.param == "n"
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="no-such-adapter", prompt="hi")
    assert caught.value.code == "model_not_found" and caught.value.param == "model"
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    status, body = fetch(f"{base_url}/v1/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"
    status, body = fetch(f"{base_url}/v1/completions", json.dumps({"prompt": "hi", "bogus": 1}).encode())
    assert status == 400 and json.loads(body)["error"]["param"] == "bogus"
    status, body = fetch(f"{base_url}/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["message"]
    assert fetch(f"{base_url}/v1/completions", b" " * 2**17)[0] == 413


def test_a_full_queue_is_a_rate_limit_error(api, server, model):
    control = server.server.servicer.admission_control
    with control.admit(control.max_queued_requests):  # the queue is full: nothing more waits
        with pytest.raises(openai.RateLimitError) as caught:
            api.completions.create(model=model, prompt="hi", max_tokens=2)
    assert caught.value.code == "rate_limit_exceeded"
    assert api.completions.create(model=model, prompt="hi", max_tokens=2).choices


def test_health_and_metrics_need_no_key(base_url, server):
    assert fetch(f"{base_url}/health", key=None)[0] == 200
    status, metrics = fetch(f"{base_url}/metrics", key=None)
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "spindle:"):
        assert name.encode() in metrics
    control = server.server.servicer.admission_control
    control.draining = True
    try:
        assert fetch(f"{base_url}/health", key=None)[0] == 503
    finally:
        control.draining = False


def test_a_client_that_disconnects_mid_stream_aborts_its_request(base_url, server, model):
    engine = server.engine
    # A client of its own, closed with its connection (a pooled connection may outlive one closed stream).
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60) as leaving:
        stream = leaving.completions.create(
            model=model, prompt="hello there", max_tokens=400, temperature=0.0, stream=True, extra_body=IGNORE_EOS
        )
        assert next(iter(stream)).choices and engine.output_processor.requests

    def freed() -> bool:
        stats = server.run(engine.get_stats())
        idle = not engine.output_processor.requests and not stats.num_running
        return idle and stats.num_free_blocks == stats.num_total_blocks

    wait_until(freed, "the request is aborted and its KV blocks are free", timeout=30)
