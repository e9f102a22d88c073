"""The ``spindle`` command line: the clients ``generate``, ``chat`` and ``health``, and the servers' commands.

``spindle-client`` provides the client commands, which talk to a running server. Distributions that serve add
their own commands through the ``spindle.commands`` entry point group: ``spindle-serve`` adds ``serve`` and
``backend``. Each entry point names a function that receives the subparsers object and adds its commands, each with
a ``run(args) -> int`` default.
"""

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import grpc

from spindle.client import SpindleClient
from spindle.v1 import spindle_pb2


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("SPINDLE_ADDRESS", "localhost:50051"))
    parser.add_argument("--api-key", default=os.environ.get("SPINDLE_API_KEY"))
    parser.add_argument("--tls-ca", default=os.environ.get("SPINDLE_TLS_CA"), help="PEM CA file: connect with TLS")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)


def _add_lora_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-name", default="", help="the server's LoRA adapter to generate with (default: none)")


def _client(args: argparse.Namespace) -> SpindleClient:
    return SpindleClient(args.address, api_key=args.api_key, tls_ca=args.tls_ca)


def _params(args: argparse.Namespace) -> dict[str, int | float | None]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}


def _print_stream(responses: Iterator[spindle_pb2.GenerateResponse]) -> str:
    """Print choice 0's text as it streams; returns it."""
    text = ""
    for response in responses:
        for choice in response.choices:
            if choice.index == 0:
                text += choice.text
                print(choice.text, end="", flush=True)
    print()
    return text


def _report(error: grpc.RpcError) -> int:
    print(f"spindle: {error.code().name}: {error.details()}", file=sys.stderr)
    return 1


def _generate(args: argparse.Namespace) -> int:
    images = [Path(path).read_bytes() for path in args.image]
    with _client(args) as client:
        try:
            _print_stream(client.generate(args.prompt, lora_name=args.lora_name, images=images, **_params(args)))
        except grpc.RpcError as error:
            return _report(error)
    return 0


def _chat(args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with _client(args) as client:
        while True:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            try:
                reply = _print_stream(client.chat(messages, lora_name=args.lora_name, **_params(args)))
            except grpc.RpcError as error:
                return _report(error)
            messages.append({"role": "assistant", "content": reply})


def _health(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            status = client.health(args.service)
        except grpc.RpcError as error:
            status = error.code().name
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``spindle`` parser: the client commands and every command that an installed distribution registers."""
    parser = argparse.ArgumentParser(prog="spindle", description="Spindle LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    for entry_point in entry_points(group="spindle.commands"):
        entry_point.load()(commands)
    generate = commands.add_parser("generate", help="stream a completion of a prompt from a running server")
    generate.add_argument("prompt")
    generate.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="an image file for the prompt's next <image> placeholder (repeat for several; vision-language models)",
    )
    _add_client_args(generate)
    _add_lora_arg(generate)
    generate.set_defaults(run=_generate)
    chat = commands.add_parser("chat", help="chat with a running server: one user turn per line of stdin")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    _add_client_args(chat)
    _add_lora_arg(chat)
    chat.set_defaults(run=_chat)
    check = commands.add_parser("health", help="exit 0 if a running server reports SERVING (a health probe)")
    check.add_argument("--service", default="", help="the service to check; empty checks the whole server")
    _add_client_args(check)
    check.set_defaults(run=_health)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spindle`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
