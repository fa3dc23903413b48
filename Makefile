# maru-dynamo: `make setup`, then `make test`; `make demo` runs the main job.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup lint test demo bench aiperf compat clean help

help:
	@echo "make setup   - create $(VENV) with vLLM (CPU or GPU), Dynamo 1.6.1, LMCache, nats-server"
	@echo "make lint    - ruff (lint + format check) and mypy over the code (configured in pyproject.toml)"
	@echo "make test    - make lint, then the whole test suite (real vLLM, Dynamo, nats-server; loopback only)"
	@echo "make demo    - run the demo on the embedded defaults"
	@echo "make bench   - run the benchmarks in benchmarks/"
	@echo "make aiperf  - create .venv-aiperf with AIPerf (the load generator of benchmarks/real_traffic.py)"
	@echo "make compat  - the compatibility matrix: each supported vLLM/LMCache/Dynamo release, each level (docs/compat-matrix.json)"

setup:
	@VENV=$(VENV) GPU=$(or $(GPU),auto) bash scripts/setup.sh

lint:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	@VENV=$(VENV) bash scripts/lint.sh

test: lint aiperf
	$(PY) -m pytest $(PYTEST_ARGS)

demo:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	$(PY) -m maru_dynamo.components.main demo

bench:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	$(PY) benchmarks/run_all.py

aiperf:
	@bash scripts/setup_aiperf.sh

compat:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	@bash scripts/setup_compat.sh
	$(PY) scripts/compat/matrix.py --levels static,scheduler,engines

clean:
	rm -rf $(VENV) .venv-compat .compat-cache .venv-aiperf .venv-aiperf.log .setup-logs .pytest_cache .mypy_cache .ruff_cache build/typecheck
