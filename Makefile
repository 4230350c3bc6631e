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

# The main job, until the live stack lands: offline replays in virtual time.
# 1. The seed chapter's experiment: one engine, a capacity sweep.
# 2. Routing policies on a 4-replica fleet, with the report and charts in reports/fleet.
demo: $(INSTALLED)
	$(BIN)/prefix-router replay --workload chat --replicas 1 --policies round_robin \
		--sweep-capacity 1024,2048,4096,8192,16384 --out reports/seed
	$(BIN)/prefix-router replay --workload chat --replicas 4 --out reports/fleet

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

bench: $(INSTALLED)
	$(BIN)/python -m benchmarks.bench_engine_core
	$(BIN)/python -m benchmarks.bench_router
	$(BIN)/python -m benchmarks.bench_gateway

clean:
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache
