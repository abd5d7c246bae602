"""`make gpu-check`: is this GPU machine ready, and how fast does it train? One command.

1. The device and the versions (GPUs from nvidia-smi, jax, jaxlib, the CUDA plugin,
   cuDNN), and whether cuDNN's dense attention (train's GPU default) and its packed one
   compile here (train.model.attention).
2. A visible NVIDIA GPU with a CPU-only jax stops here with the install command.
3. The GPU tests (`pytest -m gpu`: cuDNN packed and dense attention against XLA).
4. The GPU benchmark (bench/gpu.py, a process of its own) of the base config on packed
   shards of the built-in data, writing bench/results/gpu-<device>.json.
5. The batch sweep: the same at SWEEP_ROWS rows a step, each in its own process (so each
   peak memory is its own and a batch that does not fit fails alone); at PROFILE_ROWS a
   jax.profiler trace and XLA's dump of the train step. Writes gpu-<device>-batch.json and
   xla-<device>.tar.gz, with the CPU-read activation bytes (train.model.memory) beside.
6. On a GPU, the base model's learning run (bench/learning.py, LEARNING_STEPS steps of 48
   rows), checkpoints scored against every baseline, into learning-<device>-base.json
   (docs/learning.md says why this is the experiment to run). ``--budget-s S`` ends the
   check within S seconds: the run takes the steps the benchmark's rate leaves time for,
   or is skipped with less than LEARNING_MIN_S left.

Exit 0 only if every step that applies passed (a batch that does not fit is a finding of
the sweep, not a failure). Without a GPU the GPU tests skip and steps 4-5 run the tiny
config on the CPU, to keep the script itself tested; its files are no results, so they go
to a new temporary folder (``results_dir``), not into the checkout, unless --results names one.

    make gpu-check                                   # everything, full length
    python -m bench.gpu_check --budget-s 540 --results /tmp/out   # a lent machine's 9 minutes
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# ~200M tokens of 48 x 1024-token rows: ~10 min on an H200 (docs/measurements.md)
LEARNING_STEPS = 4_000
LEARNING_POINTS = 6
# what a learning run costs besides its steps: compiling, and per checkpoint the evaluation
# (model forward, baselines fit on the train split), with a margin over an H200's
COMPILE_S, EVAL_POINT_S = 30, 30
# under a budget, a learning run with less than this left is not worth its compile and
# evaluations: skipped
LEARNING_MIN_S = 150
# the batch sweep (rows of 1024 a step, per GPU): the default (train.fit.config.GPU_ROWS)
# and up to the size that must fit an 80 GB card; each SWEEP_STEPS steps in windows of
# SWEEP_WINDOW, the last TRACE_STEPS of those at PROFILE_ROWS traced. On a CPU, the tiny
# config at CPU_SWEEP_ROWS, to keep the code path tested
SWEEP_ROWS, PROFILE_ROWS, CPU_SWEEP_ROWS = (48, 64, 96, 128), (48, 64), (2, 4)
SWEEP_STEPS, SWEEP_WINDOW, TRACE_STEPS = 40, 10, 5
# what of an XLA dump goes into the archive: the compiled step, its buffers, its memory
DUMP_KEEP = ("after_optimizations.txt", "buffer-assignment.txt", "memory-usage-report.txt")
DUMP_MAX_BYTES = 15 * 2**20  # a lent machine returns files of at most 16 MiB
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
                   points: int, *, most: int = LEARNING_STEPS) -> int:
    """Steps that fit ``left_s`` seconds at ``tokens_per_s`` real tokens a second, after
    compiling and ``points`` evaluations; at most ``most``, at least 100."""
    if not tokens_per_s:
        return most
    train_s = left_s - COMPILE_S - points * EVAL_POINT_S
    # the benchmark counts real tokens; a step holds batch x row_len slots, ~0.2 % padding
    steps = int(0.9 * train_s * tokens_per_s / (batch * row_len))
    return max(100, min(most, steps))


def batch_sweep(data: str, results: Path, name: str, gpu: bool, n_devices: int,
                work: Path, env: dict) -> tuple[dict, Path | None]:
    """Step 5 of the module docstring: (the sweep's JSON, the XLA dump archive or None);
    ``env`` the benchmark processes' environment."""
    from bench.run import machine
    from train.fit import reader
    from train.model import arch, memory

    rows = SWEEP_ROWS if gpu else CPU_SWEEP_ROWS
    profile = PROFILE_ROWS if gpu else CPU_SWEEP_ROWS
    runs, failed = [], []
    for b in rows:
        out, dump = work / f"sweep-{b}.json", work / f"xla-{b}"
        run_env = dict(env)
        if b in profile:  # XLA reads its flags when the backend starts: a process of its own
            run_env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_"
                                    "dump_hlo_as_text --xla_dump_hlo_module_re=train_step").strip()
        cmd = [sys.executable, "-m", "bench.gpu", "--data", data, "--out", str(out),
               "--batch-size", str(b * n_devices), "--steps", str(SWEEP_STEPS if gpu else 12),
               "--log-every", str(SWEEP_WINDOW if gpu else 3)]
        cmd += ["--trace-steps", str(TRACE_STEPS if gpu else 3)] if b in profile else []
        say(f"sweep: {b} rows a step" + (" (traced, XLA dump)" if b in profile else ""))
        r = subprocess.run(cmd, cwd=REPO, env=run_env, stderr=subprocess.PIPE, text=True)
        err = r.stderr.strip().splitlines()
        sys.stderr.write("\n".join(err[-8:]) + "\n")
        if r.returncode != 0 or not out.exists():
            why = next((ln for ln in reversed(err) if "RESOURCE_EXHAUSTED" in ln
                        or "out of memory" in ln.lower()), err[-1] if err else "no output")
            failed.append({"batch_size": b * n_devices, "error": why.strip()[:400]})
            say(f"sweep: {b} rows failed: {why.strip()[:200]}")
            continue
        rec = json.loads(out.read_text())
        m = rec["metrics"]
        runs.append({"batch_size": m["gpu.batch_size"],
                     "tokens_per_s": m["gpu.real_tokens_per_s"], "mfu": m["gpu.mfu"],
                     "step_ms": m["gpu.step_ms"],
                     "data_wait": m["gpu.data_wait"], "peak_gib": m["gpu.peak_gib"],
                     "memory_limit_gib": m["gpu.memory_limit_gib"],
                     "attention": rec["config"]["attention"],
                     **({"top_ops": rec["top_ops"]} if "top_ops" in rec else {})})
    # throughput rises (within 3 %, a run's noise) with the batch, up to the largest that fits
    rates = [r["tokens_per_s"] for r in runs if r["tokens_per_s"]]
    rising = all(b >= 0.97 * max(rates[:k + 1]) for k, b in enumerate(rates))
    # what the CPU reads of the step's activations (train.model.memory), to hold the peaks
    # to: the XLA path's count, and on the cuDNN path its output and the softmax statistics
    # sized by these shards' segment table
    cfg = arch.MODELS["base" if gpu else "tiny"]
    segments = max(2, reader.max_segments(json.loads((Path(data) / "manifest.json").read_text())))
    xla = memory.per_token_layer(cfg)["bytes"]
    cudnn = xla + 2 * cfg.d_model + memory.cudnn_stats_bytes(cfg, segments)
    what = ("base, bf16" if gpu else "tiny, float32 (a CPU: not GPU numbers)")
    sweep = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": gpu,
             "what": f"bench/gpu.py at each batch size, {what}, one process each on the same "
                     "shards; peak = the allocator's high-water mark",
             "runs": runs, "failed": failed, "throughput_rises_with_batch": rising,
             "cpu_read": {"bytes_per_token_layer_xla": xla, "max_segments": segments,
                          "bytes_per_token_layer_cudnn": cudnn,
                          "cudnn_gib_per_row": cudnn * 1024 * cfg.n_layers / 2**30}}
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in runs:
        say(f"sweep: {r['batch_size']:4d} rows {fmt(r['tokens_per_s'], '12,.0f')} tokens/s, MFU "
            f"{fmt(r['mfu'], '.3f')}, step {fmt(r['step_ms'], '.1f')} ms, "
            f"peak {fmt(r['peak_gib'], '.1f')} of {fmt(r['memory_limit_gib'], '.1f')} GiB")
    say("sweep: throughput " + ("rises with the batch" if rising
                                else "FALLS somewhere with the batch (a cliff)"))
    return sweep, _dump_archive(work, results / f"xla-{name}.tar.gz")


