#!/usr/bin/env bash
# One call on a lent GPU machine (an NVIDIA H100/H200 with its own Python 3.12 and jax; the
# device tool's README), ~8.5 minutes: every GPU figure the open work asks for, in one go.
#
#   make device-kit            # here, once: .whl/ (the wheels that image lacks), shards-1m/
#   device run: command "bash bench/lease.sh", carry [".whl", "shards-1m"], timeout_s 590
#
# 1. `bench.gpu_check --budget-s $CHECK_S`: device and versions, the GPU tests (cuDNN packed
#    and dense attention against XLA), the base model's benchmark, the batch sweep with its
#    profile and XLA dump, and a learning run in what the budget leaves.
# 2. `bench.gpu` on shards-1m with the dense cuDNN attention (docs/learning.md 6.4).
# 3. `bench.recipe_gpu --seeds 0 --budget-s $RECIPE_S`: `small` at GPU batch sizes against
#    every baseline.
# What comes back (a lent machine returns at most 8 files of 16 MiB): $OUT/lease.log, the
# XLA dump archive, and the rest (JSON, figures) in $OUT/results.tar.gz; unpack that into
# bench/results/. Each step runs whatever the one before it did; the exit code counts the
# steps that failed.
#
# Without a GPU (nvidia-smi lists none) this is the dry run: the venv's Python, no wheels
# installed, each step at a size a CPU ends in a few minutes, into $OUT or a new
# temporary folder it names.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t lease-XXXXXX)}
mkdir -p "$OUT/r"
exec > >(tee "$OUT/lease.log") 2>&1
export PYTHONUNBUFFERED=1
start=$SECONDS
say() { echo "[lease +$((SECONDS - start))s] $*"; }

if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  PY=python3
  ls .whl/*.whl >/dev/null 2>&1 || { say "no .whl/*.whl: run 'make device-kit' here and carry .whl"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
  CHECK=(--budget-s "${CHECK_S:-300}")
  DENSE=(--steps 40 --log-every 10 --attention dense)
  RECIPE=(--seeds 0 --budget-s "${RECIPE_S:-130}")
else
  PY=${PYTHON:-.venv/bin/python}
  export PYTHONPATH=$PWD
  say "no GPU: the dry run, each step at a CPU's size, into $OUT"
  CHECK=(--points 1 --queries 200)
  DENSE=(--steps 6 --log-every 2 --attention xla)  # (the dense kernel is cuDNN's)
  RECIPE=(--seeds 0 --rows 30000 --steps 20 --queries 200)
fi
[ -f shards-1m/manifest.json ] || { say "no shards-1m: run 'make device-kit' here and carry shards-1m"; exit 2; }
failed=0
step() {
  say "$*"
  "$@"
  local rc=$?
  [ $rc -eq 0 ] || { failed=$((failed + 1)); say "failed (exit $rc): $*"; }
}
step $PY -m bench.gpu_check "${CHECK[@]}" --results "$OUT/r"
step $PY -m bench.gpu "${DENSE[@]}" --data shards-1m --out "$OUT/r/gpu-dense.json"
step $PY -m bench.recipe_gpu "${RECIPE[@]}" --results "$OUT/r"
mv "$OUT"/r/xla-*.tar.gz "$OUT"/ 2>/dev/null
tar czf "$OUT/results.tar.gz" -C "$OUT/r" . && rm -rf "$OUT/r"
say "done, $failed step(s) failed; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$failed"
