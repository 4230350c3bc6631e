# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(INSTALLED)

install: $(INSTALLED)

# The main job: the seed chapter's experiment replayed offline, with a capacity sweep.
demo: $(INSTALLED)
	$(BIN)/prefix-router replay --workload chat --replicas 1 --sweep-capacity 256,1024,2048,4096,8192,16384 --json reports/demo.json

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

bench: $(INSTALLED)
	$(BIN)/python -m benchmarks.bench_engine_core

clean:
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache
