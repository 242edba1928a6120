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

test: $(STAMP) ## Run the whole test suite (uses Redis/PostgreSQL on 127.0.0.1 when they answer)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP) ## Lint with ruff
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

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

.PHONY: help venv run serve worker test lint fmt dev models bench clean
