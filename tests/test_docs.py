"""The docs: built as CI builds them (a venv with only docs/requirements.txt, -W), complete, and their examples run.

The build runs ``docs/build_docs.py``, which keeps its venv under the git-ignored ``docs/_build/venv`` and rebuilds
it only when the requirements change, so after the first run this module costs one Sphinx build (html + doctest).
"""

import contextlib
import html
import importlib.util
import inspect
import io
import re
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

from protoparse import parse_proto  # noqa: E402 - docs/_ext is not a package


def _load_build_docs():
    spec = importlib.util.spec_from_file_location("build_docs", DOCS / "build_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("docs")
    _load_build_docs().build(outdir)  # raises on any warning or failed doctest
    return outdir


def _normalize(text: str) -> str:
    """Collapse whitespace and undo what Sphinx adds: smart quotes, ``()`` after function references."""
    text = text.replace("\u2019", "'").replace("\u201c", '"').replace("\u201d", '"').replace("()", "")
    # Tags become spaces in _text, so drop the spaces that inline markup leaves next to punctuation.
    return re.sub(r"\( | (?=[).,;:])", lambda m: m[0].strip(), " ".join(text.split()))


def _text(path: Path) -> str:
    """The page's visible text, normalized."""
    return _normalize(html.unescape(re.sub(r"<[^>]+>", " ", path.read_text())))


def _engine_class(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


ENGINE_PAGES = [
    (
        "api.html",
        "spindle.frontend.engine.llm.LLM",
        ["generate", "chat", "embed", "beam_search", "get_tokenizer", "get_default_sampling_params", "shutdown"],
    ),
    (
        "llm_engine.html",
        "spindle.frontend.engine.llm_engine.LLMEngine",
        [
            "from_args",
            "add_request",
            "add_chat_request",
            "abort_request",
            "step",
            "has_unfinished_requests",
            "load_lora",
            "unload_lora",
            "list_loras",
            "kv_cache_report",
        ],
    ),
    (
        "async_engine.html",
        "spindle.frontend.engine.async_llm_engine.AsyncLLMEngine",
        ["from_args", "generate", "chat", "embed", "abort", "load_lora", "unload_lora", "list_loras"],
    ),
]


@pytest.mark.parametrize(("page", "cls", "methods"), ENGINE_PAGES)
def test_engine_pages_show_every_method_with_its_docstring(built, page, cls, methods):
    source = (built / "html" / page).read_text()
    text = _text(built / "html" / page)
    engine = _engine_class(cls)
    for method in [None, *methods]:
        anchor = cls if method is None else f"{cls}.{method}"
        assert f'id="{anchor}"' in source, f"{anchor} is not documented on {page}"
        # The docstring's first sentence, as the reader sees it (reST markup stripped).
        doc = inspect.getdoc(engine if method is None else getattr(engine, method)).split("\n\n")[0]
        # A role with ~ shows the last name of its target, literal text shows as it is.
        first = re.sub(
            r":\w+:`(~?)([^`]+)`|``([^`]+)``", lambda m: m[3] or (m[2].split(".")[-1] if m[1] else m[2]), doc
        )
        assert _normalize(first) in text, f"{anchor}'s docstring is missing from {page}"


@pytest.mark.parametrize(("page", "cls", "methods"), ENGINE_PAGES)
def test_engine_pages_take_their_signatures_from_the_code(built, page, cls, methods):
    """Each method's rendered signature names every parameter it has, and the page's prose writes none by hand
    (a hand-written ``add_request(...)`` lost ``priority`` and ``lora_request`` once)."""
    source = (built / "html" / page).read_text()
    engine = _engine_class(cls)
    for method in methods:
        function = getattr(engine, method)
        if isinstance(function, property):
            continue
        signature = re.search(rf'<dt class="sig[^"]*" id="{re.escape(cls)}\.{method}">(.*?)</dt>', source, re.S)
        assert signature is not None, f"{cls}.{method} has no rendered signature on {page}"
        shown = html.unescape(re.sub(r"<[^>]+>", "", signature[1]))
        for name in inspect.signature(function).parameters:
            assert name in ("self", "cls") or re.search(rf"\b{name}\b", shown), f"{method}'s {name} is not shown"
    prose = (DOCS / page.replace(".html", ".rst")).read_text()
    written = re.findall(rf"``({'|'.join(methods)})\([^`]+\)``", prose)
    assert not written, f"{page} writes signatures by hand: {written}"


def test_step_diagram_is_rendered_with_the_two_prompt_example(built):
    page = (built / "html" / "llm_engine.html").read_text()
    images = re.findall(r'<object data="(_images/graphviz-[0-9a-f]+\.svg)"', page)
    svgs = [(built / "html" / image).read_text() for image in images]
    step = [svg for svg in svgs if "Scheduler.schedule()" in svg]
    assert len(step) == 1, "the step() diagram is not on the LLMEngine page"
    stages = ("SchedulerOutput", "ModelRunner.execute()", "3. Sampler", "Scheduler.update_from_output()", "6. outputs")
    for stage in stages:
        assert stage in html.unescape(step[0]), stage


def test_doctests_ran_and_passed(built):
    report = (built / "doctest" / "output.txt").read_text()
    ran = int(re.search(r"^\s*(\d+) tests", report, re.MULTILINE)[1])
    assert ran >= 10 and re.search(r"^\s*0 failures in tests", report, re.MULTILINE), report


def test_grpc_reference_lists_every_service_message_and_field(built):
    text = _text(built / "html" / "grpc.html")
    protos = sorted((DOCS.parent / "protos").rglob("*.proto"))
    if not protos:
        assert "No .proto files under ../protos yet" in text
        return
    for path in protos:
        proto = parse_proto(path.read_text(), path.name)
        names = [f"service {s.name}" for s in proto.services] + [r.name for s in proto.services for r in s.rpcs]
        names += [f"message {m.name}" for m in proto.messages] + [f.name for m in proto.messages for f in m.fields]
        names += [f"enum {e.name}" for e in proto.enums]
        assert [name for name in names if name not in text] == [], path


SAMPLE_PROTO = """
// Spindle's public API.

syntax = "proto3";
package spindle.v1;
import "google/protobuf/empty.proto";
option go_package = "x/y;v1";

// Generates text.
service Generation {
  // Streams tokens as they come.
  rpc Generate(GenerateRequest) returns (stream GenerateResponse);
  rpc Health(google.protobuf.Empty) returns (HealthResponse) { option deprecated = true; }
  rpc Chat(stream ChatMessage) returns (stream GenerateResponse) {}
}

/* A request.
 * Two lines. */
message GenerateRequest {
  string request_id = 1;  // Client-chosen id.
  oneof input {
    string text = 2;
    TokenIds token_ids = 3;
  }
  map<int32, float> logit_bias = 4 [deprecated = true];
  repeated string stop = 5;
  optional uint32 seed = 0x6;
  reserved 7, 8 to 10;
  message TokenIds { repeated uint32 ids = 1; }
  enum Kind { KIND_UNSPECIFIED = 0; KIND_TEXT = 1; // Text.
  }
}
message GenerateResponse {}
message HealthResponse { Status status = 1; }
message ChatMessage { string content = 1; }
enum Status {
  option allow_alias = true;
  STATUS_UNSPECIFIED = 0;
  // Serving.
  SERVING = 1;
}
"""


def test_proto_parser_reads_services_messages_fields_enums_and_comments():
    proto = parse_proto(SAMPLE_PROTO)
    assert (proto.package, proto.doc) == ("spindle.v1", "Spindle's public API.")
    [service] = proto.services
    assert (service.name, service.doc) == ("Generation", "Generates text.")
    assert [(r.name, r.request, r.response, r.client_streaming, r.server_streaming, r.doc) for r in service.rpcs] == [
        ("Generate", "GenerateRequest", "GenerateResponse", False, True, "Streams tokens as they come."),
        ("Health", "google.protobuf.Empty", "HealthResponse", False, False, ""),
        ("Chat", "ChatMessage", "GenerateResponse", True, True, ""),
    ]
    messages = {m.name: m for m in proto.messages}
    assert list(messages) == [
        "GenerateRequest",
        "GenerateRequest.TokenIds",
        "GenerateResponse",
        "HealthResponse",
        "ChatMessage",
    ]
    request = messages["GenerateRequest"]
    assert request.doc == "A request.\nTwo lines."
    assert [(f.name, f.type, f.number, f.label, f.doc) for f in request.fields] == [
        ("request_id", "string", 1, "", "Client-chosen id."),
        ("text", "string", 2, "oneof input", ""),
        ("token_ids", "TokenIds", 3, "oneof input", ""),
        ("logit_bias", "map<int32, float>", 4, "", ""),
        ("stop", "string", 5, "repeated", ""),
        ("seed", "uint32", 6, "optional", ""),
    ]
    enums = {e.name: e.values for e in proto.enums}
    assert enums == {
        "GenerateRequest.Kind": [("KIND_UNSPECIFIED", 0, ""), ("KIND_TEXT", 1, "Text.")],
        "Status": [("STATUS_UNSPECIFIED", 0, ""), ("SERVING", 1, "Serving.")],
    }


@pytest.mark.parametrize(
    ("example", "expected"),
    [
        ("offline.py", ["'Hello, my name is' ->", "refused: this model takes text only"]),
        ("engine_steps.py", ["capital: ", "finished=True", "unfinished: 0"]),
        ("async_stream.py", ["first: +", "doomed: cancelled", "long: abort"]),
    ],
)
def test_examples_run(example, expected, tiny_llm_dir, monkeypatch):
    """Run each example file the docs include, verbatim, on the tiny random model instead of the embedded one.

    The examples build their engines with the embedded SmolLM2, which costs ~25 s to load and generate per example
    on a 2-core machine; only the model's default changes here (for a backend child process too, through its config).
    """
    from spindle.shared.config import EngineConfig

    def tiny_config(model: str | None = None, **kwargs: object) -> EngineConfig:
        return EngineConfig.of(model=model or str(tiny_llm_dir), **kwargs)

    for module in (
        "spindle.frontend.engine.llm",
        "spindle.frontend.engine.llm_engine",
        "spindle.frontend.engine.async_llm_engine",
    ):
        monkeypatch.setattr(f"{module}.EngineConfig", SimpleNamespace(of=tiny_config))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        runpy.run_path(str(DOCS / "examples" / example), run_name="__main__")
    for text in expected:
        assert text in stdout.getvalue(), stdout.getvalue()
