"""A K-quant GGUF in Spindle and in llama.cpp: resident memory, single-stream and batch decode speed.

The file: a random Llama checkpoint of real shapes (``bench.random_llama``, ``--config medium``: ~0.5B parameters,
vocabulary 32,000, with its Llama-2-style tokenizer), converted to an f16 GGUF by llama.cpp's
``convert_hf_to_gguf.py`` and quantized by ``llama-quantize`` to ``--quant`` (Q4_K_M), all cached under
``~/.cache/spindle-bench`` (``bench.llamacpp`` builds the tools there once from the ``bench`` extra's pinned sdist).
``--gguf`` takes any Llama-family GGUF instead. Before timing anything, Spindle serves the file: its tokenizer
round-trips a text and greedy generation produces text.

- Memory: a fresh process imports torch and Spindle, reads its resident set (``VmRSS``), builds ``LLM(file)`` (the
  GGUF converted into Spindle's cache beforehand) and reads it again: the difference, next to the file's size and the
  KV cache's bytes, and its ratio to file + KV. llama.cpp's resident memory is its processes' peak (GNU time's):
  ``llama-bench`` on the file (a small context), and ``llama-batched-bench`` at batch 1 and ``--batch`` (with a KV
  cache of ``--batch`` sequences, as Spindle's).
- Decode: generated tokens per second, prefill excluded, of one sequence (``--single-tokens`` greedy tokens) and
  of ``--batch`` sequences at once (``--batch-tokens`` each) after ``--prompt-tokens``-token prompts, eos ignored.
  Spindle's ``LLM(file)`` (quantization ``auto``, a KV cache that holds the batch, ``max_model_len`` the longest
  sequence) times each batch of requests twice, with 1 and with N tokens: N-1 decode steps are the difference.
  ``llama-batched-bench`` reports its decode steps' rate (``speed_tg``) itself, on random tokens where Spindle samples
  greedily. Both use ``--threads``; rounds interleave the engines, so that a shared machine's drift weighs on both;
  medians of ``--repeats`` rounds. Run from the repository root::

    .venv/bin/python -m bench.kquant_vs_llamacpp
    .venv/bin/python -m bench.kquant_vs_llamacpp --gguf model.Q4_K_M.gguf --tools-dir ~/llama.cpp-build
"""

import argparse
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench import random_llama
from bench.llamacpp import CACHE, LlamaCpp, build, decode_rate

if TYPE_CHECKING:
    from spindle import LLM

REPO = Path(__file__).resolve().parents[1]

SERVE_CHECK_TEXT = "The quick brown fox jumps over the lazy dog."


def resident_bytes() -> int:
    """This process' resident set size now (``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


def prepare_model(config: str, quant: str, llama: LlamaCpp) -> Path:
    """The ``quant`` GGUF of a random ``config`` checkpoint, made (once) under the bench cache."""
    root = CACHE / f"random-{config}"
    hf_dir, f16, quantized = root / "hf", root / "model.f16.gguf", root / f"model.{quant}.gguf"
    if quantized.is_file():
        return quantized
    if not (hf_dir / "model.safetensors").is_file():
        random_llama.write(hf_dir, config, device="cpu", tokenizer="byte-fallback")
    if not f16.is_file():
        llama.convert(hf_dir, f16.with_suffix(".partial"))
        f16.with_suffix(".partial").rename(f16)
    llama.quantize(f16, quantized.with_suffix(".partial"), quant)
    quantized.with_suffix(".partial").rename(quantized)
    return quantized


def check_serving(llm: "LLM") -> str:
    """Raise unless ``llm``'s tokenizer round-trips a text and greedy decoding produces text; returns that text."""
    from spindle import SamplingParams

    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(SERVE_CHECK_TEXT, add_special_tokens=False)
    if tokenizer.decode(ids) != SERVE_CHECK_TEXT:
        raise RuntimeError(f"the GGUF's tokenizer does not round-trip {SERVE_CHECK_TEXT!r}: {tokenizer.decode(ids)!r}")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = llm.generate(SERVE_CHECK_TEXT, params, use_tqdm=False)[0].outputs[0].text
    if not text:
        raise RuntimeError("Spindle generated no text from the GGUF")
    return text


