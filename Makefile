# Developer entry points. `make demo` and `make test` work on a fresh machine:
# both run `make setup` first (idempotent; pip and Maven caches make re-runs fast).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 9092

.PHONY: setup demo test test-fast lint bench clean-kafka

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	bash scripts/setup.sh

demo: setup
	$(BIN)/trainsentry demo --port $(PORT)

test: setup
	bash scripts/test.sh

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint:
	$(BIN)/ruff check .
	$(BIN)/mypy

clean-kafka:
	$(BIN)/trainsentry kafka stop --port $(PORT) || true
