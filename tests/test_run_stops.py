"""How a run stops, and what it leaves: SIGTERM and Ctrl-C finish the step under way and
save; a non-finite loss stops without saving that state; a full disk under the checkpoints
stops the run in one line, the last good checkpoint kept; a second trainer on a run folder
is refused (the lock); a --run-dir that is a file, or on a read-only disk, is one line.

Every CLI case asserts the exit code, the one `error:` line (no traceback) and what is on
disk afterwards. Runs are tiny (tests/helpers.py's `small()`), each a second or two.
"""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    FLAGS,
    REPO,
    exit_2_one_line,
    final_params,
    fit,
    python_c,
    read_only,
    records,
    small,
    step_dirs,
    stop_at,
)

from prep.base.errors import fs_failure
from train.fit.loop import train

# --- signals: SIGTERM is Ctrl-C; finish the step under way, save, exit 143 (130) ----------

class Unhandled(Exception):
    """Raised by the stand-in for SIGTERM's default action: the run did not handle it."""


def _unhandled(*_):
    raise Unhandled("SIGTERM reached the default handler: the process would die unsaved")


def test_sigterm_saves_a_checkpoint_and_exits_143(shards, tmp_path, monkeypatch):
    import train.fit.loop as loop

    real = loop.train
    monkeypatch.setattr(loop, "train", lambda cfg, **kw: real(
        cfg, on_step=stop_at(6, signal.SIGTERM), **kw))
    prev = signal.signal(signal.SIGTERM, _unhandled)  # stands in for "killed" (keeps pytest alive)
    try:
        run = tmp_path / "run"
        r = fit(["--data", shards, "--run-dir", run, *FLAGS])
        assert signal.getsignal(signal.SIGTERM) is _unhandled  # the handler is given back
    finally:
        signal.signal(signal.SIGTERM, prev)
    assert not isinstance(r.exception, Unhandled)
    assert r.exit_code == 143, r.output
    assert "SIGTERM: stopping at step 6 and saving a checkpoint" in r.stderr
    assert "interrupted: step 6" in r.stdout
    assert step_dirs(run / "checkpoints") == [6]
    assert [x["step"] for x in records(run)] == [5, 6]


# xla_cache (tests/conftest.py): the step compiled by the first `train` process below
# (FLAGS' settings, a schedule of 20 steps) is loaded by the next
def _env(xla_cache):
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                JAX_COMPILATION_CACHE_DIR=str(xla_cache),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def test_sigterm_from_outside_to_the_train_command(shards, tmp_path, xla_cache):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.cli", "--data", str(shards), "--run-dir", str(run),
         "--model", "tiny", "--steps", "100000", "--schedule-steps", "20", "--batch-size", "4",
         "--lr", "3e-3", "--warmup", "3", "--log-every", "1", "--eval-every", "0",
         "--ckpt-every", "0"],
        cwd=REPO, env=_env(xla_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text():
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    steps = step_dirs(run / "checkpoints")
    assert len(steps) == 1 and "interrupted: step" in out
    assert records(run)[-1]["step"] == steps[0]


def test_ctrl_c_stops_at_the_step_it_names_with_at_most_one_step_in_flight(
        shards, tmp_path, monkeypatch, capsys):
    import train.fit.loop as loop

    real, outs = loop.step_lib.compile_steps, []

    def compile_steps(*a, **kw):
        train_step, eval_step = real(*a, **kw)

        def recorded(state, batch):
            state, metrics = train_step(state, batch)
            outs.append(metrics["loss"])
            return state, metrics
        return recorded, eval_step

    monkeypatch.setattr(loop.step_lib, "compile_steps", compile_steps)
    in_flight = []

    def check(step):
        in_flight.append(sum(not x.is_ready() for x in outs[:step - 1]))
        if step == 6:
            os.kill(os.getpid(), signal.SIGINT)

    s = train(small(shards, tmp_path / "run", steps=20, log_every=100), on_step=check)
    assert s["interrupted"] and s["step"] == 6
    assert "SIGINT: stopping at step 6 and saving a checkpoint" in capsys.readouterr().err
    assert in_flight == [0] * 6  # every step before the one under way is done
    assert step_dirs(tmp_path / "run" / "checkpoints") == [6]


# --- a non-finite loss: stop, keep the last good checkpoint -------------------------------

def _poisoned_steps(monkeypatch, at: int):
    """train_step gives NaN parameters and loss from step ``at`` on."""
    import train.fit.loop as loop

    real = loop.step_lib.compile_steps

    def compile_steps(*a, **kw):
        train_step, eval_step = real(*a, **kw)
        calls = [0]

        def poisoned(state, batch):
            state, metrics = train_step(state, batch)
            calls[0] += 1
            if calls[0] >= at:
                state = dict(state, params=jax.tree.map(lambda x: x * np.nan, state["params"]))
                metrics = dict(metrics, loss=metrics["loss"] * np.nan)
            return state, metrics
        return poisoned, eval_step

    monkeypatch.setattr(loop.step_lib, "compile_steps", compile_steps)


@pytest.mark.parametrize("at", [8, 10])  # between checkpoints, and on one
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
        shards, tmp_path, monkeypatch, at):
    _poisoned_steps(monkeypatch, at)
    run = tmp_path / "run"
    r = fit(["--data", shards, "--run-dir", run, *FLAGS[:-1], "5"])  # checkpoints every 5
    exit_2_one_line(r, f"step {at}: loss nan, gradient norm ",
                   "not finite; training stopped without saving this state; the last good "
                   f"checkpoint is step 5 in {run / 'checkpoints'}: resume from it")
    assert step_dirs(run / "checkpoints") == [5]
    assert [x["step"] for x in records(run)] == [5]
    params, _ = final_params(run)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


