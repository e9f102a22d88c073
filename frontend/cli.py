"""The ``spindle`` command line."""

import argparse
import logging
import sys

from shared import SamplingParams


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV cache size on the CPU, e.g. 2GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)


def _serve(args: argparse.Namespace) -> int:
    from frontend.llm import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    print(f"engine check: {messages[0]['content']!r} -> {output.outputs[0].text!r}")
    print("The engine works; the gRPC server arrives in a later issue.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``spindle`` console script."""
    parser = argparse.ArgumentParser(prog="spindle", description="Spindle LLM serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="load the model and serve it")
    _add_engine_args(serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
