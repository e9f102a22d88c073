"""The ``spindle`` command line: ``--help`` of every command, and the client commands against a real server.

The server is the LoRA API's: the tiny random Llama with a byte-level tokenizer and a chat template, adapters
loadable at run time from a directory and ``sql`` loaded at start-up. Each command's output is checked against the
same call made through :class:`~spindle.client.SpindleClient`, which the gRPC tests check against the engine.
"""

import argparse
import io
import json
import re
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict
from test_grpc import collect
from test_lora_api import adapters, model_dir, server  # noqa: F401 - fixtures

from spindle.cli import build_parser, main
from spindle.client import SpindleClient
from spindle.v1 import spindle_pb2


def command_paths(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of words to ``parser`` and to each command and subcommand below it."""
    paths = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                paths += command_paths(command, (*path, name))
    return paths


def options(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[str]:
    """The option strings that the help of the command at ``path`` lists (all but the hidden ones)."""
    for name in path:
        [subparsers] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subparsers.choices[name]
    return [
        string for action in parser._actions if action.help != argparse.SUPPRESS for string in action.option_strings
    ]


COMMANDS = command_paths(build_parser())


def test_the_parser_has_the_server_and_client_commands():
    assert {("serve",), ("backend",), ("lora", "load"), ("watch-load",), ("embed",)} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "spindle")
def test_every_command_prints_its_help(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: {' '.join(('spindle', *path))}")
    assert "{'option_strings'" not in out  # a % in a help string that argparse formatted as a directive
    assert all(option in out for option in options(build_parser(), path))


@pytest.fixture
def client(server) -> SpindleClient:  # noqa: F811 - the fixture imported above
    with server.client(timeout=60) as client:
        yield client


def spindle(server, *args: str) -> int:  # noqa: F811
    """Run ``spindle *args --address <server>`` in this process; its exit code."""
    return main([*args, "--address", server.address])


def streamed_text(responses) -> str:
    choices, _ = collect(responses)
    return choices[0]["text"]


GREEDY = ("--temperature", "0", "--max-tokens", "8")


@pytest.mark.parametrize(
    "args,stdin,conversations",
    [
        (["hi"], "", [[{"role": "user", "content": "hi"}]]),
        (
            ["hi", "--system", "be brief"],
            "",
            [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]],
        ),
        ([], "hi\n\nthere\n", [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "there"}]]),
    ],
    ids=["one-shot", "one-shot-system", "stdin"],
)
def test_chat_prints_the_replies(server, client, capsys, monkeypatch, args, stdin, conversations):  # noqa: F811
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert spindle(server, "chat", *args, *GREEDY) == 0
    replies, history = [], []
    for turn in conversations:  # each stdin turn follows the conversation so far, the earlier replies in it
        history += turn
        replies.append(streamed_text(client.chat(history, temperature=0, max_tokens=8)))
        history.append({"role": "assistant", "content": replies[-1]})
    assert all(replies) and capsys.readouterr().out == "".join(f"{reply}\n" for reply in replies)


@pytest.mark.parametrize(
    "command,prompt,sent",
    [("generate", "The adapter says", "The adapter says"), ("chat", "Say it", [{"role": "user", "content": "Say it"}])],
)
def test_request_flags_reach_the_call(server, client, capsys, monkeypatch, command, prompt, sent):  # noqa: F811
    flags = ["--temperature", "0.9", "--top-p", "0.9", "--top-k", "40", "--seed", "7", "--max-tokens", "24"]
    flags += ["--stop", "zz", "--stop", "q", "--speculate", "2", "--priority", "1", "--regex", "[a-z ]+"]
    flags += ["--best-of", "2", "--bad-word", "hi", "--truncate-prompt-tokens", "6"]
    allowed = client.tokenize("abcdefghij ", add_special_tokens=False)
    flags += [flag for token_id in allowed for flag in ("--allowed-token-id", str(token_id))]
    kwargs = {
        "priority": 1,
        "lora_name": "",
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "max_tokens": 24,
        "stop": ["zz", "q"],
        "num_speculative_tokens": 2,
        "structured_output": spindle_pb2.StructuredOutput(regex="[a-z ]+"),
        "best_of": 2,
        "bad_words": ["hi"],
        "truncate_prompt_tokens": 6,
        "allowed_token_ids": allowed,
    }
    calls = []
    real_call = getattr(SpindleClient, command)

    def recorded(self, *args, **call_kwargs):
        calls.append(call_kwargs)
        return real_call(self, *args, **call_kwargs)

    monkeypatch.setattr(SpindleClient, command, recorded)
    assert spindle(server, command, prompt, *flags) == 0
    [called] = calls
    assert {
        name: called[name] for name in kwargs
    } == kwargs  # speculation, priority and an unmet stop leave the text unchanged
    printed = capsys.readouterr().out
    assert printed == streamed_text(real_call(client, sent, **kwargs)) + "\n"
    assert set(printed.removesuffix("\n")) <= set("abcdefghij ") and "hi" not in printed


def test_generate_with_a_lora_adapter(server, client, capsys):  # noqa: F811
    assert spindle(server, "generate", "The adapter says", "--lora-name", "sql", *GREEDY) == 0
    expected = streamed_text(client.generate("The adapter says", lora_name="sql", temperature=0, max_tokens=8))
    assert capsys.readouterr().out == expected + "\n"


def without_eos(text: str) -> str:
    """The text without the tiny tokenizer's eos (``#``, not a special token there, so not skipped)."""
    return text.removesuffix("#")


COLOURS = json.dumps({"enum": ["red", "green"]})
REGEX = r"[0-9]{3}-[a-c]"


@pytest.mark.parametrize(
    "flags,spec,valid",
    [
        (
            ["--choice", "yes", "--choice", "no"],
            spindle_pb2.StructuredOutput(choice=spindle_pb2.Choices(choices=["yes", "no"])),
            lambda text: text in ("yes", "no"),
        ),
        (["--regex", REGEX], spindle_pb2.StructuredOutput(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
        (
            ["--regex", "[a-c]{40}", "--no-close"],
            spindle_pb2.StructuredOutput(regex="[a-c]{40}", close_at_max_tokens=False),
            lambda text: re.fullmatch("[a-c]{16}", text),
        ),
        (
            ["--json-schema", "@SCHEMA_FILE"],
            spindle_pb2.StructuredOutput(json_schema=COLOURS),
            lambda text: json.loads(text) in ("red", "green"),
        ),
    ],
    ids=["choice", "regex", "regex-cut-at-max-tokens", "json-schema-file"],
)
def test_generate_constrained(server, client, capsys, tmp_path, flags, spec, valid):  # noqa: F811
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(COLOURS)
    flags = [flag.replace("SCHEMA_FILE", str(schema_file)) for flag in flags]
    assert spindle(server, "generate", "Pick:", "--max-tokens", "16", "--seed", "1", *flags) == 0
    text = capsys.readouterr().out.removesuffix("\n")
    assert valid(without_eos(text))
    assert text == streamed_text(client.generate("Pick:", max_tokens=16, seed=1, structured_output=spec))


def test_a_refused_call_prints_the_code_and_details_and_exits_1(server, capsys):  # noqa: F811
    assert spindle(server, "generate", "x", "--json-schema", "{") == 1
    captured = capsys.readouterr()
    assert captured.out == "" and re.fullmatch(r"spindle: INVALID_ARGUMENT: .*not valid JSON.*\n", captured.err)


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "x", "--choice", "a", "--regex", "b"],
        ["generate", "x", "--json-schema", "@/no/such/schema.json"],
        ["generate", "x", "--image", "/no/such/image.png"],
        ["watch-load", "--count", "0"],
        ["detokenize", "one"],
        ["lora", "load", "only-a-name"],
        ["embed"],
    ],
    ids=["two-constraints", "missing-schema-file", "missing-image", "count-0", "not-an-id", "no-path", "no-text"],
)
def test_bad_usage_exits_2(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flags,add_special_tokens", [([], True), (["--no-special-tokens"], False)])
def test_tokenize_and_detokenize_round_trip(server, client, capsys, flags, add_special_tokens):  # noqa: F811
    text = "Hello, world: héllo!"
    assert spindle(server, "tokenize", text, *flags) == 0
    out = capsys.readouterr().out
    token_ids = client.tokenize(text, add_special_tokens=add_special_tokens)
    assert token_ids == server.engine.tokenizer.encode(text) and out == " ".join(map(str, token_ids)) + "\n"
    assert spindle(server, "detokenize", *out.split()) == 0
    assert capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize(
    "flags,kwargs", [([], {}), (["--pooling", "mean", "--dimensions", "16"], {"pooling": "mean", "dimensions": 16})]
)
def test_embed_prints_one_line_per_input(server, client, capsys, model_dir, flags, kwargs):  # noqa: F811
    texts = ["first text", "the second"]
    assert spindle(server, "embed", *texts, *flags) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    hidden_size = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
    expected = client.embed(texts, **kwargs).embeddings
    assert [line["index"] for line in lines] == [0, 1]
    for line, embedding in zip(lines, expected, strict=True):
        assert len(line["embedding"]) == kwargs.get("dimensions", hidden_size)
        assert line["embedding"] == pytest.approx(list(embedding.values))
        assert line["prompt_tokens"] == embedding.prompt_tokens == len(client.tokenize(texts[line["index"]]))


def test_lora_list_load_and_unload(server, client, capsys):  # noqa: F811
    def listed() -> list[dict]:
        assert spindle(server, "lora", "list") == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert [adapter["name"] for adapter in listed()] == ["sql"]
    assert spindle(server, "lora", "load", "cli-chat", "chat") == 0
    [loaded] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert loaded["name"] == "cli-chat" and loaded["rank"] > 0 and loaded["target_modules"]
    assert loaded in listed() and {a.name for a in client.list_lora_adapters()} == {"sql", "cli-chat"}
    assert spindle(server, "lora", "unload", "cli-chat") == 0
    assert capsys.readouterr().out == "" and [adapter["name"] for adapter in listed()] == ["sql"]
    assert spindle(server, "lora", "unload", "cli-chat") == 1
    assert capsys.readouterr().err.startswith("spindle: NOT_FOUND: ")


@pytest.mark.parametrize("count", [1, 3])
def test_watch_load_prints_count_reports(server, capsys, count):  # noqa: F811
    assert spindle(server, "watch-load", "--count", str(count), "--interval", "0.05") == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fields = {field.name for field in spindle_pb2.LoadReport.DESCRIPTOR.fields}
    assert len(reports) == count and all(set(report) == fields for report in reports)
    assert all(report["num_requests_running"] == 0 and 0 <= report["kv_cache_usage"] <= 1 for report in reports)


@pytest.mark.parametrize(
    "command,call,stable",
    [
        (
            "model-info",
            "model_info",
            {"model_name", "max_model_len", "vocab_size", "eos_token_ids", "has_chat_template"},
        ),
        (
            "server-info",
            "server_info",
            {"version", "num_total_kv_blocks", "num_free_kv_blocks", "num_running_requests"},
        ),
    ],
)
def test_info_commands_print_the_rpc_as_json(server, client, capsys, command, call, stable):  # noqa: F811
    assert spindle(server, command) == 0
    printed = json.loads(capsys.readouterr().out)
    message = getattr(client, call)()
    expected = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    assert set(printed) == {field.name for field in message.DESCRIPTOR.fields}
    assert {key: printed[key] for key in stable} == {key: expected[key] for key in stable}
