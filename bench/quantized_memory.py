"""The backend's resident memory with a quantized checkpoint: does a Q4 file cost Q4 memory once loaded?

Starts the engine core (what the backend process runs) on the embedded SmolLM2 GGUF (Q4_1) in a fresh process per
``--quantization`` setting, ``auto`` (the file's blocks as int4, the lm head int8) and ``none`` (dense weights). Each
process measures its resident memory (``VmRSS``) once torch and the CPU kernels are imported, and again once the
engine is up (model loaded and prepared, KV cache allocated); it prints the difference beside the file's size and
the KV cache's bytes, and the ratio of the difference less the KV cache to the file's size. The GGUF is converted
first, in this process, so that neither measured one pays for the conversion::

    .venv/bin/python -m bench.quantized_memory
    .venv/bin/python -m bench.quantized_memory --dtype bfloat16 --kv-cache-memory 256MiB

Run it as a module: as a script, bench/ comes first on sys.path and this file would shadow the kernels package.
"""

import argparse
import json
import subprocess
import sys

MEASURE = """
import json, sys
def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
import torch
from spindle.kernels import cpu
cpu.cpu_ops()
from spindle.backend.engine_core import EngineCore
from spindle.shared.config import EngineConfig
before = resident()
settings = json.loads(sys.argv[1])
core = EngineCore(EngineConfig.of(**settings))
after = resident()
kv = sum(k.nbytes + v.nbytes for k, v in core.runner.kv_caches)
print(json.dumps({"before": before, "after": after, "kv": kv}))
"""


def main() -> None:
    """Convert the GGUF, then measure each quantization setting in its own process and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    from spindle.backend.models.loader import embedded_gguf, resolve_model

    file = embedded_gguf()
    model_dir = resolve_model(file)
    size = file.stat().st_size
    print(f"{file.name}: {size / 2**20:.1f} MiB; dtype {args.dtype}, KV cache {args.kv_cache_memory}")
    columns = ["before MiB", "after MiB", "loaded MiB", "KV MiB", "(loaded-KV)/file"]
    print(f"{'quantization':>12} " + " ".join(f"{name:>{len(name) + 1}}" for name in columns))
    for quantization in ("auto", "none"):
        settings = {
            "model": str(model_dir),
            "device": "cpu",
            "dtype": args.dtype,
            "quantization": quantization,
            "kv_cache_memory": args.kv_cache_memory,
            "max_model_len": args.max_model_len,
        }
        out = subprocess.run(
            [sys.executable, "-c", MEASURE, json.dumps(settings)], check=True, stdout=subprocess.PIPE, text=True
        ).stdout
        got = json.loads(out.strip().splitlines()[-1])
        loaded = got["after"] - got["before"]
        print(
            f"{quantization:>12} {got['before'] / 2**20:11.1f} {got['after'] / 2**20:10.1f} {loaded / 2**20:11.1f}"
            f" {got['kv'] / 2**20:7.1f} {(loaded - got['kv']) / size:17.2f}"
        )


if __name__ == "__main__":
    main()
