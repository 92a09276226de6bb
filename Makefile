# One command sets up and runs the quickstart, one sets up and runs the tests (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup quickstart test lint format bench clean

# The stamp depends on pyproject.toml, so changed dependencies are installed again.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

quickstart: setup
	$(BIN)/python train.py fit --config configs/quickstart.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python benchmarks/bench_metrics.py
	$(BIN)/python benchmarks/bench_overhead.py

clean:
	rm -rf $(VENV) runs wandb .pytest_cache .ruff_cache
