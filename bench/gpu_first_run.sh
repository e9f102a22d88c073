#!/usr/bin/env bash
# The first session with a GPU, in one call of under 10 minutes on an H200 (issue 12): the GPU tests, the kernel
# benchmark, and offline throughput on a random-weight Llama-3-8B, each with its own time limit (580 s in all), then
# one summary.
#
#   bash bench/gpu_first_run.sh [OUT_DIR]        # OUT_DIR defaults to $OUT, else /tmp/spindle-gpu-first-run
#
# It runs under the machine's own python3 (PYTHON=... to choose another): spindle is installed into it without
# dependencies (nothing can be downloaded there), and a preflight step lists the imports that are still missing.
# Each step's full output is in OUT_DIR/<step>.txt; OUT_DIR/summary.txt has one line per step.
set -u
out=${1:-${OUT:-/tmp/spindle-gpu-first-run}}
py=${PYTHON:-python3}
mkdir -p "$out"
: >"$out/summary.txt"
# Triton's compiled kernels stay in the output folder, so a rerun in the same session starts warm.
export TRITON_CACHE_DIR="$out/triton-cache"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep the output, add a summary line
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  rc=$?
  printf '%-12s rc=%-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$(tail -n 1 "$out/$name.txt")" \
    | tee -a "$out/summary.txt"
}

step install 60 "$py" -m pip install --no-deps --no-build-isolation --no-index -e ./client -e .
step preflight 30 "$py" -c "
import importlib, torch
missing = [m for m in ('msgspec', 'zmq', 'grpc', 'tokenizers', 'safetensors', 'triton', 'transformers', 'tqdm')
           if importlib.util.find_spec(m) is None]
print(torch.__version__, torch.cuda.get_device_name(0), 'missing:', ' '.join(missing) or 'nothing')
"
# -P: the repository root off sys.path, so that imports go through the installed spindle (a top-level kernels/
# would shadow Hugging Face's `kernels` package, which transformers looks for).
step tests 240 "$py" -P -m pytest -q -x -p no:cacheprovider tests/gpu tests/test_kernels_triton.py
step kernels 90 "$py" -m bench.kernels
step model 60 "$py" -m bench.random_llama "$out/llama3-8b-random" --config llama3-8b
step throughput 100 "$py" -m bench.offline_throughput --model "$out/llama3-8b-random" --no-peer \
  --dtypes bfloat16 --workloads varied --num-prompts 256 --max-tokens 128 --repeats 1
rm -rf "$out/llama3-8b-random"  # 16 GB: not worth bringing back
echo "--- summary ($out/summary.txt)"
cat "$out/summary.txt"
