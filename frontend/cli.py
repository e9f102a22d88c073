"""The server's ``spindle`` commands: ``serve`` (a backend child and the gRPC frontend) and ``backend``.

``backend`` runs the engine core alone (for compose / Kubernetes).
The ``spindle`` command itself belongs to spindle-client (:mod:`spindle.cli`), which finds these two through the
``spindle.commands`` entry point that ``pyproject.toml`` registers. Every flag of ``serve`` and ``backend`` can also
be set as a ``SPINDLE_<FLAG>`` environment variable.
"""

import argparse
import asyncio
import os

from spindle.frontend.grpc_args import add_server_args
from spindle.shared.config import add_backend_args, add_engine_args, config_from_args


def _serve(args: argparse.Namespace) -> int:
    from spindle.frontend.async_llm_engine import AsyncLLMEngine
    from spindle.frontend.grpc_args import server_config_from_args
    from spindle.frontend.grpc_server import serve

    server_config = server_config_from_args(args)
    engine = AsyncLLMEngine.from_args(backend_address=args.backend_address, **vars(config_from_args(args)))
    try:
        asyncio.run(serve(engine, server_config))
    finally:
        engine.shutdown()
    return 0


def _backend(args: argparse.Namespace) -> int:
    from spindle.backend.engine_process import run_backend  # the model side: only this command imports torch

    return run_backend(args)


def add_commands(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``serve`` and ``backend`` to the ``spindle`` command's subparsers (the ``spindle.commands`` entry point)."""
    serve = commands.add_parser("serve", help="serve a model over gRPC: a backend child process and the frontend")
    add_engine_args(serve)
    add_server_args(serve)
    serve.add_argument(
        "--backend-address",
        default=os.environ.get("SPINDLE_BACKEND_ADDRESS"),
        help="use the backend listening here instead of starting one",
    )
    serve.set_defaults(run=_serve)
    backend = commands.add_parser("backend", help="run the engine core process alone (for compose / Kubernetes)")
    add_backend_args(backend)
    backend.set_defaults(run=_backend)