def _dump_archive(work: Path, path: Path) -> Path | None:
    """The kept parts of the sweep's XLA dumps (DUMP_KEEP) in one .tar.gz, within the size a
    lent machine returns (the largest left out first, and named in the log)."""
    files = sorted((f for f in work.glob("xla-*/*") if f.name.endswith(DUMP_KEEP)),
                   key=lambda f: f.stat().st_size)
    if not files:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    while files:
        with tarfile.open(path, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f"{f.parent.name}/{f.name}")
        if path.stat().st_size <= DUMP_MAX_BYTES:
            return path
        say(f"XLA dump: {files[-1].name} left out ({files[-1].stat().st_size / 2**20:.1f} MiB)")
        files.pop()
    path.unlink()
    return None


def results_dir(given: str | None, gpu: bool, default: Path) -> Path:
    """Where the JSON goes: --results, else ``default`` (bench/results) on a GPU; a CPU's
    dry run, whose numbers are not GPU numbers, gets a temporary folder of its own, which
    it keeps (the log names it), so `make gpu-check` leaves the checkout as it was."""
    if given:
        return Path(given)
    return default if gpu else Path(tempfile.mkdtemp(prefix="gpu-check-cpu-"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-s", type=float, default=None,
                   help="end within this many seconds: the learning run is cut to fit [none]")
    p.add_argument("--results", default=None, help="folder for the JSON [bench/results; "
                   "without a GPU a new temporary folder]")
    p.add_argument("--points", type=int, default=LEARNING_POINTS,
                   help=f"checkpoints of the learning run evaluated [{LEARNING_POINTS}]")
    p.add_argument("--queries", type=int, default=20_000, help="RTT queries per point [20000]")
    args = p.parse_args(argv)
    # This process probes, orchestrates and runs the learning run at the end; the benchmark
    # and the sweep run in processes of their own, with train's default memory (XLA takes 75 %
    # of the GPU up front). Were this process to take its 75 % first, they would get what is
    # left (XLA backs off to what it can allocate), and every size past it would not fit.
    bench_env = dict(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, str(REPO))
    from bench.run import RESULTS
    from prep.schema.errors import InputError
    from train.fit import device
    from train.fit.config import GPU_ROWS
    from train.model import attention

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
    # train's GPU default (dense), and the packed kernel (Hopper or newer), which it is not
    dense, packed = attention.why_not_dense(), attention.why_not_cudnn()
    for name, why in (("dense (train's default on a GPU)", dense), ("packed", packed)):
        say(f"cuDNN {name} attention: {'compiles here' if why is None else 'unavailable: ' + why}")
    failed = []
    gpu = platform == "gpu"
    if gpu and dense is not None:
        failed.append("cuDNN dense attention")
    results = results_dir(args.results, gpu, RESULTS)
    results.mkdir(parents=True, exist_ok=True)
    say(f"results: {results}" + ("" if gpu or args.results else
                                 " (no GPU: a CPU dry run, kept out of bench/results)"))

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

        name = bench_gpu.device_name() if gpu else "cpu-tiny"
        bench_out = results / f"gpu-{name}.json"
        if subprocess.run([sys.executable, "-m", "bench.gpu", "--data", f"{tmp}/tp", "--out",
                           str(bench_out)] + (["--steps", "100"] if gpu and args.budget_s else []),
                          cwd=REPO, env=bench_env).returncode != 0:
            failed.append("benchmark")
        sweep, archive = batch_sweep(f"{tmp}/tp", results, name, gpu, jax.device_count(),
                                     Path(tmp), bench_env)
        sweep_out = results / f"gpu-{name}-batch.json"
        sweep_out.write_text(json.dumps(sweep, indent=2, sort_keys=True) + "\n")
        say(f"wrote {sweep_out}" + (f" and {archive}" if archive else " (no XLA dump kept)"))
        if not sweep["runs"]:
            failed.append("batch sweep")
        left = args.budget_s - (time.monotonic() - T0) if args.budget_s else None
        if gpu and left is not None and left < LEARNING_MIN_S:
            say(f"learning run: skipped, {left:.0f} s of the budget left (< {LEARNING_MIN_S})")
        elif gpu:
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
