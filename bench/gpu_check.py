"""`make gpu-check`: is this GPU machine ready, and how fast does it train? One command.

1. The device and the versions (GPUs from nvidia-smi, jax, jaxlib, the CUDA plugin,
   cuDNN), and whether the cuDNN packed attention compiles here (train.model.attention).
2. A visible NVIDIA GPU with a CPU-only jax stops here with the install command.
3. The GPU tests (`pytest -m gpu` on the test files that hold GPU tests: cuDNN packed
   attention equals XLA for outputs and gradients, bf16, on rows of 1 segment, 2 segments,
   the maximum, and padding only).
4. The GPU benchmark (bench/gpu.py) of the base (~95M) config on packed shards of the
   built-in data (`prep synth` + `prep shards --split time+probe`), writing
   bench/results/gpu-<device>.json.
5. On a GPU, the base model's learning run (bench/learning.py) on the same shards:
   LEARNING_STEPS steps of 48 rows of 1024 tokens (~200M tokens, about 10 minutes at the
   338k tokens/s measured on an H200), checkpoints each scored by `train eval`'s machinery against every
   baseline, context baselines included; writes bench/results/learning-<device>-base.json
   beside the benchmark (docs/learning.md says why this is the experiment to run). With
   ``--budget-s S`` the whole check ends within S seconds: the learning run takes as many
   steps as the benchmark's measured rate leaves time for, and says so.

Exit 0 only if every step that applies passed. Without a GPU it says what it skips: the GPU
tests skip, and the benchmark runs the tiny config on the CPU on a small dataset (to keep
the script itself tested; not GPU numbers).

    make gpu-check                                   # everything, full length
    python -m bench.gpu_check --budget-s 540 --results /tmp/out   # a lent machine's 9 minutes
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# ~200M tokens of 48 x 1024-token rows: ~10 min at the 338k tokens/s an H200 gave
LEARNING_STEPS = 4_000
LEARNING_POINTS = 6
# what a learning run costs besides its steps: compiling, and per checkpoint the evaluation
# (model forward, baselines fit on the train split); an H200 took ~12 s and ~25 s a point
COMPILE_S, EVAL_POINT_S = 30, 30
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[gpu-check {time.monotonic() - T0:5.0f}s] {msg}", file=sys.stderr, flush=True)


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "optax",
                "orbax-checkpoint", "grain", "array_record", "numba", "pyarrow"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        out["cudnn"] = cudnn.check_cudnn_version()
    except Exception:  # no CUDA backend here: no cuDNN to ask
        pass
    return out


def prep(*args: str) -> None:
    """`prep ARGS` through this interpreter (a machine may have no console scripts)."""
    subprocess.run([sys.executable, "-m", "prep.cli", *args], check=True, cwd=REPO)


def learning_steps(tokens_per_s: float | None, left_s: float, batch: int, row_len: int,
                   points: int) -> int:
    """Steps that fit ``left_s`` seconds at ``tokens_per_s`` real tokens a second, after
    compiling and ``points`` evaluations; at most LEARNING_STEPS, at least 100."""
    if not tokens_per_s:
        return LEARNING_STEPS
    train_s = left_s - COMPILE_S - points * EVAL_POINT_S
    # the benchmark counts real tokens; a step holds batch x row_len slots, ~0.2 % padding
    steps = int(0.9 * train_s * tokens_per_s / (batch * row_len))
    return max(100, min(LEARNING_STEPS, steps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=None,
                   help="end within this many seconds: the learning run is cut to fit [none]")
    p.add_argument("--results", default=None, help="folder for the JSON [bench/results]")
    p.add_argument("--points", type=int, default=LEARNING_POINTS,
                   help=f"checkpoints of the learning run evaluated [{LEARNING_POINTS}]")
    p.add_argument("--queries", type=int, default=20_000, help="RTT queries per point [20000]")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.run import RESULTS
    from prep.schema.errors import InputError
    from train.fit import device
    from train.fit.config import GPU_ROWS
    from train.model import attention

    results = Path(args.results) if args.results else RESULTS
    gpus = device.nvidia_gpus()
    say(f"nvidia-smi: {'; '.join(gpus) if gpus else 'no NVIDIA GPU'}")
    try:
        platform = device.check_backend("auto")
    except InputError as e:
        say(f"error: {e}")
        return 2
    import jax

    say(f"jax devices: {', '.join(f'{d.platform}:{d.device_kind}' for d in jax.devices())}")
    say("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    why = attention.why_not_cudnn()
    say(f"cuDNN packed attention: {'compiles here' if why is None else 'unavailable: ' + why}")
    failed = []
    gpu = platform == "gpu"
    if gpu and why is not None:
        failed.append("cuDNN packed attention")

    marked = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").glob("test_*.py")
                    if "mark.gpu" in f.read_text())
    say(f"GPU tests: pytest -m gpu {' '.join(marked)}" + ("" if gpu else " (no GPU: they skip)"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs",
                        "-p", "no:cacheprovider", *marked], cwd=REPO)
    if r.returncode not in (0, 5):
        failed.append("GPU tests")

    rows, probes = (3_000_000, 3_000) if gpu else (20_000, 100)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        say(f"data: prep synth --rows {rows:,} + prep shards --split time+probe"
            + ("" if gpu else " (small: no GPU)"))
        prep("synth", "--out", f"{tmp}/raw", "--rows", str(rows), "--probes", str(probes),
             "--days", "2", "--seed", "0")
        prep("shards", f"{tmp}/raw", "--out", f"{tmp}/tp", "--split", "time+probe", "--quiet")
        say(f"data ready in {time.perf_counter() - t0:.0f} s; benchmark"
            + ("" if gpu else ": no GPU, so the tiny config on the CPU (not GPU numbers)"))
        from bench import gpu as bench_gpu

        bench_out = results / f"gpu-{bench_gpu.device_name() if gpu else 'cpu-tiny'}.json"
        if bench_gpu.main(["--data", f"{tmp}/tp", "--out", str(bench_out)]
                          + (["--steps", "200"] if gpu and args.budget_s else [])) != 0:
            failed.append("benchmark")
        if gpu:
            from bench import learning

            steps = LEARNING_STEPS
            if args.budget_s:
                rate = None
                if bench_out.exists():
                    rate = json.loads(bench_out.read_text())["metrics"]["gpu.real_tokens_per_s"]
                left = args.budget_s - (time.monotonic() - T0)
                steps = learning_steps(rate, left, GPU_ROWS * jax.device_count(), 1024, args.points)
                say(f"budget: {left:.0f} s left at {rate or 0:,.0f} tokens/s: the learning run "
                    f"takes {steps:,} steps" + (f", not {LEARNING_STEPS:,}"
                                                if steps < LEARNING_STEPS else ""))
            say(f"learning run: base, {steps:,} steps on --split time+probe")
            if learning.main(["--data", f"{tmp}/tp", "--model", "base", "--steps", str(steps),
                              "--points", str(args.points), "--queries", str(args.queries),
                              "--run-dir", f"{tmp}/learning-run",
                              "--out", str(results / f"learning-{bench_gpu.device_name()}-base.json")]) != 0:
                failed.append("learning run")
        else:
            say("learning run: skipped (no GPU); on a CPU it is the small recipe: "
                "python -m bench.learning --data shards-256 --model small")
    if failed:
        say(f"FAILED: {', '.join(failed)}")
        return 1
    say("ok" if gpu else "ok (no GPU here: GPU tests skipped, benchmark on the CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
