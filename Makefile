# Two commands on a fresh machine: `make shards`, then `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ROWS ?= 3000000
PROBES ?= 3000
DAYS ?= 2
SEED ?= 0
WORKERS ?= 2

.PHONY: setup shards test bench bench-gpu clean

setup: $(STAMP)

# Reinstalls only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,plots]'
	touch $(STAMP)

data/raw/.done: | $(STAMP)
	$(BIN)/prep synth --out data/raw --rows $(ROWS) --probes $(PROBES) --days $(DAYS) --seed $(SEED)
	touch $@

shards: setup data/raw/.done
	$(BIN)/prep shards data/raw --out shards --workers $(WORKERS) --seed $(SEED)

test: setup
	$(BIN)/python -m pytest tests

bench: setup
	$(BIN)/python -m bench.run

bench-gpu: setup
	$(BIN)/python -m bench.gpu

clean:
	rm -rf data shards runs
