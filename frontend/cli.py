"""The server's ``spindle`` commands: ``serve`` (a backend child and the gRPC frontend) and ``backend``.

``backend`` runs the engine core alone (for compose / Kubernetes); ``backend --check`` probes one instead (its
container's health check). The ``spindle`` command itself belongs to spindle-client (:mod:`spindle.cli`), which
finds these two through the ``spindle.commands`` entry point that ``pyproject.toml`` registers. Every flag of
``serve`` and ``backend`` but ``--check`` and ``--check-timeout`` can also be set as a ``SPINDLE_<FLAG>`` environment
variable.
"""

import argparse
import asyncio
import os
import sys
from typing import TYPE_CHECKING

from spindle.frontend.grpc.args import add_server_args
from spindle.shared.config import add_backend_args, add_engine_args, add_log_args, config_from_args, configure_logging
from spindle.shared.model_registry import ModelRegistry, add_register_model_args

if TYPE_CHECKING:
    from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine


def _serve(args: argparse.Namespace) -> int:
    from spindle.frontend.grpc.args import server_config_from_args
    from spindle.frontend.grpc.server import serve

    configure_logging(args.log_format)  # first: the backend children started below log in the same format
    ModelRegistry.register_models(args.register_model)  # forwarded to the backend children; imported there only
    try:
        server_config = server_config_from_args(args)  # first: a bad server flag starts no backend
        engine = engine_from_args(args)
    except ValueError as error:
        print(f"spindle serve: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(engine, server_config))
    finally:
        engine.shutdown()
    return 0


def engine_from_args(args: argparse.Namespace) -> "AsyncLLMEngine":
    """The engine ``spindle serve`` serves, connected to its backends.

    One backend, or ``--data-parallel-size`` backends (or the backends of a comma-separated ``--backend-address``),
    each request routed to one of them.

    Raises:
        ValueError: a ``--data-parallel-size`` other than 1 or the number of backend addresses.

    """
    from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_args(
        backend_address=args.backend_address,
        data_parallel_size=args.data_parallel_size,
        **config_from_args(args).settings(),
    )


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return number


def _backend(args: argparse.Namespace) -> int:
    if args.check is not None:
        return _check_backend(args.check or args.listen, args.check_timeout, args.zmq_secret_file)
    from spindle.backend.engine_process import run_backend  # the model side: only this command imports torch

    configure_logging(args.log_format)
    return run_backend(args)


def _check_backend(address: str, timeout: float, secret_file: str | None) -> int:
    """``spindle backend --check``: 0 if a backend answers a ping at ``address`` within ``timeout`` s, else 1.

    Prints one line either way. A backend that answers but is draining (after SIGTERM) still passes: it is alive.
    One whose step loop is stuck (:func:`~spindle.shared.protocol.hung_reason`) fails, though it answers.
    """
    import zmq

    from spindle.frontend.engine.connection import EngineDeadError, ping_backend
    from spindle.shared.protocol import PROTOCOL_VERSION, hung_reason

    host = address.removeprefix("tcp://").rsplit(":", 1)[0] if address.startswith("tcp://") else None
    if host in ("0.0.0.0", "*", "[::]"):  # a listen address: probe it over loopback
        address = address.replace(host, "127.0.0.1" if host != "[::]" else "[::1]", 1)
    try:
        pong = ping_backend(address, timeout, secret_file)
    except (EngineDeadError, zmq.ZMQError) as error:
        print(f"spindle: backend DOWN: {error}", file=sys.stderr)
        return 1
    if pong.protocol_version != PROTOCOL_VERSION:
        print(
            f"spindle: backend MISMATCH: the backend at {address} speaks protocol {pong.protocol_version}, "
            f"this frontend {PROTOCOL_VERSION}",
            file=sys.stderr,
        )
        return 1
    hung = hung_reason(pong.busy_for, pong.step_timeout)
    if hung is not None:
        print(f"spindle: backend HUNG: {pong.model_name} at {address}: {hung}", file=sys.stderr)
        return 1
    state = "draining" if pong.draining else "serving"
    print(f"spindle: backend UP: {pong.model_name} at {address}, {state}")
    return 0


def add_commands(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add ``serve`` and ``backend`` to the ``spindle`` command's subparsers (the ``spindle.commands`` entry point)."""
    serve = commands.add_parser("serve", help="serve a model over gRPC: a backend child process and the frontend")
    add_engine_args(serve)
    add_server_args(serve)
    serve.add_argument(
        "--backend-address",
        default=os.environ.get("SPINDLE_BACKEND_ADDRESS"),
        help="use the backend listening here instead of starting one; a comma-separated list for one engine per "
        "backend behind this frontend (data parallel)",
    )
    serve.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=os.environ.get("SPINDLE_DATA_PARALLEL_SIZE", "1"),  # a string default goes through the type too
        help="start this many backend engines, each with its own KV cache, and route requests between them",
    )
    add_log_args(serve)
    add_register_model_args(serve)
    serve.set_defaults(run=_serve)
    backend = commands.add_parser("backend", help="run the engine core process alone (for compose / Kubernetes)")
    add_backend_args(backend)
    add_register_model_args(backend)
    backend.add_argument(
        "--check",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="do not serve: exit 0 if a backend answers at ADDRESS (default: the --listen address), else 1",
    )
    backend.add_argument(
        "--check-timeout", type=float, default=5.0, metavar="SECONDS", help="how long --check waits for the answer"
    )
    backend.set_defaults(run=_backend)
