"""The LoRA API: start-up adapters, the runtime RPCs and their directory confinement, ``lora_name``, ``lora_request``.

The adapters are small PEFT adapters of the tiny random Llama, with ``lora_B`` drawn at random (PEFT starts it at
zero, which would change nothing), so that generating with one changes the tokens.
"""

import shutil
from pathlib import Path

import grpc
import pytest
from test_grpc import LONG, ServerThread, assert_invalid, collect, refusal, tiny_config, violated_fields
from test_process_split import run_engine, settled_stats
from waiting import wait_until

from spindle import LLM, LLMEngine, LoRARequest, RequestOutput, SamplingParams
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.grpc.servicer import RuntimeLoraDisabledError, status_for
from spindle.shared.errors import AlreadyExistsError, InvalidRequestError, NotFoundError, ResourceExhaustedError
from spindle.shared.lora import confine_adapter_path
from spindle.v1 import spindle_pb2

RANK = 8
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj"}
PROMPT = "The adapter says"


def save_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """Save a rank-``RANK`` PEFT adapter of the model in ``base_dir`` to ``out``, its weights drawn with ``seed``."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=sorted(TARGETS)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template, so that ``Chat`` and ``LLM.chat`` take conversations."""
    path = tmp_path_factory.mktemp("tiny-chat")
    for file in tiny_llm_dir.iterdir():
        shutil.copy(file, path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    return path


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``adapters/`` (the server's lora_dir: ``sql``, ``chat``, a link ``alias`` to ``sql``, a link ``escape`` out of
    it) and, beside it, ``outside/evil``: a valid adapter that no RPC may load.
    """
    base = tmp_path_factory.mktemp("lora")
    save_adapter(model_dir, base / "adapters" / "sql", seed=1)
    save_adapter(model_dir, base / "adapters" / "chat", seed=2)
    save_adapter(model_dir, base / "outside" / "evil", seed=3)
    (base / "adapters" / "alias").symlink_to(base / "adapters" / "sql")
    (base / "adapters" / "escape").symlink_to(base / "outside" / "evil")
    return base


@pytest.fixture(scope="module")
def server(model_dir: Path, adapters: Path):
    """A server whose backend loads adapters at run time from ``adapters/``, and ``sql`` at start-up."""
    lora_dir = adapters / "adapters"
    config = tiny_config(
        model_dir, allow_runtime_lora=True, lora_dir=str(lora_dir), lora_modules={"sql": str(lora_dir / "sql")}
    )
    process, address = start_backend(config)
    server = ServerThread(address)
    yield server
    server.close()
    process.terminate()
    process.wait(30)


@pytest.fixture
def client(server: ServerThread):
    with server.client(timeout=60) as client:
        yield client


def reference_tokens(model_dir: Path, lora_request: LoRARequest | None, max_tokens: int) -> list[int]:
    """Greedy tokens of ``PROMPT`` from an in-process ``LLM``: what the server must stream for the same adapter."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(PROMPT, params, use_tqdm=False, lora_request=lora_request)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "path,resolves_to",
    [
        ("sql", "sql"),
        ("{root}/sql", "sql"),
        ("alias", "sql"),  # a link that stays inside
        ("chat/../sql", "sql"),
        (".", "."),
        ("../outside/evil", None),
        ("{outside}/evil", None),
        ("escape", None),
        ("sql/../../outside/evil", None),
        ("", None),
    ],
)
def test_confine_adapter_path(tmp_path, path, resolves_to):
    root, outside = tmp_path / "adapters", tmp_path / "outside"
    for directory in (root / "sql", root / "chat", outside / "evil"):
        directory.mkdir(parents=True)
    (root / "alias").symlink_to(root / "sql")
    (root / "escape").symlink_to(outside / "evil")
    path = path.format(root=root, outside=outside)
    if resolves_to is not None:
        assert confine_adapter_path(path, str(root)) == (root / resolves_to).resolve()
        return
    with pytest.raises(InvalidRequestError) as error:
        confine_adapter_path(path, str(root))
    assert error.value.fields == ("path",)
    if str(outside) not in path:  # a caller learns nothing of where a link or '..' leads
        assert str(outside) not in str(error.value)


def test_a_lora_request_takes_vllms_positional_form_and_needs_a_name():
    assert LoRARequest("sql", 1, "/adapters/sql") == LoRARequest(
        lora_name="sql", lora_int_id=1, lora_path="/adapters/sql"
    )
    with pytest.raises(InvalidRequestError, match="lora_name is empty"):
        LoRARequest(" ", 1, "/adapters/sql")


@pytest.mark.parametrize(
    "error,code,fields",
    [
        (NotFoundError("lora_name", "no adapter 'x'"), "NOT_FOUND", ["lora_name"]),
        (AlreadyExistsError("name", "'x' is taken"), "ALREADY_EXISTS", ["name"]),
        (RuntimeLoraDisabledError("off"), "FAILED_PRECONDITION", []),
        (ResourceExhaustedError("name", "64 adapters are loaded"), "RESOURCE_EXHAUSTED", ["name"]),
    ],
    ids=["not-found", "already-exists", "runtime-off", "too-many"],
)
def test_status_for_adapter_errors(error, code, fields):
    status, message, violations = status_for(error)
    assert status == getattr(grpc.StatusCode, code) and message == str(error)
    assert [v.field for v in violations] == fields


