"""``spindle serve``'s vLLM-style options: served model names, a chat template, generation-config defaults, and a
speculation default, each through a real server (gRPC, the vLLM protocol and HTTP) over one tiny backend."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import grpc
import jinja2
import msgspec
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from test_data_parallel import serve_args
from test_grpc import ServerThread, backend_of, collect

from spindle import LLM
from spindle.frontend.grpc.args import ServerConfig, server_config_from_args
from spindle.frontend.grpc.mapping import sampling_params_from_proto
from spindle.frontend.grpc.server import GrpcServer
from spindle.shared import SamplingParams
from spindle.v1 import spindle_pb2

GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 5}
"""What the model's ``generation_config.json`` adds: greedy, 5 tokens (transformers' own fields stay)."""
FILE_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
INLINE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
SERVERS = {
    "named": {"served_model_name": ["alpha", "beta"], "http_port": 0},  # and FILE_TEMPLATE from a file
    "vllm": {"generation_config": "vllm", "chat_template": INLINE_TEMPLATE},
    "override": {"override_generation_config": '{"max_new_tokens": 3}'},
    "speculative": {"num_speculative_tokens": 4},
}
"""The frontends over the one backend, by name, with their ``ServerConfig`` settings."""
PROMPT = "ab" * 16
"""A prompt that repeats itself, so that prompt lookup finds drafts at once."""


@pytest.fixture(scope="module")
def model_dir(tiny_llm_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("generation-config")
    shutil.copytree(tiny_llm_dir, path, dirs_exist_ok=True)
    file = path / "generation_config.json"
    saved = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps(saved | GENERATION_CONFIG))
    return path


@pytest.fixture(scope="module")
def backend(model_dir):
    with backend_of(model_dir, adaptive_drafts=False) as address:  # every draft verified, whatever the step times
        yield address


@pytest.fixture(scope="module")
def servers(backend, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(FILE_TEMPLATE)
    settings = SERVERS | {"named": SERVERS["named"] | {"chat_template": str(template)}}
    started = {}
    try:
        for name, config in settings.items():
            started[name] = ServerThread(backend, **config)
        yield started
    finally:
        for server in started.values():
            server.close()


def token_ids(server: ServerThread, prompt: str = "hello", **params) -> list[int]:
    """The token ids of one completion of ``prompt`` (never cut by the eos) on ``server``."""
    with server.client(timeout=60) as client:
        choices, _ = collect(client.generate(prompt, ignore_eos=True, **params))
    return choices[0]["token_ids"]


def defaults_json(server: ServerThread) -> dict:
    with server.client(timeout=30) as client:
        return json.loads(client.model_info().default_sampling_params_json)


def test_the_generation_config_sets_the_defaults_and_a_requests_own_values_win(servers):
    named, plain = servers["named"], servers["vllm"]
    assert token_ids(named) == token_ids(plain, temperature=0, max_tokens=5)
    greedy = token_ids(plain, temperature=0, max_tokens=8)
    assert token_ids(named, max_tokens=8) == greedy
    sampled = token_ids(named, temperature=1.0, seed=3, max_tokens=8)
    assert sampled == token_ids(plain, temperature=1.0, seed=3, max_tokens=8) != greedy


@pytest.mark.parametrize(
    ("name", "length", "defaults"),
    [
        ("named", 5, {"temperature": 0.0, "max_tokens": 5}),
        ("vllm", 16, {}),  # the file ignored: SamplingParams' own 16 tokens, sampled
        ("override", 3, {"temperature": 0.0, "max_tokens": 3}),
        ("speculative", 5, {"temperature": 0.0, "max_tokens": 5, "num_speculative_tokens": 4}),
    ],
)
def test_each_server_reports_and_applies_its_defaults(servers, name, length, defaults):
    assert defaults_json(servers[name]) == defaults
    tokens = token_ids(servers[name])
    assert len(tokens) == length
    if defaults.get("temperature") == 0.0:
        assert tokens == token_ids(servers["vllm"], temperature=0, max_tokens=length)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"override_generation_config": "{temperature: 1}"}, "is not JSON"),
        ({"override_generation_config": "[1]"}, "must be a JSON object"),
        ({"override_generation_config": '{"temprature": 1}'}, "'temprature', which is not a default it can set"),
        ({"override_generation_config": '{"temperature": -1}'}, "temperature=-1.0 is invalid"),
        ({"override_generation_config": '{"top_k": "many"}'}, r"Expected `int`, got `str` - at `\$.top_k`"),
        ({"generation_config": "/no/such/dir"}, "there is no /no/such/dir/generation_config.json"),
        ({"chat_template": "templates/missing.jinja"}, "is no file, and it does not look like a jinja2 template"),
        ({"chat_template": "{% if %}"}, "does not parse as jinja2"),
        ({"num_speculative_tokens": 17}, r"num_speculative_tokens=17 must be in \[0, 16\]"),
        ({"served_model_name": [" "]}, "must be one or more non-empty names"),
    ],
)
def test_bad_settings_are_refused_before_a_backend_starts(settings, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**settings)


def test_spindle_serve_exits_with_the_message_before_starting_a_backend():
    command = [sys.executable, "-m", "spindle.cli", "serve", "--override-generation-config", '{"temperature": -1}']
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "spindle serve: the generation config's defaults" in done.stderr
    assert "temperature=-1.0 is invalid" in done.stderr


@pytest.mark.parametrize(
    ("generation_config", "settings", "message"),
    [
        ({"temperature": "hot"}, {}, r"Expected `float`, got `str` - at `\$.temperature`"),
        ({"top_p": 1.5}, {}, "top_p=1.5 is invalid"),
        ({"max_new_tokens": 100}, {"max_tokens_limit": 50}, "max_new_tokens=100 is above --max-tokens-limit=50"),
    ],
)
def test_a_bad_value_in_the_models_generation_config_stops_the_start(servers, generation_config, settings, message):
    """The model's file comes with the backend's handshake: an engine whose handshake carries a bad one."""
    engine = servers["vllm"].engine
    files = engine.info.tokenizer_files | {"generation_config.json": json.dumps(generation_config).encode()}
    handshake = SimpleNamespace(info=msgspec.structs.replace(engine.info, tokenizer_files=files))
    with pytest.raises(ValueError, match=message):
        GrpcServer(handshake, ServerConfig(port=0, **settings))


def test_served_model_names_in_both_protocols_model_infos(servers):
    named, plain = servers["named"], servers["vllm"]
    with named.client(timeout=30) as client:
        info = client.model_info()
    assert (info.model_name, list(info.served_model_names)) == ("alpha", ["alpha", "beta"])
    with plain.client(timeout=30) as client:
        info = client.model_info()
    model = plain.engine.info.model_name  # the default: the model's own name, as before
    assert (info.model_name, list(info.served_model_names)) == (model, [model])
    with grpc.insecure_channel(named.address) as channel:
        vllm_info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetModelInfo(vllm_engine_pb2.GetModelInfoRequest())
    assert vllm_info.served_model_name == "alpha" and vllm_info.model_path == model
    assert json.loads(vllm_info.default_sampling_params_json) == {"temperature": 0.0, "max_tokens": 5}


@pytest.fixture(scope="module")
def api(servers):
    base_url = f"http://127.0.0.1:{servers['named'].server.http.port}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_http_lists_the_served_names_and_answers_to_them_only(api, servers):
    assert [m.id for m in api.models.list().data] == ["alpha", "beta"]
    response = api.completions.create(model="beta", prompt="hello", extra_body={"ignore_eos": True})
    assert response.model == "beta" and response.usage.completion_tokens == 5  # the generation config's default
    expected = servers["named"].engine.tokenizer.decode(token_ids(servers["vllm"], temperature=0, max_tokens=5))
    assert response.choices[0].text == expected
    short = api.completions.create(model="alpha", prompt="hello", max_tokens=2, extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 2
    for model in (servers["named"].engine.info.model_name, "gamma"):
        with pytest.raises(openai.NotFoundError) as caught:
            api.completions.create(model=model, prompt="hello")
        assert caught.value.code == "model_not_found" and caught.value.param == "model"


def test_http_chat_takes_the_default_max_tokens_and_the_chat_template(api):
    response = api.chat.completions.create(model="alpha", messages=MESSAGES, extra_body={"ignore_eos": True})
    rendered = jinja2.Template(FILE_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    assert response.usage.completion_tokens == 5
    assert response.usage.prompt_tokens == len(rendered.encode())  # the byte-level tokenizer: a token a byte


@pytest.mark.parametrize(("name", "template"), [("named", FILE_TEMPLATE), ("vllm", INLINE_TEMPLATE)])
def test_a_chat_template_from_a_file_or_inline_renders_the_chat_prompt(servers, name, template):
    rendered = jinja2.Template(template).render(messages=MESSAGES, add_generation_prompt=True)
    assert servers[name].engine.tokenizer.apply_chat_template(MESSAGES) == rendered
    with servers[name].client(timeout=60) as client:
        assert client.model_info().has_chat_template
        _, messages = collect(client.chat(MESSAGES, temperature=0, max_tokens=2))
    assert messages[-1].usage.prompt_tokens == len(rendered.encode())


def test_a_model_without_a_chat_template_still_has_none(servers):
    with servers["override"].client(timeout=30) as client:
        assert not client.model_info().has_chat_template


def test_the_speculation_default_reaches_requests_that_leave_it_unset(servers):
    """Greedy output is the same with drafts as without; drafts are verified only where the default or the request
    asks for them (a request may turn them off with 0)."""
    speculative, plain = servers["speculative"], servers["vllm"]

    def drafts() -> int:  # the backend's count, as of its next step or heartbeat: after the request before
        return speculative.run(speculative.engine.get_stats()).num_draft_tokens

    params = {"temperature": 0, "max_tokens": 24}
    before = drafts()
    tokens = token_ids(speculative, PROMPT, **params)
    drafted = drafts()
    assert drafted > before
    assert token_ids(plain, PROMPT, **params) == tokens and drafts() == drafted
    assert token_ids(speculative, PROMPT, num_speculative_tokens=0, **params) == tokens and drafts() == drafted


@pytest.mark.parametrize(
    ("fields", "defaults", "expected"),
    [
        ({}, {"top_k": 5, "temperature": 0.0}, {"top_k": 5, "temperature": 0.0}),
        ({"top_k": -1, "temperature": 1.0}, {"top_k": 5, "temperature": 0.0}, {"top_k": -1, "temperature": 1.0}),
        ({"top_k": 0, "min_p": 0.0}, {"top_k": 5, "min_p": 0.1}, {"top_k": 5, "min_p": 0.1}),  # no presence
        ({"num_speculative_tokens": 0}, {"num_speculative_tokens": 4}, {"num_speculative_tokens": 0}),
        ({"max_tokens": 9}, {"max_tokens": 5, "repetition_penalty": 1.2}, {"max_tokens": 9, "repetition_penalty": 1.2}),
    ],
)
def test_unset_proto_fields_take_the_defaults(fields, defaults, expected):
    params = sampling_params_from_proto(spindle_pb2.SamplingParams(**fields), defaults)
    assert params == SamplingParams(**expected)


def test_the_serve_flags_set_the_server_config():
    args = serve_args(
        "--served-model-name", "alpha", "beta", "--generation-config", "vllm", "--num-speculative-tokens", "2",
        "--override-generation-config", '{"top_k": 3}', "--chat-template", "{{ messages }}",
    )  # fmt: skip
    config = server_config_from_args(args)
    assert config.served_model_name == ["alpha", "beta"] and config.generation_config == "vllm"
    assert (config.num_speculative_tokens, config.override_generation_config) == (2, '{"top_k": 3}')
    assert config.chat_template == "{{ messages }}"


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, SamplingParams(temperature=0.0, max_tokens=5)),
        ({"generation_config": "vllm"}, SamplingParams()),
        (
            {"override_generation_config": {"max_new_tokens": 2, "top_p": 0.5}},
            SamplingParams(temperature=0.0, top_p=0.5, max_tokens=2),
        ),
    ],
)
def test_llm_default_sampling_params_are_the_generation_configs(model_dir, settings, expected):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB", **settings)
    try:
        assert llm.get_default_sampling_params() == expected
        if expected.temperature == 0:  # greedy: the call without parameters takes the same tokens
            unset, given = (llm.generate("hello", params, use_tqdm=False)[0].outputs[0] for params in (None, expected))
            assert unset.token_ids == given.token_ids
    finally:
        llm.shutdown()
