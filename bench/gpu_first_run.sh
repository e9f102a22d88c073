#!/usr/bin/env bash
# The first session on a GPU machine, in one call of 8 minutes at most (issue 41): bench/device_run.py under the
# machine's own python3 (PYTHON=... to choose another). The wheels of .whl/ (`make device-wheels`, here) travel with
# the working tree; caches and the random model stay under /tmp; each step's output and summary.txt go to $OUT.
#
#   bash bench/gpu_first_run.sh                      # on the GPU machine
#   bash bench/gpu_first_run.sh --device cpu --fast  # the rehearsal, the device swapped for the CPU (make test runs it)
exec "${PYTHON:-python3}" -P "$(dirname "$0")/device_run.py" "$@"