# --- disk errors under the checkpoints: one line, the last good one kept ------------------

LATE_TASK = '''
import asyncio, gc, os, sys
import orbax.checkpoint as ocp
from train.fit.checkpoint import Checkpointer

Checkpointer(sys.argv[1]).close()
# one of a failed save's other writes, which Orbax gave up: a task that fails with nobody
# awaiting it, collected once its loop is done (asyncio: "Task exception was never
# retrieved"); and a task of someone else's, whose echo must stay
ns = {}
exec(compile("async def write():\\n    raise ValueError('RESOURCE_EXHAUSTED: No space left')\\n",
             os.path.join(os.path.dirname(ocp.__file__), "late_write.py"), "exec"), ns)

async def other():
    raise KeyError("not a checkpoint's")

async def main():
    tasks = [asyncio.ensure_future(ns["write"]()), asyncio.ensure_future(other())]
    await asyncio.sleep(0.01)
    del tasks

loop = asyncio.new_event_loop()
loop.run_until_complete(main())
loop.close()
gc.collect()
print("done", flush=True)
'''


def test_no_echoes_of_a_failed_saves_abandoned_writes(tmp_path):
    p = python_c(LATE_TASK, tmp_path / "checkpoints")
    assert p.returncode == 0 and p.stdout == "done\n", p.stderr[-3000:]
    assert p.stderr.count("Task exception was never retrieved") == 1, p.stderr[-3000:]
    assert "not a checkpoint's" in p.stderr  # other tasks' echoes pass
    assert "late_write" not in p.stderr and "RESOURCE_EXHAUSTED" not in p.stderr, p.stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (one tiny checkpoint fits, two do not); skipped where mount is not
    allowed (not root)."""
    d = tmp_path / "disk"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


# An Orbax write task that fails after the run has stopped is echoed by asyncio ("Task
# exception was never retrieved", in about 1 of 3 runs before the Checkpointer dropped it:
# test_no_echoes_of_a_failed_saves_abandoned_writes).
def test_a_full_disk_under_the_checkpoints_stops_the_run_in_one_line(shards, small_disk,
                                                                    xla_cache):
    run = small_disk / "run"
    p = subprocess.run([sys.executable, "-m", "train.cli", "--data", str(shards), "--run-dir",
                        str(run), *FLAGS[:-1], "5"], cwd=REPO, env=_env(xla_cache),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert lines[-1] == (f"error: {run / 'checkpoints'}: checkpoint 10 not saved: no space "
                         "left on the device; training stopped; the last good "
                         "checkpoint is step 5: free some space, then resume it with "
                         f"`train --run-dir {run} --resume`"), p.stderr[-3000:]
    assert not [x for x in lines if x.startswith("error:")][:-1]
    assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr[-3000:]
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["5"]  # no *-tmp left
    # it stops at the first log line or checkpoint that sees the failed save, not at the end
    assert [x["step"] for x in records(run)] in ([5, 10], [5, 10, 15])


# --- locking: one trainer per run folder --------------------------------------------------

def test_a_run_that_is_training_is_locked(shards, tmp_path):
    run = tmp_path / "run"
    seen = {}

    def second(step):
        if step == 4:  # checkpoint 2 exists: a resume would find something to take
            seen["resume"] = fit(["--run-dir", run, "--resume"])
            seen["again"] = fit(["--data", shards, "--run-dir", run, *FLAGS])
            seen["files"] = sorted(p.relative_to(run) for p in run.rglob("*"))

    # the schedule of small()'s 20 steps: the step compiled for the runs above, not another
    s = train(small(shards, run, steps=6, schedule_steps=20, ckpt_every=2), on_step=second)
    assert s["step"] == 6 and not s["interrupted"]
    want = f"{run}: another `train` (pid {os.getpid()}) is training this run"
    exit_2_one_line(seen["resume"], want, "wait for it to end")
    exit_2_one_line(seen["again"], want)
    assert step_dirs(run / "checkpoints") == [2, 4, 6]
    assert [x["step"] for x in records(run)] == list(range(1, 7))  # one writer only
    # the lock goes with its holder: the run resumes afterwards
    r = fit(["--run-dir", run, "--resume", "--steps", "8"])
    assert r.exit_code == 0, r.output
    assert "done: step 8" in r.stdout
    assert not (run / ".lock").exists()  # gone with its holder


# --- bad input: a --run-dir that is a file, or under one ----------------------------------

@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_run_dir_that_is_a_file_is_one_line(shards, tmp_path, where):
    f = tmp_path / "afile"
    f.write_text("x")
    run = f if where == "file" else f / "run"
    for args in ([], ["--resume"]):
        r = fit(["--data", shards, "--run-dir", run, *FLAGS, *args])
        exit_2_one_line(r, f"--run-dir {run}: " + (
            "a file, not a folder" if where == "file" else f"{f} is a file, not a folder"))
    assert f.read_text() == "x"


@pytest.mark.parametrize("where", ["new", "existing"])
def test_a_run_dir_on_a_read_only_disk_is_one_line(shards, tmp_path, monkeypatch, where):
    # a user trial: an OSError traceback ([Errno 30] Read-only file system) from making the
    # folder; prep's commands say the same of --out (prep.base.errors.fs_failure)
    ro = tmp_path / "ro"
    run = ro / "run"
    (run if where == "existing" else ro).mkdir(parents=True)
    at = f" (writing {run / '.lock'})" if where == "existing" else ""
    with read_only(monkeypatch, ro):
        r = fit(["--data", shards, "--run-dir", run, *FLAGS])
    line = exit_2_one_line(r)
    assert line == f"error: {run}: read-only file system{at}; use --run-dir on a writable disk"
    assert [p.relative_to(ro) for p in ro.rglob("*")] == ([] if where != "existing" else
                                                           [run.relative_to(ro)])


def test_a_folder_above_the_run_dir_that_cannot_be_made_is_the_run_dirs_failure():
    # making RUN_DIR makes the folders above it: theirs is its disk's failure, not an input's
    e = OSError(errno.EROFS, "Read-only file system", "/ro/a")
    assert str(fs_failure(e, Path("/ro/a/run"), flag="--run-dir", then=None)) == (
        "/ro/a/run: read-only file system (writing /ro/a); use --run-dir on a writable disk")
