"""The ``spindle`` command line: ``serve``, ``backend``, and the clients ``generate``, ``chat`` and ``health``.

``serve`` runs a backend child and the gRPC frontend; ``backend`` the engine core alone; the clients talk to a
running server.

Every flag of ``serve`` and ``backend`` can also be set as a ``SPINDLE_<FLAG>`` environment variable.
"""

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Iterator

from backend.config import add_backend_args, add_engine_args, config_from_args


def _serve(args: argparse.Namespace) -> int:
    from frontend.async_llm_engine import AsyncLLMEngine
    from frontend.grpc_server import serve, server_config_from_args

    server_config = server_config_from_args(args)
    engine = AsyncLLMEngine.from_args(backend_address=args.backend_address, **vars(config_from_args(args)))
    try:
        asyncio.run(serve(engine, server_config))
    finally:
        engine.shutdown()
    return 0


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("SPINDLE_ADDRESS", "localhost:50051"))
    parser.add_argument("--api-key", default=os.environ.get("SPINDLE_API_KEY"))
    parser.add_argument("--tls-ca", default=os.environ.get("SPINDLE_TLS_CA"), help="PEM CA file: connect with TLS")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)


def _client(args: argparse.Namespace) -> "SpindleClient":  # noqa: F821 - imported lazily
    from frontend.grpc_client import SpindleClient

    return SpindleClient(args.address, api_key=args.api_key, tls_ca=args.tls_ca)


def _print_stream(responses: Iterator) -> str:
    """Print choice 0's text as it streams; returns it."""
    text = ""
    for response in responses:
        for choice in response.choices:
            if choice.index == 0:
                text += choice.text
                print(choice.text, end="", flush=True)
    print()
    return text


def _generate(args: argparse.Namespace) -> int:
    import grpc

    with _client(args) as client:
        params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
        try:
            _print_stream(client.generate(args.prompt, **params))
        except grpc.RpcError as error:
            print(f"spindle: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


def _chat(args: argparse.Namespace) -> int:
    import grpc

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with _client(args) as client:
        params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
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
                messages.append({"role": "assistant", "content": _print_stream(client.chat(messages, **params))})
            except grpc.RpcError as error:
                print(f"spindle: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1


def _health(args: argparse.Namespace) -> int:
    import grpc

    with _client(args) as client:
        try:
            status = client.health(args.service)
        except grpc.RpcError as error:
            status = error.code().name
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spindle`` console script."""
    from frontend.grpc_server import add_server_args

    parser = argparse.ArgumentParser(prog="spindle", description="Spindle LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over gRPC: a backend child process and the frontend")
    add_engine_args(serve)
    add_server_args(serve)
    serve.add_argument(
        "--backend-address",
        default=os.environ.get("SPINDLE_BACKEND_ADDRESS"),
        help="use the backend listening here instead of starting one",
    )
    backend = commands.add_parser("backend", help="run the engine core process alone (for compose / Kubernetes)")
    add_backend_args(backend)
    generate = commands.add_parser("generate", help="stream a completion of a prompt from a running server")
    generate.add_argument("prompt")
    _add_client_args(generate)
    chat = commands.add_parser("chat", help="chat with a running server: one user turn per line of stdin")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    _add_client_args(chat)
    check = commands.add_parser("health", help="exit 0 if a running server reports SERVING (a health probe)")
    check.add_argument("--service", default="", help="the service to check; empty checks the whole server")
    _add_client_args(check)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "backend":
        from backend.engine_process import run_backend  # the model side: only this command imports torch

        return run_backend(args)
    return {"serve": _serve, "generate": _generate, "chat": _chat, "health": _health}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
