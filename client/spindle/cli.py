"""The ``spindle`` command line: the clients of a running server, and the servers' commands.

``spindle-client`` provides the client commands, one or more per RPC: ``generate``, ``chat``, ``beam-search``,
``embed``, ``tokenize``, ``detokenize``, ``lora list|load|unload``, ``watch-load``, ``model-info``, ``server-info``
and ``health``. Text streams as it is generated; structured answers (embeddings, adapters, load reports, model and
server info) print as JSON, one object a line. A call the server refuses prints ``spindle: CODE: details`` to stderr
and exits 1; bad usage exits 2.

Distributions that serve add their own commands through the ``spindle.commands`` entry point group:
``spindle-serve`` adds ``serve`` and ``backend``. Each entry point names a function that receives the subparsers
object and adds its commands, each with a ``run(args) -> int`` default.
"""

import argparse
import functools
import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from spindle.client import SpindleClient, image_item
from spindle.v1 import spindle_pb2

_Command = Callable[[argparse.Namespace], int]  # a command's run(args): its exit code


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=os.environ.get("SPINDLE_ADDRESS", "localhost:50051"),
        help="host:port of the server (SPINDLE_ADDRESS; default localhost:50051)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("SPINDLE_API_KEY"), help="the server's API key (SPINDLE_API_KEY)"
    )
    parser.add_argument(
        "--tls-ca", default=os.environ.get("SPINDLE_TLS_CA"), help="PEM CA file: connect with TLS (SPINDLE_TLS_CA)"
    )


def _text_or_file(value: str) -> str:
    """An argument's text, or with ``@`` in front the named file's."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {error.strerror}") from None


def _image_file(path: str) -> bytes:
    """The bytes of an image file, checked to be of a format the server decodes."""
    try:
        data = Path(path).read_bytes()
        image_item(data)
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{path}: {error}") from None
    return data


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return number


def _logits_processor(value: str) -> spindle_pb2.LogitsProcessor:
    """``NAME`` or ``NAME=JSON`` (its arguments, a JSON object) as the message that selects the processor."""
    name, _, args = value.partition("=")
    if args:
        try:
            parsed = json.loads(args)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{name}'s arguments are not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise argparse.ArgumentTypeError(f"{name}'s arguments must be a JSON object")
    return spindle_pb2.LogitsProcessor(name=name, args_json=args)


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    """The sampling, structured output, scheduling and adapter flags of ``generate`` and ``chat``."""
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    parser.add_argument("--temperature", type=float, default=None, help="softmax temperature; 0 is greedy")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold in (0, 1]")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the K most likely tokens only")
    parser.add_argument("--seed", type=int, default=None, help="seed of the request's own random generator")
    parser.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="a string that ends the completion (repeatable)"
    )
    parser.add_argument(
        "--speculate",
        type=int,
        default=None,
        metavar="N",
        help="up to N draft tokens a step by prompt lookup (n-gram speculation); exact",
    )
    parser.add_argument(
        "--best-of",
        type=_positive_int,
        default=None,
        metavar="N",
        help="sample N completions and print the one of highest cumulative logprob",
    )
    parser.add_argument(
        "--bad-word",
        action="append",
        default=None,
        metavar="TEXT",
        help="a word the completion may not write (repeatable)",
    )
    parser.add_argument(
        "--allowed-token-id",
        type=int,
        action="append",
        default=None,
        metavar="ID",
        help="sample only among these token ids (repeatable)",
    )
    parser.add_argument(
        "--truncate-prompt-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="keep only the prompt's last N tokens",
    )
    parser.add_argument(
        "--priority", type=int, default=0, help="lower runs first on a server with --scheduling-policy priority"
    )
    parser.add_argument("--lora-name", default="", help="the server's LoRA adapter to generate with (default: none)")
    parser.add_argument(
        "--logits-processor",
        type=_logits_processor,
        action="append",
        default=None,
        metavar="NAME[=JSON]",
        help="a logits processor the server registered, with its arguments as a JSON object (repeatable; "
        'e.g. no_repeat_ngram={"ngram_size": 3})',
    )
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        type=_text_or_file,
        metavar="SCHEMA",
        help="the output is JSON valid against this schema (JSON text, or @FILE)",
    )
    constraint.add_argument("--regex", help="the whole output matches this regular expression")
    constraint.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is exactly one of the choices (repeatable)"
    )
    parser.add_argument(
        "--no-close",
        dest="close_at_max_tokens",
        action="store_false",
        help="let --max-tokens cut a constrained output anywhere (by default it closes the structure in time)",
    )
    _add_connection_args(parser)


def _structured_output(args: argparse.Namespace) -> spindle_pb2.StructuredOutput | None:
    if args.json_schema is not None:
        spec = spindle_pb2.StructuredOutput(json_schema=args.json_schema)
    elif args.regex is not None:
        spec = spindle_pb2.StructuredOutput(regex=args.regex)
    elif args.choice:
        spec = spindle_pb2.StructuredOutput(choice=spindle_pb2.Choices(choices=args.choice))
    else:
        return None
    if not args.close_at_max_tokens:
        spec.close_at_max_tokens = False
    return spec


def _request(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``SpindleClient.generate`` and ``chat`` that the flags set."""
    return {
        "priority": args.priority,
        "lora_name": args.lora_name,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "num_speculative_tokens": args.speculate,
        "structured_output": _structured_output(args),
        "logits_processors": args.logits_processor,
        "best_of": args.best_of,
        "bad_words": args.bad_word,
        "allowed_token_ids": args.allowed_token_id,
        "truncate_prompt_tokens": args.truncate_prompt_tokens,
    }


