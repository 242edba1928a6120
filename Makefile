# onnxforge: `make run` serves on http://127.0.0.1:8000, `make test` runs the whole suite.
# Both create or refresh .venv from pyproject.toml when it changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP) ## Create or refresh .venv from pyproject.toml

run: $(STAMP) ## Serve the API on 127.0.0.1:8000 with embedded workers (nothing else needed)
	$(BIN)/onnxforge serve

serve: run ## Alias of run

worker: $(STAMP) ## Run a Celery worker (needs ONNXFORGE_BROKER__URL)
	$(BIN)/onnxforge worker

test: $(STAMP) browser ## Run the whole test suite (uses Redis/PostgreSQL on 127.0.0.1 when they answer)
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
	export DEBIAN_FRONTEND=noninteractive; \
	{ apt-get update -q && apt-get install -y -q --no-install-recommends chromium chromium-driver; } </dev/null \
		|| echo "make browser: apt-get could not install chromium chromium-driver" \
			"(the console's browser test fails until they are installed)" >&2

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

.PHONY: help venv run serve worker test browser lint fmt dev models bench clean
