# Two commands on a fresh machine: `make shards`, then `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CUDA=12|13|none; by default 12 or 13 (the driver's CUDA version, from nvidia-smi) when
# `nvidia-smi -L` lists a GPU, else none (a CPU-only jax)
CUDA ?= $(shell if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
          v=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1); \
          if [ "$${v:-12}" -ge 13 ]; then echo 13; else echo 12; fi; else echo none; fi)
comma := ,
EXTRAS := dev,plots$(if $(filter 12 13,$(CUDA)),$(comma)cuda$(CUDA))
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
ROWS ?= 3000000
PROBES ?= 3000
DAYS ?= 2
SEED ?= 0
WORKERS ?= 2

.PHONY: setup shards test bench bench-gpu gpu-check device-kit wheel clean

setup: $(STAMP) $(VENV)/.kernels

# Reinstalls only when pyproject.toml changes. No pip cache: a CI machine's disk once ran out
# during the install (2026-11-30), and a fresh venv gains nothing from one.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-cache-dir --upgrade pip
	$(BIN)/python -m pip install -q --no-cache-dir -e '.[$(EXTRAS)]'
	touch $(STAMP)

# The Numba kernels of `prep shards`, compiled into Numba's cache (on 2 processes when a core
# is idle), so that the first `prep shards` and each test process load them; again after an
# install or when a source file is newer (an edit, a checkout; prep/shards/kernels.py).
$(VENV)/.kernels: $(STAMP) $(shell find prep train -name '*.py')
	$(BIN)/prep kernels
	touch $@

# (the stamp of earlier versions, data/raw/.done, would be a file prep synth did not write)
# Again when the generator changes (its world did on 2026-11-29): old data is other data.
data/raw.done: prep/ingest/synth.py | $(STAMP)
	rm -f data/raw/.done
	$(BIN)/prep synth --out data/raw --rows $(ROWS) --probes $(PROBES) --days $(DAYS) --seed $(SEED) --overwrite
	touch $@

shards: setup data/raw.done
	$(BIN)/prep shards data/raw --out shards --workers $(WORKERS) --seed $(SEED) --overwrite

# lint-imports: the stages' one-way order (pyproject.toml, [tool.importlinter]). The tests
# run on TEST_WORKERS processes (pytest-xdist), each taking whole modules, the slow ones
# first (tests/conftest.py); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

bench: setup
	$(BIN)/python -m bench.run

bench-gpu: setup
	$(BIN)/python -m bench.gpu

# On a GPU machine: device and versions, the GPU tests, the base-config benchmark on packed
# shards of the built-in data; bench/results/gpu-<device>.json. On a CPU: says what it skips.
gpu-check: setup
	$(BIN)/python -m bench.gpu_check

# A lent GPU machine's kit (README, "On a lent GPU machine"): what its image lacks, as wheels
# for its Python 3.12 at this venv's versions, in .whl/, and shards-1m (the built-in world's
# measurements per probe, 1M rows, ~19 MB: small enough to carry); then one call runs
# bench/lease.sh there.
DEVICE_WHEELS := grain array-record msgspec portpicker orbax-checkpoint
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
                    manylinux2014_x86_64 manylinux1_x86_64
device-kit: setup
	rm -rf .whl && mkdir .whl
	for p in $(DEVICE_WHEELS); do \
	  v=$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('$$p'))") || exit 1; \
	  $(BIN)/python -m pip download -q --no-cache-dir --no-deps --only-binary=:all: \
	    --python-version 3.12 --implementation cp $(addprefix --platform ,$(DEVICE_PLATFORMS)) \
	    -d .whl "$$p==$$v" || exit 1; \
	done
	test -f shards-1m/manifest.json || { \
	  $(BIN)/prep synth --out data/raw-1m --rows 1000000 --probes 1000 --days 2 --seed 0 --overwrite \
	  && $(BIN)/prep shards data/raw-1m --out shards-1m --workers $(WORKERS) --overwrite; }
	@ls -l .whl; du -sh .whl shards-1m

# This package as a wheel, for Beam workers on a cluster (README, "Beam on a cluster")
wheel: setup
	$(BIN)/python -m pip wheel -q --no-deps -w dist .

clean:
	rm -rf data shards runs