def spindle_memory(gguf: Path, kv_cache_memory: int, max_model_len: int, threads: int) -> dict[str, int]:
    """In this (fresh) process: resident bytes before and after ``LLM(gguf)`` loads, and its KV cache's bytes."""
    import torch

    from spindle import LLM

    torch.set_num_threads(threads)
    before = resident_bytes()
    llm = LLM(str(gguf), kv_cache_memory=kv_cache_memory, max_model_len=max_model_len)
    after = resident_bytes()
    core = llm.llm_engine.client.core
    return {"before": before, "after": after, "kv": core.num_blocks * core.runner.block_bytes}


GNU_TIME = Path("/usr/bin/time")


def peak_resident(command: list[str]) -> tuple[int, str]:
    """Run ``command``; its peak resident bytes and its standard output. Raises on failure.

    GNU time measures it: a child of this process starts as a copy of it (gigabytes once a model is loaded), and its
    peak (``ru_maxrss``) would count those pages; ``time``'s own child starts as a copy of a small program.
    """
    if not GNU_TIME.is_file():
        raise FileNotFoundError(f"{GNU_TIME} (GNU time, Debian's `time` package) measures llama.cpp's peak memory")
    with tempfile.NamedTemporaryFile("r") as report:
        timed = [str(GNU_TIME), "--format", "%M", "--output", report.name, *command]
        result = subprocess.run(timed, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{shlex.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        return int(report.read().split()[-1]) * 1024, result.stdout


def batched_bench(
    llama: LlamaCpp, gguf: Path, batch: int, prompt_tokens: int, new_tokens: int, threads: int
) -> tuple[float, int]:
    """``llama-batched-bench`` on ``batch`` sequences: its decode tokens per second and its peak resident bytes."""
    rss, stdout = peak_resident(llama.batched_bench_command(gguf, batch, prompt_tokens, new_tokens, threads))
    return decode_rate(stdout, batch), rss


def spindle_decode(llm: "LLM", batch: int, prompt_tokens: int, new_tokens: int, rng: random.Random) -> float:
    """Spindle's decode tokens per second on ``batch`` new random prompts: the same batch size run for 1 token and
    for ``new_tokens``, whose difference is ``new_tokens - 1`` decode steps. Every prompt is new (no cached prefix)."""
    from spindle import SamplingParams

    vocab_size = llm.llm_engine.client.info.vocab_size

    def seconds(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.choices(range(3, vocab_size), k=prompt_tokens)} for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens and not o.num_cached_tokens for o in outputs)
        return elapsed

    return batch * (new_tokens - 1) / (seconds(new_tokens) - seconds(1))


def mib(size: float) -> str:
    return f"{size / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=random_llama.CONFIGS, default="medium", help="the random model's shapes")
    parser.add_argument("--quant", default="Q4_K_M", help="llama-quantize's type for the random model")
    parser.add_argument("--gguf", type=Path, help="an existing GGUF file instead of the random model")
    parser.add_argument("--tools-dir", type=Path, help="a llama.cpp build (bench.llamacpp's layout); default: build")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--single-tokens", type=int, default=128, help="tokens the single stream generates")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens each of the batch's sequences generates")
    parser.add_argument("--repeats", type=int, default=3)
    # The memory measurement's child process: LLM(gguf, kv_cache_memory=KV_BYTES, max_model_len=...).
    parser.add_argument("--spindle-memory", type=int, metavar="KV_BYTES", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.spindle_memory is not None:
        print(json.dumps(spindle_memory(args.gguf, args.spindle_memory, args.max_model_len, args.threads)))
        return

    llama = LlamaCpp(args.tools_dir).check() if args.tools_dir else build()
    gguf = args.gguf or prepare_model(args.config, args.quant, llama)
    if not gguf.is_file():
        parser.error(f"{gguf} is not a file")

    import torch

    from bench import quality
    from spindle import LLM

    torch.set_num_threads(args.threads)
    longest = args.prompt_tokens + max(args.single_tokens, args.batch_tokens)
    # Converts the file into Spindle's cache on first use; a KV cache of one sequence, its block size read from it.
    llm = LLM(str(gguf), kv_cache_memory="256MiB", max_model_len=longest)
    sample = check_serving(llm)
    core = llm.llm_engine.client.core
    block_size, block_bytes = core.runner.block_size, core.runner.block_bytes
    del llm, core
    kv_bytes = args.batch * -(-longest // block_size) * block_bytes
    print(f"{gguf} ({mib(gguf.stat().st_size)}): Spindle serves it; greedy text from {SERVE_CHECK_TEXT!r}: {sample!r}")

    command = [sys.executable, "-m", "bench.kquant_vs_llamacpp", "--gguf", str(gguf), "--threads", str(args.threads)]
    command += ["--max-model-len", str(longest)]
    child = subprocess.run([*command, "--spindle-memory", str(kv_bytes)], cwd=REPO, capture_output=True, text=True)
    if child.returncode:
        raise RuntimeError(f"Spindle's memory measurement failed ({child.returncode}):\n{child.stderr[-3000:]}")
    memory = json.loads(child.stdout.splitlines()[-1])
    bench_rss, _ = peak_resident(
        [str(llama.tool("llama-bench")), "-m", str(gguf), "-p", str(args.prompt_tokens), "-n", "16", "-r", "1"]
        + ["-t", str(args.threads)]
    )
    file_bytes = gguf.stat().st_size
    loaded = memory["after"] - memory["before"]
    print(f"memory ({args.threads} threads):")
    print(
        f"  spindle  resident {mib(memory['before'])} with torch imported, +{mib(loaded)} after LLM() loads: "
        f"file {mib(file_bytes)} + KV cache {mib(memory['kv'])} = {mib(file_bytes + memory['kv'])}, "
        f"ratio {loaded / (file_bytes + memory['kv']):.2f}"
    )
    print(
        f"  llama.cpp peak resident: llama-bench {mib(bench_rss)} ({bench_rss / file_bytes:.2f}x the file)", flush=True
    )

    llm = LLM(str(gguf), kv_cache_memory=kv_bytes, max_model_len=longest)
    rng = random.Random(0)
    spindle_decode(llm, 2, args.prompt_tokens, 4, rng)  # warm-up
    workloads = {"single stream": (1, args.single_tokens), f"batch {args.batch}": (args.batch, args.batch_tokens)}
    ours: dict[str, list[float]] = {name: [] for name in workloads}
    theirs: dict[str, list[float]] = {name: [] for name in workloads}
    peer_rss: dict[str, int] = {}
    print(f"decode tokens/s after {args.prompt_tokens}-token prompts, prefill excluded, {args.threads} threads:")
    for _ in range(args.repeats):
        for name, (batch, new_tokens) in workloads.items():
            ours[name].append(spindle_decode(llm, batch, args.prompt_tokens, new_tokens, rng))
            rate, peer_rss[name] = batched_bench(llama, gguf, batch, args.prompt_tokens, new_tokens, args.threads)
            theirs[name].append(rate)
            print(
                f"  round {len(ours[name])}, {name}: spindle {ours[name][-1]:.1f}, llama.cpp {rate:.1f} tok/s",
                flush=True,
            )

    print(f"  medians of {args.repeats}:")
    for name, (_, new_tokens) in workloads.items():
        ratios = [mine / peer for mine, peer in zip(ours[name], theirs[name], strict=True)]
        print(
            f"    {name:<14} ({new_tokens} tokens each)  spindle {statistics.median(ours[name]):7.1f}  "
            f"llama.cpp {statistics.median(theirs[name]):7.1f}  ratio {statistics.median(ratios):.2f}x "
            f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    peaks = ", ".join(f"{name} {mib(rss)}" for name, rss in peer_rss.items())
    print(f"llama-batched-bench's peak resident memory: {peaks}")
    del llm
    print(f"spindle's defaults on the file: {quality.guard(LLM(str(gguf)), str(gguf))}")


if __name__ == "__main__":
    main()