def test_runtime_changes_are_off_unless_allowed_and_unavailable_without_a_backend(tiny_llm_dir):
    process, address = start_backend(tiny_config(tiny_llm_dir))
    server = ServerThread(address)
    try:
        with server.client(timeout=30) as client:
            for call in (lambda: client.load_lora_adapter("a", "a"), lambda: client.unload_lora_adapter("a")):
                error = refusal(call)
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
                assert "--allow-runtime-lora --lora-dir" in error.details()
            assert client.list_lora_adapters() == []
            assert_invalid(refusal(lambda: client.generate("hi", lora_name=" ")), ["lora_name"], "lora_name is empty")
            process.kill()
            error = refusal(client.list_lora_adapters)
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "backend is down" in error.details()
    finally:
        server.close()
        process.wait(10)


@pytest.mark.parametrize(
    "name,path,field",
    [
        ("x", "../outside/evil", "path"),
        ("x", "{base}/outside/evil", "path"),
        ("x", "escape", "path"),
        ("x", "sql/../../outside/evil", "path"),
        ("x", "", "path"),
        ("", "chat", "name"),
    ],
)
def test_a_load_outside_the_adapter_dir_is_invalid_argument(client, adapters, name, path, field):
    before = client.list_lora_adapters()
    error = refusal(lambda: client.load_lora_adapter(name, path.format(base=adapters)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and violated_fields(error) == [field], error.details()
    assert client.list_lora_adapters() == before


def test_loads_inside_the_adapter_dir_relative_absolute_or_through_a_link(client, adapters):
    lora_dir = adapters / "adapters"
    for name, path, target in [
        ("rel", "chat", "chat"),
        ("abs", str(lora_dir / "chat"), "chat"),
        ("link", "alias", "sql"),
    ]:
        adapter = client.load_lora_adapter(name, path)
        assert adapter.name == name and Path(adapter.path) == (lora_dir / target).resolve()
        assert adapter.rank == RANK and set(adapter.target_modules) == TARGETS
    assert {"rel", "abs", "link"} <= {adapter.name for adapter in client.list_lora_adapters()}
    for name in ("rel", "abs", "link"):
        client.unload_lora_adapter(name)
    assert {adapter.name for adapter in client.list_lora_adapters()} == {"sql"}


def test_startup_adapters_are_listed_and_names_must_exist_or_be_free(client, adapters):
    [sql] = client.list_lora_adapters()
    assert sql.name == "sql" and Path(sql.path).resolve() == (adapters / "adapters" / "sql").resolve()
    assert sql.rank == RANK and set(sql.target_modules) == TARGETS
    error = refusal(lambda: client.load_lora_adapter("sql", "chat"))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and violated_fields(error) == ["name"]
    error = refusal(lambda: client.unload_lora_adapter("ghost"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and violated_fields(error) == ["name"]
    for call in (
        lambda: client.generate(PROMPT, lora_name="ghost"),
        lambda: client.chat([{"role": "user", "content": "hi"}], lora_name="ghost"),
    ):
        error = refusal(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND and violated_fields(error) == ["lora_name"]
        assert "ghost" in error.details()


def test_adapters_come_and_go_while_streams_run(client, adapters, model_dir):
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    expected = reference_tokens(model_dir, LoRARequest("chat", 1, str(adapters / "adapters" / "chat")), 400)
    base_stream = client.generate("base", **LONG)
    next(base_stream)
    client.load_lora_adapter("live", "chat")  # while the base stream runs
    adapted, _ = collect(client.generate(PROMPT, lora_name="live", **greedy))
    base, _ = collect(client.generate(PROMPT, **greedy))
    assert adapted[0]["token_ids"] == expected[:24] != base[0]["token_ids"]
    long_stream = client.generate(PROMPT, lora_name="live", **LONG)
    first = next(long_stream)
    client.unload_lora_adapter("live")  # while a stream that uses it runs: the stream keeps it to its end
    rest, _ = collect(long_stream)
    assert list(first.choices[0].token_ids) + rest[0]["token_ids"] == expected
    assert rest[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]
    error = refusal(lambda: client.generate(PROMPT, lora_name="live"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and violated_fields(error) == ["lora_name"]
    done, _ = collect(base_stream)
    assert done[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]


def stepped_output(engine: LLMEngine, request_id: str, finished: bool) -> RequestOutput:
    """Step ``engine`` until it gives an output of request ``request_id`` (a finished one if ``finished``)."""

    def step() -> RequestOutput | None:
        return next((o for o in engine.step() if o.request_id == request_id and (o.finished or not finished)), None)

    return wait_until(step, f"request {request_id} {'finishes' if finished else 'runs'}", interval=0)


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "backend-process"])
def test_llm_loads_a_lora_request_on_first_use(model_dir, adapters, multiprocess):
    lora_dir = adapters / "adapters"
    chat, sql = (LoRARequest(name, 1, str(lora_dir / name)) for name in ("chat", "sql"))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(model_dir), multiprocess=multiprocess, dtype="float32", kv_cache_memory="4MiB")
    try:
        engine = llm.llm_engine
        assert engine.list_loras() == []
        outputs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=[chat, None, sql])
        with_chat, base, with_sql = (output.outputs[0].token_ids for output in outputs)
        assert len({tuple(with_chat), tuple(base), tuple(with_sql)}) == 3
        loaded = {adapter.name: adapter for adapter in engine.list_loras()}
        assert loaded.keys() == {"chat", "sql"} and Path(loaded["chat"].path).resolve() == (lora_dir / "chat").resolve()
        conversation = [{"role": "user", "content": PROMPT}]
        chats = [llm.chat(conversation, params, use_tqdm=False, lora_request=lora)[0] for lora in (chat, None)]
        assert chats[0].outputs[0].token_ids != chats[1].outputs[0].token_ids
        again = llm.generate(PROMPT, params, use_tqdm=False, lora_request=LoRARequest("chat"))
        assert again[0].outputs[0].token_ids == with_chat
        with pytest.raises(InvalidRequestError, match="is loaded from") as error:
            llm.generate(PROMPT, params, use_tqdm=False, lora_request=LoRARequest("chat", 1, str(lora_dir / "sql")))
        assert error.value.field == "lora_name"
        with pytest.raises(NotFoundError) as error:
            llm.generate(PROMPT, params, use_tqdm=False, lora_request=LoRARequest("ghost"))
        assert error.value.field == "lora_name"
        with pytest.raises(ValueError, match="got 2 LoRA requests for 1 prompts"):
            llm.generate(PROMPT, params, use_tqdm=False, lora_request=[chat, sql])
        assert not engine.has_unfinished_requests()
        # An adapter call while a request runs: the backend's steps that come before the reply must reach step().
        request_id = engine.add_request(None, PROMPT, params)
        stepped_output(engine, request_id, finished=False)
        if multiprocess:  # the backend runs the request to its end, as another frontend sees: all its steps come first
            run_engine(engine.client.connection.address, settled_stats)
        engine.load_lora("sql-again", str(lora_dir / "sql"))
        assert stepped_output(engine, request_id, finished=True).outputs[0].token_ids == base
        engine.unload_lora("chat")
        assert {adapter.name for adapter in engine.list_loras()} == {"sql", "sql-again"}
        with pytest.raises(NotFoundError):
            engine.unload_lora("chat")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "backend-process"])
def test_loaded_adapters_are_capped(model_dir, adapters, multiprocess):
    lora_dir = adapters / "adapters"
    llm = LLM(str(model_dir), multiprocess=multiprocess, dtype="float32", kv_cache_memory="4MiB", max_loaded_loras=2)
    try:
        engine = llm.llm_engine
        engine.load_lora("a", str(lora_dir / "sql"))
        engine.load_lora("b", str(lora_dir / "chat"))
        with pytest.raises(ResourceExhaustedError, match="2 LoRA adapters are loaded.*max_loaded_loras") as error:
            engine.load_lora("c", str(lora_dir / "chat"))
        assert error.value.fields == ("name",)
        assert {adapter.name for adapter in engine.list_loras()} == {"a", "b"}
        engine.unload_lora("a")
        engine.load_lora("c", str(lora_dir / "chat"))
        assert {adapter.name for adapter in engine.list_loras()} == {"b", "c"}
    finally:
        llm.shutdown()


def test_a_second_name_for_the_same_adapter_shares_its_weights(model_dir, adapters, tmp_path):
    lora_dir = adapters / "adapters"
    copy = shutil.copytree(lora_dir / "chat", tmp_path / "chat-copy")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="4MiB")
    try:
        engine = llm.llm_engine
        lora = engine.engine_core.runner.lora
        engine.load_lora("first", str(lora_dir / "chat"))
        engine.load_lora("copy", str(copy))  # other files, same content
        engine.load_lora("other", str(lora_dir / "sql"))
        listed = {adapter.name: Path(adapter.path) for adapter in engine.list_loras()}
        assert listed == {"first": lora_dir / "chat", "copy": copy, "other": lora_dir / "sql"}
        shared = lora.by_name["first"]
        assert lora.by_name["copy"] == shared != lora.by_name["other"] and len(lora.adapters) == 2
        first, same, other = (
            llm.generate(PROMPT, params, use_tqdm=False, lora_request=LoRARequest(name))[0].outputs[0].token_ids
            for name in ("first", "copy", "other")
        )
        assert first == same != other
        engine.unload_lora("first")  # the adapter stays for its other name
        again = llm.generate(PROMPT, params, use_tqdm=False, lora_request=LoRARequest("copy"))
        assert again[0].outputs[0].token_ids == first and len(lora.adapters) == 2
        engine.unload_lora("copy")
        assert len(lora.adapters) == 1
        engine.load_lora("fresh", str(copy))  # read anew, under a new id: its weights were dropped
        assert lora.by_name["fresh"] != shared and len(lora.adapters) == 2
    finally:
        llm.shutdown()