def _client(args: argparse.Namespace) -> SpindleClient:
    return SpindleClient(args.address, api_key=args.api_key, tls_ca=args.tls_ca)


def _client_command(run: _Command) -> _Command:
    """``run``, a refused call reported as ``spindle: CODE: details`` (exit 1), Ctrl-C as exit 130 (no traceback)."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except grpc.RpcError as error:
            print(f"spindle: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130

    return wrapped


def _print_stream(responses: Iterator[spindle_pb2.GenerateResponse]) -> str:
    """Print choice 0's text as it streams; returns it.

    A reasoning model's thoughts (a server with ``--reasoning-parser``) go to stderr, so that stdout is the answer.
    """
    text, thinking = "", False
    for response in responses:
        for choice in response.choices:
            if choice.index != 0:
                continue
            if choice.HasField("reasoning_content"):
                thinking = True
                print(choice.reasoning_content, end="", file=sys.stderr, flush=True)
            if choice.text and thinking:
                thinking = False
                print(file=sys.stderr)
            text += choice.text
            print(choice.text, end="", flush=True)
    print()
    return text


def _print_json(message: Message) -> None:
    """Print a message as one line of JSON, with the proto's field names, fields at their default included."""
    fields = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    print(json.dumps(fields), flush=True)


@_client_command
def _generate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_stream(client.generate(args.prompt, images=args.image, **_request(args)))
    return 0


@_client_command
def _chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with _client(args) as client:
        if args.message is not None:
            messages.append({"role": "user", "content": args.message})
            _print_stream(client.chat(messages, **_request(args)))
            return 0
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            reply = _print_stream(client.chat(messages, **_request(args)))
            messages.append({"role": "assistant", "content": reply})


@_client_command
def _embed(args: argparse.Namespace) -> int:
    with _client(args) as client:
        response = client.embed(
            args.text,
            pooling=args.pooling,
            normalize=args.normalize,
            dimensions=args.dimensions,
            priority=args.priority,
        )
    for index, embedding in enumerate(response.embeddings):
        line = {"index": index, "prompt_tokens": embedding.prompt_tokens, "embedding": list(embedding.values)}
        print(json.dumps(line))
    return 0


@_client_command
def _tokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        token_ids = client.tokenize(args.text, add_special_tokens=not args.no_special_tokens)
    print(*token_ids)
    return 0


@_client_command
def _detokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.detokenize(args.token_ids, skip_special_tokens=not args.keep_special_tokens))
    return 0


@_client_command
def _lora_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for adapter in client.list_lora_adapters():
            _print_json(adapter)
    return 0


