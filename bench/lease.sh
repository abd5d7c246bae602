#!/usr/bin/env bash
# One call on a lent GPU machine (an NVIDIA H100/H200 with its own Python 3.12 and jax; the
# device tool's README), ~8 minutes: every GPU figure the open work asks for, in one go.
#
#   make device-kit            # here, once: .whl/ (the wheels that image lacks), shards-1m/
#   device run: command "bash bench/lease.sh", carry [".whl", "shards-1m"], timeout_s 590
#
# 1. `bench.gpu_check --budget-s $CHECK_S`: device and versions, the GPU tests (cuDNN packed
#    and dense attention against XLA), the base model's benchmark, the batch sweep with its
#    profile and XLA dump, and a learning run in what the budget leaves.
# 2. `bench.gpu` on shards-1m with train's GPU default (cuDNN's dense attention since
#    2026-11-30, docs/learning.md 6.6), with the packed kernel beside it, then the default
#    under each flag of XLA_VARIANTS (a space-separated list, one process each; none by
#    default: 6.6 measured cublasLt, no Triton GEMMs and no command buffers at 0.98-1.02x),
#    and base with the recipe's pieces (`small`'s settings but its shape: issue 33's item 4).
# 3. `bench.recipe_gpu --seeds 0`: `small` at GPU batch sizes against every baseline, in
#    what is left of LEASE_S (at most RECIPE_S; skipped under 170 s).
# What comes back (a lent machine returns at most 8 files of 16 MiB): $OUT/lease.log, the
# XLA dump archive, and the rest (JSON, figures) in $OUT/results.tar.gz, rewritten after
# each step (a call stopped at its limit keeps what ended); unpack that into bench/results/.
# Each step runs whatever the one before it did; the exit code counts the steps that failed.
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

GPU=
if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  GPU=1
  PY=python3
  ls .whl/*.whl >/dev/null 2>&1 || { say "no .whl/*.whl: run 'make device-kit' here and carry .whl"; exit 2; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD
  CHECK=(--budget-s "${CHECK_S:-200}")
  BENCH=(--steps 40 --log-every 10)
  # small ran 2.5M tokens/s on 11-27 (bench.recipe_gpu's --rate); its stores' reads since
  # cost it about half of that on a CPU (README): planned at 0.6M, the run ends early, not late
  RECIPE=(--seeds 0 --rate 6e5)
  LEASE_S=${LEASE_S:-560}
else
  PY=${PYTHON:-.venv/bin/python}
  export PYTHONPATH=$PWD
  say "no GPU: the dry run, each step at a CPU's size, into $OUT"
  CHECK=(--points 1 --queries 200)
  BENCH=(--steps 6 --log-every 2)  # (auto is XLA on a CPU; both cuDNN kernels need a GPU)
  RECIPE=(--seeds 0 --rows 30000 --steps 20 --queries 200)
  LEASE_S=${LEASE_S:-100000}
fi
read -ra VARIANTS <<< "${XLA_VARIANTS:-}"
# `small`'s settings that are not its shape (train.model.arch.MODELS): base with them is the
# recipe's model at base's size
RECIPE_PIECES=(grammar_embed=true init_std=0.08 match_dst=4.0 byte_features=7 dst_memory=8192
               dst_prior_scale=30.0 anonymize_src=true context_copy=0.3 copy_aux=1.0
               dst_store=32768 pair_store=65536 store_by_source=true placed_store=0.25
               gate_fold=8 store_without_fold=true pair_forward=8 pair_min=4 pair_recent=8
               pair_recent_own=true pair_recent_check=true pair_fail=true pair_fail_recent=16
               pair_shared=false pair_shared_by_split=true)
[ -f shards-1m/manifest.json ] || { say "no shards-1m: run 'make device-kit' here and carry shards-1m"; exit 2; }
failed=0
step() {
  say "$*"
  "$@"
  local rc=$?
  [ $rc -eq 0 ] || { failed=$((failed + 1)); say "failed (exit $rc): $*"; }
  mv "$OUT"/r/xla-*.tar.gz "$OUT"/ 2>/dev/null
  tar czf "$OUT/results.tar.gz" -C "$OUT/r" .
}
step $PY -m bench.gpu_check "${CHECK[@]}" --results "$OUT/r"
step $PY -m bench.gpu "${BENCH[@]}" --data shards-1m --out "$OUT/r/gpu-default.json"
[ -n "$GPU" ] && step $PY -m bench.gpu "${BENCH[@]}" --attention cudnn --data shards-1m \
  --out "$OUT/r/gpu-packed.json"
for i in "${!VARIANTS[@]}"; do
  step env XLA_FLAGS="${XLA_FLAGS:-} ${VARIANTS[$i]}" \
    $PY -m bench.gpu "${BENCH[@]}" --data shards-1m --out "$OUT/r/gpu-default-xla$i.json"
done
step $PY -m bench.gpu "${BENCH[@]}" --data shards-1m --out "$OUT/r/gpu-recipe-pieces.json" \
  $(printf -- '--model-set %s ' "${RECIPE_PIECES[@]}")
left=$((LEASE_S - (SECONDS - start)))
if [ "$left" -ge 170 ]; then
  budget=$((left - 20 < ${RECIPE_S:-300} ? left - 20 : ${RECIPE_S:-300}))
  [ -n "${GPU:-}" ] && RECIPE+=(--budget-s "$budget")
  step timeout "$((budget + 15))" $PY -m bench.recipe_gpu "${RECIPE[@]}" --results "$OUT/r"
else
  say "recipe_gpu skipped: ${left} s left of LEASE_S ${LEASE_S}"
fi
rm -rf "$OUT/r"
say "done, $failed step(s) failed; in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$failed"
