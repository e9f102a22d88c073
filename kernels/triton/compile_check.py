"""Compile every Triton kernel for CUDA architectures on a machine without a GPU.

The interpreter runs what the GPU compiler may still refuse (``tl.dot`` shapes and dtypes, layouts, types that only
the real code generator checks), so this pushes each kernel through Triton's compiler down to a cubin with the
``ptxas`` that ships in the Triton wheel, for every dtype and a set of head sizes and GQA groups (and both weight
bit widths of the quantized GEMM), and prints what each variant needs: shared memory, registers and stack per
thread (``cuobjdump``; a stack means spilled registers), with its warps, pipeline stages and compile-time
constants. Nothing is launched: a stand-in driver names the target and a JIT hook compiles and then skips the
launch. Run it in a process without ``TRITON_INTERPRET``::

    python -m spindle.kernels.triton.compile_check --arch 80 --arch 90
"""

import argparse
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.driver import driver

from spindle.kernels.attention import AttentionMetadata
from spindle.kernels.lora import LoraMapping, LoraSlots
from spindle.kernels.quant import quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _TargetOnlyDriver:
    """Just enough of a Triton driver for the JIT to pick a target and compile, with no device behind it."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def compile_only(arch: int, compiled: list[dict[str, Any]]) -> None:
    """Make every later kernel launch in this process compile for ``sm_<arch>`` and return without launching.

    Each compilation appends a record to ``compiled``. Call again to switch the architecture or the list.

    Raises:
        RuntimeError: when the kernels were built for the interpreter (``TRITON_INTERPRET=1`` at import).

    """
    if triton.knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter has no compiler to check")
    target = GPUTarget("cuda", arch, 32)

    def compile_and_skip(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        start = time.perf_counter()
        source = ASTSource(fn.jit_function, compile["signature"], compile["constants"], compile["configs"][0])
        options = {"num_warps": compile["num_warps"], "num_stages": compile["num_stages"]}
        kernel = triton.compile(source, target=target, options=options)
        names = fn.jit_function.arg_names
        compiled.append(
            {
                "kernel": fn.name,
                "seconds": time.perf_counter() - start,
                "shared_bytes": kernel.metadata.shared,
                **_resource_usage(kernel.asm["cubin"]),
                "num_warps": compile["num_warps"],
                "num_stages": compile["num_stages"],
                "constants": {names[index]: value for (index, *_), value in compile["constants"].items()},
            }
        )
        return True  # handled: the JIT launches nothing

    driver.set_active(_TargetOnlyDriver(target))
    triton.knobs.runtime.jit_cache_hook = compile_and_skip


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers and stack bytes per thread of the one kernel in ``cubin``, as ``cuobjdump -res-usage`` reads them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", file.name], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if match is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage!r}")
    return {"registers": int(match[1]), "stack_bytes": int(match[2])}


def record_only(variants: set[tuple[str, str]]) -> None:
    """Make every later kernel launch in this process add its compile variant to ``variants`` and launch nothing.

    A variant is the kernel's name and what Triton compiles it for (argument types and specialisations, constants):
    a launch whose variant is new would compile in a real run. Nothing is compiled here, so it takes no time.

    Raises:
        RuntimeError: when the kernels were built for the interpreter (``TRITON_INTERPRET=1`` at import).

    """
    if triton.knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter does not specialise")

    def record_and_skip(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        key = repr((compile["signature"], compile["constants"], compile["configs"]))
        variants.add((fn.name, key))
        return True

    driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    triton.knobs.runtime.jit_cache_hook = record_and_skip


def warm_up_row_counts(max_rows: int) -> list[int]:
    """The step sizes the model runner's start-up runs a forward and the LM head at (``_warm_up_kernels``).

    Every power of two up to ``max_rows``, and ``max_rows``: the kernels whose compile-time constants depend on a
    step choose them from its row count at powers of two (the quantized GEMM's row tiles, the LoRA kernels' tiles
    by an adapter's tokens), so one count on each side of every threshold is compiled. A kernel that chooses at
    another row count must add it here, or a step of that size compiles mid-request.
    """
    counts = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
    return counts if counts[-1] == max_rows else [*counts, max_rows]


def launch_all(dtype: torch.dtype, head_sizes: list[int], groups: list[int]) -> None:
    """Call every Triton kernel once per variant that compiles differently (dtype, head size, GQA group, splits).

    The tensors are small and on the CPU: after :func:`compile_only` only their dtypes, strides and alignment count.
    """
    import spindle.kernels.triton as tk

    num_kv_heads, block_size = 2, 16
    meta = AttentionMetadata.from_lists([1, 1, 5], [3, 20, 9], [[0], [1, 2], [3]], block_size)
    for head_size in head_sizes:
        cache = torch.zeros(2, 4, block_size, num_kv_heads, head_size, dtype=dtype)
        tk.reshape_and_cache(cache[0, 0, :7], cache[1, 0, :7], cache[0], cache[1], meta.slot_mapping)
        for group in groups:
            query = torch.zeros(7, num_kv_heads * group, head_size, dtype=dtype)
            tk.paged_attention(query, cache[0], cache[1], meta, head_size**-0.5)
            # Gemma 2's sliding window with its soft-cap: with the plain call, every branch the two flags select is
            # compiled (a window alone, or a soft-cap alone, adds no code the two lack).
            tk.paged_attention(query, cache[0], cache[1], meta, head_size**-0.5, 24, 50.0)
            tk.decode_attention(query[:2], cache[0], cache[1], meta.block_tables, meta.seq_lens, 0.1, query[:2], 4)
            tk.rotary_embedding(
                torch.arange(7), query, query[:, :num_kv_heads], torch.zeros(64, head_size, dtype=dtype)
            )
            key = query[:, :num_kv_heads]
            cos_sin = torch.zeros(64, head_size, dtype=dtype)
            tk.rotary_embedding_and_cache(torch.arange(7), query, key, key, cos_sin, *cache, meta.slot_mapping)
    x = torch.zeros(3, 576, dtype=dtype)
    tk.rms_norm(x, x[0], 1e-5)
    tk.rms_norm(x, x[0], 1e-5, x)
    tk.silu_and_mul(torch.zeros(3, 2 * 1536, dtype=dtype))
    tk.gelu_tanh_and_mul(torch.zeros(3, 2 * 1536, dtype=dtype))
    # int8 with a K that is no multiple of the K step (masked loads), int4 with the smallest and a large group; one
    # decode-sized and one prefill-sized batch each (the tile shapes differ). K = 1040 and 1024 are long enough for
    # the decode batch to split K (and so to launch the split-K reduction).
    for bits, group_size, in_features in ((8, 1040, 1040), (4, 32, 1024), (4, 128, 1024)):
        weight = quantize(torch.zeros(96, in_features), bits, group_size)
        for num_rows in (1, 100):
            bias = torch.zeros(96, dtype=dtype) if num_rows > 1 else None
            tk.quantized_linear(torch.zeros(num_rows, in_features, dtype=dtype), weight, bias)
    # LoRA, as SmolLM2's qkv projection has it at rank 16 (three parts): a decode step's 16-row tiles and a prefill
    # chunk's 64-row ones.
    slots = LoraSlots(
        torch.zeros(2, 48, 576, dtype=dtype),
        torch.zeros(2, 48, 960, dtype=dtype),
        [576, 768, 960],
        torch.zeros(2, 3, dtype=torch.int64),
    )
    for lens in ([1, 1, 1], [100, 30, 2]):
        mapping = LoraMapping.build([0, 1, -1], lens)
        assert mapping is not None
        tk.add_lora(torch.zeros(sum(lens), 960, dtype=dtype), torch.zeros(sum(lens), 576, dtype=dtype), slots, mapping)


def main(argv: list[str] | None = None) -> int:
    """Compile for each ``--arch``; print one line per kernel variant; exit non-zero on the first failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x 10, e.g. 90 (repeatable)")
    parser.add_argument("--dtype", choices=DTYPES, action="append", help="default: all three")
    parser.add_argument("--head-size", type=int, action="append", help="default: 64 80 96 128")
    parser.add_argument("--group", type=int, action="append", help="query heads per KV head; default: 1 3 8")
    args = parser.parse_args(argv)
    for arch in args.arch or [80, 90]:
        for dtype_name in args.dtype or list(DTYPES):
            compiled: list[dict[str, Any]] = []
            compile_only(arch, compiled)
            launch_all(DTYPES[dtype_name], args.head_size or [64, 80, 96, 128], args.group or [1, 3, 8])
            for record in compiled:
                constants = " ".join(f"{name}={value}" for name, value in record["constants"].items())
                print(
                    f"sm_{arch} {dtype_name:8s} {record['kernel']:26s} {record['seconds']:5.2f} s "
                    f"{record['shared_bytes'] / 1024:6.1f} KiB shared {record['registers']:3d} regs "
                    f"{record['stack_bytes']:4d} B stack  warps {record['num_warps']} stages {record['num_stages']}  "
                    f"{constants}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
