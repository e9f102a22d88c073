"""The ``spindle`` command line: ``serve`` (backend child + frontend) and ``backend`` (the engine core alone)."""

import argparse
import asyncio
import logging
import sys

from backend.config import EngineConfig, add_backend_args, add_engine_args, config_from_args
from shared import SamplingParams


async def _engine_check(engine: "AsyncLLMEngine") -> str:  # noqa: F821 - imported lazily below
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = ""
    async for output in engine.chat(messages, SamplingParams(temperature=0, max_tokens=32)):
        text = output.outputs[0].text
    return text


def _serve(config: EngineConfig, args: argparse.Namespace) -> int:
    from frontend.async_llm_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_args(backend_address=args.backend_address, **vars(config))
    try:
        text = asyncio.run(_engine_check(engine))
        print(f"engine check through the backend process: {text!r}")
        print("The engine works; the gRPC server arrives in a later issue.")
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spindle`` console script."""
    parser = argparse.ArgumentParser(prog="spindle", description="Spindle LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model: a backend child process and the frontend")
    add_engine_args(serve)
    serve.add_argument("--backend-address", default=None, help="use the backend listening here instead of starting one")
    backend = commands.add_parser("backend", help="run the engine core process alone (for compose / Kubernetes)")
    add_backend_args(backend)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "backend":
        from backend.engine_process import run_backend  # the model side: only this command imports torch

        return run_backend(args)
    return _serve(config_from_args(args), args)


if __name__ == "__main__":
    sys.exit(main())