@_client_command
def _lora_load(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(client.load_lora_adapter(args.name, args.path))
    return 0


@_client_command
def _lora_unload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.unload_lora_adapter(args.name)
    return 0


@_client_command
def _watch_load(args: argparse.Namespace) -> int:
    with _client(args) as client:
        reports = client.watch_load(args.interval)
        for report in itertools.islice(reports, args.count):
            _print_json(report)
        reports.cancel()  # the stream never ends on its own: stop it after --count reports
    return 0


@_client_command
def _beam_search(args: argparse.Namespace) -> int:
    fields = {"ignore_eos": args.ignore_eos, "early_stopping": _EARLY_STOPPING[args.early_stopping]}
    if args.length_penalty is not None:
        fields["length_penalty"] = args.length_penalty
    with _client(args) as client:
        response = client.beam_search(args.prompt, args.beam_width, args.max_tokens, lora_name=args.lora_name, **fields)
    penalty = 1.0 if args.length_penalty is None else args.length_penalty
    for choice in response.choices:
        score = choice.cumulative_logprob / len(choice.token_ids) ** penalty
        print(json.dumps({"index": choice.index, "score": score, "text": choice.text}))
    return 0


_EARLY_STOPPING = {
    "heuristic": spindle_pb2.EARLY_STOPPING_HEURISTIC,
    "first-finished": spindle_pb2.EARLY_STOPPING_FIRST_FINISHED,
    "never": spindle_pb2.EARLY_STOPPING_NEVER,
}


@_client_command
def _model_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(client.model_info())
    return 0


@_client_command
def _server_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(client.server_info())
    return 0


def _health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            status = client.health(args.service)
        except grpc.RpcError as error:
            status = error.code().name
    print(status)
    return 0 if status == "SERVING" else 1


def _add_command(
    commands: argparse._SubParsersAction, name: str, run: _Command, description: str
) -> argparse.ArgumentParser:
    """A client command: its parser, which takes the connection flags and runs ``run``."""
    parser = commands.add_parser(name, help=description, description=description)
    _add_connection_args(parser)
    parser.set_defaults(run=run)
    return parser


def _add_lora_commands(commands: argparse._SubParsersAction) -> None:
    lora = commands.add_parser("lora", help="list, load and unload the server's LoRA adapters")
    actions = lora.add_subparsers(dest="lora_command", required=True)
    _add_command(actions, "list", _lora_list, "print each adapter requests may name, as a line of JSON")
    load = _add_command(
        actions,
        "load",
        _lora_load,
        "load an adapter on a server run with --allow-runtime-lora; print it as a line of JSON",
    )
    load.add_argument("name", help="the name requests will use (--lora-name)")
    load.add_argument("path", help="the PEFT adapter directory, relative to the server's --lora-dir or inside it")
    unload = _add_command(actions, "unload", _lora_unload, "unload an adapter; requests running with it finish first")
    unload.add_argument("name", help="the adapter's name")


def _add_client_commands(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser(
        "generate", help="stream a completion of a prompt", description="stream a completion of a prompt"
    )
    generate.add_argument("prompt", help="the text to complete")
    generate.add_argument(
        "--image",
        type=_image_file,
        action="append",
        default=[],
        metavar="FILE",
        help="an image file for the prompt's next <image> placeholder (repeat for several; vision-language models)",
    )
    _add_request_args(generate)
    generate.set_defaults(run=_generate)

    description = "chat with the model: one message given, print the reply; else one user turn per line of stdin"
    chat = commands.add_parser("chat", help=description, description=description)
    chat.add_argument("message", nargs="?", default=None, help="the user's message (default: read turns from stdin)")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    _add_request_args(chat)
    chat.set_defaults(run=_chat)

    beam = _add_command(
        commands,
        "beam-search",
        _beam_search,
        "print a prompt's most likely completions, best first, one line of JSON each",
    )
    beam.add_argument("prompt", help="the text to complete")
    beam.add_argument("--beam-width", type=_positive_int, default=4, help="beams kept, and printed (default 4)")
    beam.add_argument("--max-tokens", type=_positive_int, default=16, help="most tokens a completion has (default 16)")
    beam.add_argument("--length-penalty", type=float, default=None, help="length exponent dividing scores (default 1)")
    beam.add_argument("--ignore-eos", action="store_true", help="never end a beam at eos")
    beam.add_argument(
        "--early-stopping",
        choices=list(_EARLY_STOPPING),
        default="heuristic",
        help="when to stop: transformers' early_stopping False, True or 'never' (default heuristic)",
    )
    beam.add_argument("--lora-name", default="", help="the server's LoRA adapter to search with (default: none)")

    embed = _add_command(commands, "embed", _embed, "print the embedding of each text, one line of JSON each")
    embed.add_argument("text", nargs="+", help="the texts to embed, in one call")
    embed.add_argument("--pooling", choices=["last", "mean", "cls"], default=None, help="default: the model's (last)")
    embed.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="scale each embedding to unit length (the server's default: yes)",
    )
    embed.add_argument("--dimensions", type=_positive_int, default=None, help="keep the first N values (default: all)")
    embed.add_argument("--priority", type=int, default=0, help="lower runs first (--scheduling-policy priority)")

    tokenize = _add_command(commands, "tokenize", _tokenize, "print the token ids of a text, space-separated")
    tokenize.add_argument("text")
    tokenize.add_argument(
        "--no-special-tokens", action="store_true", help="add no special tokens (such as BOS) to the text's own"
    )

    detokenize = _add_command(commands, "detokenize", _detokenize, "print the text of token ids")
    detokenize.add_argument("token_ids", type=int, nargs="+", metavar="ID")
    detokenize.add_argument("--keep-special-tokens", action="store_true", help="keep special tokens in the text")

    _add_lora_commands(commands)

    watch = _add_command(
        commands,
        "watch-load",
        _watch_load,
        "print the server's load reports as they come, one line of JSON each, until Ctrl-C or --count",
    )
    watch.add_argument(
        "--interval", type=float, default=None, help="seconds between reports at the most (0.05 to 60; default 1)"
    )
    watch.add_argument("--count", type=_positive_int, default=None, metavar="N", help="stop after N reports")

    _add_command(commands, "model-info", _model_info, "print what model the server serves, as a line of JSON")
    _add_command(commands, "server-info", _server_info, "print the server's version and load, as a line of JSON")

    health = _add_command(commands, "health", _health, "exit 0 if the server reports SERVING (a health probe)")
    health.add_argument("--service", default="", help="the service to check; empty checks the whole server")


def build_parser() -> argparse.ArgumentParser:
    """The ``spindle`` parser: the client commands and every command that an installed distribution registers."""
    parser = argparse.ArgumentParser(prog="spindle", description="Spindle LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    for entry_point in entry_points(group="spindle.commands"):
        entry_point.load()(commands)
    _add_client_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spindle`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
