"""bench/gpu_check.py: the learning run cut to a lent machine's time budget; a CPU's dry
run leaves the checkout as it was; bench/gpu.py's top ops, read from a profiler trace."""

import subprocess
from pathlib import Path

import pytest

from bench import gpu_check as gc  # the module under test: bench's own code


def test_learning_steps_fit_the_budget():
    # 600 s left, 30 s compiling, 4 points of 30 s: 450 s of steps at 100k tokens/s, 90 %
    # of it, in steps of 48 rows of 1024 tokens: 0.9 * 450 * 100_000 / 49_152 = 823.9
    assert gc.learning_steps(100_000, 600, 48, 1024, 4) == 823
    # the H200's 225,405 tokens/s and the 378 s it had left (make gpu-check, 64 rows)
    assert gc.learning_steps(225_405, 378, 64, 1024, 4) == int(0.9 * 228 * 225_405 / 65_536)


def test_learning_steps_bounds():
    assert gc.learning_steps(None, 600, 48, 1024, 4) == gc.LEARNING_STEPS  # no rate: full run
    assert gc.learning_steps(1e9, 10_000, 48, 1024, 4) == gc.LEARNING_STEPS  # never more
    assert gc.learning_steps(100_000, 100, 48, 1024, 4) == 100  # too little time: 100 steps
    assert gc.learning_steps(1e9, 10_000, 32, 256, 3, most=12_000) == 12_000  # recipe_gpu's cap


def _files(folder: Path) -> dict:
    return {str(f): f.stat().st_mtime_ns for f in folder.rglob("*") if f.is_file()}


def test_a_cpu_dry_run_writes_into_a_temporary_folder_not_the_checkout(tmp_path, monkeypatch,
                                                                       capsys):
    """A user trial: `make gpu-check` without a GPU rewrote the tracked
    bench/results/gpu-cpu-tiny.json and left new files beside it. The steps themselves
    (data, benchmark, sweep: processes of their own) are stood in for; where they write is
    what main decides."""
    from bench.run import RESULTS
    from train.fit import device
    from train.model import attention

    monkeypatch.setattr(device, "nvidia_gpus", lambda: [])
    monkeypatch.setattr(device, "check_backend", lambda want: "cpu")
    monkeypatch.setattr(attention, "why_not_cudnn", lambda: "no GPU")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setattr(gc.tempfile, "tempdir", str(tmp_path))
    outs = []

    def run(cmd, **kw):
        if "--out" in cmd:
            outs.append(Path(cmd[cmd.index("--out") + 1]))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gc.subprocess, "run", run)
    monkeypatch.setattr(gc, "prep", lambda *args: None)
    monkeypatch.setattr(gc, "batch_sweep", lambda *a: ({"runs": [{}]}, None))
    before = _files(RESULTS)
    assert gc.main([]) == 0
    assert _files(RESULTS) == before
    (results,) = tmp_path.glob("gpu-check-cpu-*")
    assert outs == [results / "gpu-cpu-tiny.json"]
    assert [f.name for f in results.iterdir()] == ["gpu-cpu-tiny-batch.json"]
    assert (f"results: {results} (no GPU: a CPU dry run, kept out of bench/results)"
            in capsys.readouterr().err)
    # --results is where they go, a GPU's default bench/results
    assert gc.results_dir("out", False, RESULTS) == Path("out")
    assert gc.results_dir(None, True, RESULTS) == RESULTS


def test_top_ops_reads_a_profiler_trace_of_the_train_step(tmp_path):
    """bench.gpu's top ops, from a jax.profiler trace on this CPU: the ops of the jitted
    function named train_step, not those of another jitted function traced beside it."""
    import jax
    import jax.numpy as jnp

    from bench import gpu  # under test, as gpu_check above

    def train_step(x):  # four 512^3 matmuls: milliseconds, even on a loaded core
        for _ in range(4):
            x = jnp.tanh(x @ x)
        return x.sum()

    def other(x):  # 64 cosines: microseconds, so a preempted thread cannot turn the order
        return jnp.cos(x[:8, :8]).sum()

    step, noise = jax.jit(train_step), jax.jit(other)
    x = jnp.ones((512, 512)) / 512
    step(x).block_until_ready(), noise(x).block_until_ready()  # compiled before the trace
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            step(x).block_until_ready()
            noise(x).block_until_ready()
    got, beside = gpu.top_ops(tmp_path, steps=3), gpu.top_ops(tmp_path, steps=3, module="other")
    assert got["where"] == "host" and got["module_matched"] and got["steps"] == 3
    assert got["ops"] and sum(op["share"] for op in got["ops"]) == pytest.approx(1.0)
    assert got["ms_per_step"] == pytest.approx(sum(op["ms_per_step"] for op in got["ops"]))
    # each module's own ops: a 256^3 matmul takes longer than 256^2 cosines
    assert beside["module_matched"] and got["ms_per_step"] > beside["ms_per_step"] > 0
