# onnxforge: `make run` serves on http://127.0.0.1:8000, `make test` runs the whole suite.
# Both create or refresh .venv from pyproject.toml when it changed: `run` with what serving needs (the cpu
# and prepost extras), `test` with the test extra on top.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-12s %s\n", $$1, $$2}'

$(SERVE_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,prepost]'
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP) ## Create or refresh .venv from pyproject.toml (with the test extra)

run: $(SERVE_STAMP) ## Serve the API on 127.0.0.1:8000 with embedded workers (nothing else needed)
	$(BIN)/onnxforge serve

serve: run ## Alias of run

worker: $(STAMP) ## Run a Celery worker (needs ONNXFORGE_BROKER__URL)
	$(BIN)/onnxforge worker

test: $(STAMP) browser servers ## Run the whole test suite (starts private Redis/PostgreSQL when none answers)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The console's browser test drives Debian's Chromium through chromedriver (Selenium, from the test extra).
# Installed only when missing; without root or apt the test fails naming what to install, it never skips.
browser: ## Install chromium and chromium-driver for the console's browser test (Debian, as root; once)
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "make browser: chromium and chromedriver are missing; install them as root with" \
			"'apt-get install chromium chromium-driver' (the console's browser test fails until then)" >&2; \
		exit 0; \
	fi; \
	{ apt-get update -q && $(APT_INSTALL) chromium chromium-driver; } </dev/null \
		|| echo "make browser: apt-get could not install chromium chromium-driver" \
			"(the console's browser test fails until they are installed)" >&2

# The suite uses the Redis and PostgreSQL already answering on 127.0.0.1, else starts private ones from
# these binaries (tests/conftest.py); redis-cli and pg_isready run the compose healthchecks for real.
# Debian's postgresql puts initdb and pg_ctl under /usr/lib/postgresql/<version>/bin, where the tests look.
SERVER_BINARIES := redis-server redis-cli pg_isready
servers: ## Install redis-server and postgresql for the tests when missing (Debian, as root; once)
	@missing=""; \
	for b in $(SERVER_BINARIES); do command -v $$b >/dev/null 2>&1 || missing="$$missing $$b"; done; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing initdb"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "make servers:$$missing missing; install them as root with" \
			"'apt-get install redis-server postgresql' (the tests that need them fail until then)" >&2; \
		exit 0; \
	fi; \
	{ apt-get update -q && $(APT_INSTALL) redis-server redis-tools postgresql postgresql-client; } </dev/null \
		|| echo "make servers: apt-get could not install redis-server postgresql" \
			"(the tests that need them fail until they are installed)" >&2

# The images install exactly these pins (with hashes), for the Python of the images (Dockerfile's
# PYTHON_VERSION): two builds a week apart run the same ONNX Runtime. The cpu lock takes the ONNX Runtime
# version of the gpu lock, so both flavours report and behave alike. Needs PyPI; review the diff, commit.
IMAGE_PYTHON := $(shell sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile)
LOCK_FLAGS := --python-version $(IMAGE_PYTHON) --python-platform x86_64-manylinux_2_28 --generate-hashes --quiet
lock: $(STAMP) ## Re-pin deploy/requirements/{cpu,gpu}.lock from pyproject.toml (uv; for the images)
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/uv pip compile pyproject.toml --extra gpu --extra prepost --extra otel $(LOCK_FLAGS) -o deploy/requirements/gpu.lock
	sed -n 's/^onnxruntime-gpu==\([^ ]*\).*/onnxruntime==\1/p' deploy/requirements/gpu.lock > $(VENV)/ort-pin.txt
	$(BIN)/uv pip compile pyproject.toml --extra cpu --extra prepost --extra otel -c $(VENV)/ort-pin.txt $(LOCK_FLAGS) \
		-o deploy/requirements/cpu.lock

lint: $(STAMP) ## Lint with ruff and check the floors (import-linter contracts in pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

fmt: $(STAMP) ## Format with ruff
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

dev: $(STAMP) ## Install the dev extra (torch CPU wheel, transformers) for model-building scripts
	$(BIN)/python -m pip install --quiet -e '.[dev,test]'

models: dev ## Rebuild the committed test models
	$(BIN)/python -m tests.models.build_all

bench: dev ## Run the benchmarks (see bench/README.md)
	$(BIN)/python -m bench.run

clean: ## Remove the venv and local state
	rm -rf $(VENV) var .pytest_cache

.PHONY: help venv run serve worker test browser servers lock lint fmt dev models bench clean
