"""`make gpu-check`: is this GPU machine ready, and how fast does it train? One command.

1. The device and the versions (GPUs from nvidia-smi, jax, jaxlib, the CUDA plugin,
   cuDNN), and whether the cuDNN packed attention compiles here (train.model.attention).
2. A visible NVIDIA GPU with a CPU-only jax stops here with the install command.
3. The GPU tests (`pytest -m gpu`: cuDNN packed attention equals XLA for outputs and
   gradients, bf16, on rows of 1 segment, 2 segments, the maximum, and padding only).
4. The GPU benchmark (bench/gpu.py) of the base (~95M) config on packed shards of the
   built-in data (`prep synth` + `prep shards`), writing bench/results/gpu-<device>.json.
5. On a GPU, the base model's learning run (bench/learning.py): LEARNING_STEPS steps of 64
   rows of 1024 tokens (~300M tokens, about 7 minutes at the 700k tokens/s target) on the
   built-in data split `--split time+probe`, 6 checkpoints each scored by `train eval`'s
   machinery against every baseline, context baselines included; writes
   bench/results/learning-<device>-base.json beside the benchmark (docs/learning.md says
   why this is the experiment to run).

Exit 0 only if every step that applies passed. Without a GPU it says what it skips: the GPU
tests skip, and the benchmark runs the tiny config on the CPU on a small dataset (to keep
the script itself tested; not GPU numbers).
"""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# ~300M tokens of 64 x 1024-token rows: ~7 min at the 700k tokens/s target on one H100
LEARNING_STEPS = 4_600
BIN = Path(sys.executable).parent


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "optax",
                "orbax-checkpoint", "grain", "array_record"):
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


def main() -> int:
    from prep.schema.errors import InputError
    from train.fit import device
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
    why = attention.why_not_cudnn()
    say(f"cuDNN packed attention: {'compiles here' if why is None else 'unavailable: ' + why}")
    failed = []
    gpu = platform == "gpu"
    if gpu and why is not None:
        failed.append("cuDNN packed attention")

    say("GPU tests: pytest -m gpu" + ("" if gpu else " (no GPU: they skip)"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests"],
                       cwd=REPO)
    if r.returncode not in (0, 5):
        failed.append("GPU tests")

    rows, probes = (3_000_000, 3_000) if gpu else (20_000, 100)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        say(f"benchmark data: prep synth --rows {rows:,} + prep shards"
            + ("" if gpu else " (small: no GPU)"))
        subprocess.run([str(BIN / "prep"), "synth", "--out", f"{tmp}/raw", "--rows", str(rows),
                        "--probes", str(probes), "--days", "2", "--seed", "0"], check=True)
        subprocess.run([str(BIN / "prep"), "shards", f"{tmp}/raw", "--out", f"{tmp}/shards",
                        "--quiet"], check=True)
        say(f"data ready in {time.perf_counter() - t0:.0f} s; benchmark"
            + ("" if gpu else ": no GPU, so the tiny config on the CPU (not GPU numbers)"))
        from bench import gpu as bench_gpu

        if bench_gpu.main(["--data", f"{tmp}/shards"]) != 0:
            failed.append("benchmark")
        if gpu:
            say(f"learning run: base, {LEARNING_STEPS} steps on --split time+probe")
            subprocess.run([str(BIN / "prep"), "shards", f"{tmp}/raw", "--out", f"{tmp}/tp",
                            "--split", "time+probe", "--quiet"], check=True)
            from bench import learning

            if learning.main(["--data", f"{tmp}/tp", "--model", "base", "--steps",
                              str(LEARNING_STEPS), "--points", "6", "--queries", "20000",
                              "--run-dir", f"{tmp}/learning-run"]) != 0:
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
