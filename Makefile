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

# The main job: round_robin, cache_aware_approx and cache_aware under real HTTP load
# (Locust) on an embedded deployment of 4 replicas; the report and charts in reports/bench.
demo: $(INSTALLED)
	$(BIN)/prefix-router bench --out reports/bench

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest

bench: $(INSTALLED)
	$(BIN)/python -m benchmarks.bench_engine_core
	$(BIN)/python -m benchmarks.bench_router
	$(BIN)/python -m benchmarks.bench_gateway

clean:
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache
