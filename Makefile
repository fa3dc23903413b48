# maru-dynamo: `make setup`, then `make test`; `make demo` runs the main job.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench clean help

help:
	@echo "make setup   - create $(VENV) with vLLM (CPU or GPU), Dynamo 1.6.1, LMCache, nats-server"
	@echo "make test    - run the whole test suite (real vLLM, Dynamo, nats-server; loopback only)"
	@echo "make demo    - run the demo on the embedded defaults"
	@echo "make bench   - run the benchmarks in benchmarks/"

setup:
	@VENV=$(VENV) GPU=$(or $(GPU),auto) bash scripts/setup.sh

test:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	$(PY) -m pytest $(PYTEST_ARGS)

demo:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	$(PY) -m maru_vllm.cli demo

bench:
	@test -x $(PY) || { echo "no $(VENV): run 'make setup' first"; exit 2; }
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .setup-logs .pytest_cache
