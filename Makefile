# One command sets up and runs the quickstart, one sets up and runs the tests (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The build and docs tools (.ci/tools-requirements.txt) live in a venv of their own that sees the dev venv's packages
# through a .pth file: they need newer requests/urllib3 than torchattacks (a dev dependency) accepts.
TOOLS ?= .venv-tools

.PHONY: setup tools quickstart test test-min lint package docs format bench clean

# The stamp depends on pyproject.toml, so changed dependencies are installed again.
$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV) with the dev extra (test references, transformers, DeepSpeed): minutes on a fresh machine"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

$(TOOLS)/.installed: $(VENV)/.installed .ci/tools-requirements.txt
	.ci/overlay_venv.sh $(BIN)/python $(TOOLS)
	$(BIN)/python -m pip --python $(TOOLS)/bin/python install --quiet --no-warn-conflicts -r .ci/tools-requirements.txt
	touch $@

tools: $(TOOLS)/.installed

# The quickstart needs the package alone; `make test` adds the dev extra to the same venv.
$(VENV)/.installed-package: pyproject.toml
	@echo "setting up $(VENV) with the package and its dependencies: a minute or two on a fresh machine"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

quickstart: $(VENV)/.installed-package
	$(BIN)/python train.py fit --config configs/quickstart.yaml

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Wheel + sdist, twine check, the wheel installed in a fresh venv runs the quickstart outside the repository.
package: tools
	.ci/check_wheel.sh $(BIN)/python $(TOOLS)/bin/python

# The docs site, strictly: every warning (a broken reference, a public object without a docstring) fails.
docs: tools
	$(TOOLS)/bin/python docs/build.py

test: lint package docs
	$(BIN)/python -m pytest -q

# The tests on the lowest versions that pyproject.toml declares (constraints/minimum.txt), in a venv of their own.
# torch and torchvision are not pinned: MIN_TORCH is what pip installs first, e.g.
# MIN_TORCH="torch==2.4.1 torchvision==0.19.1 --index-url https://download.pytorch.org/whl/cpu" make test-min
VENV_MIN ?= .venv-min
MIN_TORCH ?= torch torchvision

$(VENV_MIN)/.installed: pyproject.toml constraints/minimum.txt
	@echo "setting up $(VENV_MIN) with the minimum versions of constraints/minimum.txt: minutes on a fresh machine"
	$(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_MIN)/bin/python -m pip install --quiet $(MIN_TORCH)
	$(VENV_MIN)/bin/python -m pip install --quiet -r constraints/minimum.txt
	$(VENV_MIN)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

test-min: $(VENV_MIN)/.installed
	$(VENV_MIN)/bin/python -m pytest -q

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python benchmarks/bench_metrics.py
	$(BIN)/python benchmarks/bench_overhead.py
	$(BIN)/python benchmarks/bench_gram_update.py

clean:
	rm -rf $(VENV) $(TOOLS) $(VENV_MIN) runs wandb build dist docs/_build .pytest_cache .ruff_cache
