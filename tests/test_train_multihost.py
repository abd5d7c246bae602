"""`train --distributed`: two processes on 127.0.0.1 with one CPU device each train what one
process with two devices trains; a signal on one stops both at one step and the run
resumes exactly; a process that dies or hangs stops the other with one line."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import FAST_COMPILE, REPO, write_dataset

from prep.tools import synthetic_shards as synthetic
from train.cli import main
from train.fit import multihost
from train.fit.checkpoint import Checkpointer, step_dirs
from train.fit.runfolder import run_lock

pytestmark = pytest.mark.no_kernel_warmup  # synthetic shards: no prep kernel
FLAGS = ["--model", "tiny", "--steps", "20", "--schedule-steps", "20", "--batch-size", "4",
         "--lr", "3e-3", "--warmup", "3", "--log-every", "1", "--eval-every", "10",
         "--eval-rows", "6", "--ckpt-every", "10", "--device", "cpu"]
# on process 1, SIGTERM to its `train` (the supervisor, which passes it on) after step 5
SIGTERM_AT_5 = textwrap.dedent("""
    import os, signal, sys
    import jax
    import train.fit.loop as loop
    real = loop.train
    def train(cfg, **kw):
        def on_step(step):
            if step == 5 and jax.process_index() == 1:
                os.kill(os.getppid(), signal.SIGTERM)
        return real(cfg, on_step=on_step, **kw)
    loop.train = train
    from train.cli import main
    main(sys.argv[1:])
""")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("multihost") / "shards", test_rows=7,
                         rows_per_shard=64)


@pytest.fixture(scope="module")
def cache(xla_cache):
    """The run's persistent compilation cache (tests/conftest.py): the 2-process runs after
    the first compile nothing."""
    return xla_cache



def _env(cache, devices=1):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", XLA_FLAGS=FAST_COMPILE)
    if devices > 1:
        env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, cache, *, script=None, heartbeat=5, extra=(), own=((), ())):
    """`train ARGS --distributed` as processes 0 and 1 of 2 on 127.0.0.1 (``own[i]``: the
    arguments of process i alone)."""
    port, head = _port(), ["-c", script] if script else ["-m", "train.cli"]
    return [subprocess.Popen(
        [sys.executable, *head, *args, "--distributed", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(i), "--heartbeat-timeout", str(heartbeat),
         *extra, *own[i]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=_env(cache), cwd=REPO) for i in range(2)]


def finish(procs, timeout=240):
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def losses(run):
    recs = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in recs if "loss" in r},
            {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r})


def state_at(run, step):
    ck = Checkpointer(Path(run) / "checkpoints")
    state, data = ck.restore(step)
    ck.close()
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])], data


@pytest.fixture(scope="module")
def straight(shards, cache, tmp_path_factory):
    """20 steps on 2 processes: (run folder, [(exit code, stdout, stderr)] of each)."""
    run = tmp_path_factory.mktemp("two") / "run"
    return run, finish(launch(["--data", str(shards), "--run-dir", str(run), *FLAGS], cache))


@pytest.mark.slow
def test_two_processes_train_what_one_process_with_two_devices_trains(straight, shards, cache,
                                                                       tmp_path):
    run2, results = straight
    for code, _, err in results:
        assert code == 0, err[-3000:]
    (_, out0, err0), (_, out1, err1) = results
    # process 0 logs and writes the run's files; process 1 (which did not refuse the run
    # process 0 locked) says one line
    assert "step 20/20" in out0 and "done: step 20" in out0 and "on 2 processes" in err0
    assert out1 == ""
    assert err1.splitlines() == ["process 1 of 2: done at step 20; process 0 logs the run"]
    assert "[Gloo]" not in out0 + out1 and "Traceback" not in err0
    assert json.loads((run2 / "config.json").read_text())["processes"] == 2
    assert step_dirs(run2 / "checkpoints") == [10, 20]
    assert all((run2 / "checkpoints" / s / "sha256.json").is_file() for s in ("10", "20"))

    run1 = tmp_path / "one"
    one = subprocess.run([sys.executable, "-m", "train.cli", "--data", str(shards), "--run-dir",
                          str(run1), *FLAGS], capture_output=True, text=True, check=False,
                         env=_env(cache, devices=2), cwd=REPO, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "2 x cpu |" in one.stderr
    (l1, e1), (l2, e2) = losses(run1), losses(run2)
    assert sorted(l2) == list(range(1, 21)) and sorted(e2) == [10, 20]
    np.testing.assert_allclose([l2[s] for s in l1], list(l1.values()), rtol=1e-5)
    np.testing.assert_allclose([e2[s] for s in e1], list(e1.values()), rtol=1e-5)
    (p1, d1), (p2, d2) = state_at(run1, 20), state_at(run2, 20)
    assert d1 == d2  # the same global batches: the reader's state is the same
    for a, b in zip(p1, p2):  # all-reduce over Gloo vs in one process: float reordering
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_a_signal_on_one_process_stops_both_at_one_step_and_resume_is_exact(straight, shards,
                                                                             cache, tmp_path):
    run = tmp_path / "split"
    args = ["--data", str(shards), "--run-dir", str(run), *FLAGS]
    first = finish(launch(args, cache, script=SIGTERM_AT_5))
    assert [r[0] for r in first] == [143, 143], first[0][2][-2000:] + first[1][2][-2000:]
    stops = [line for line in first[0][2].splitlines() if line.startswith("SIGTERM: stopping")]
    assert len(stops) == 1, first[0][2]
    stop = int(stops[0].split("step ")[1].split()[0])
    assert 5 < stop < 20  # process 1's signal after step 5: both stopped after step 5 + 2
    said = f"process 1 of 2: interrupted at step {stop}; process 0 logs the run"
    assert first[1][2].splitlines() == [said]
    assert step_dirs(run / "checkpoints") == sorted({stop} | ({10} if stop > 10 else set()))

    second = finish(launch([*args, "--resume"], cache))
    assert [r[0] for r in second] == [0, 0], second[0][2][-2000:] + second[1][2][-2000:]
    assert f"resumed {run} at step {stop}" in second[0][2]
    # exact: every step's loss, the evals and the parameters, bit for bit
    run2 = straight[0]
    assert losses(run) == losses(run2)
    (pa, da), (pb, db) = state_at(run, 20), state_at(run2, 20)
    assert da == db
    for a, b in zip(pa, pb):
        np.testing.assert_array_equal(a, b)


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig", [(0, signal.SIGKILL), (1, signal.SIGSTOP)],
                         ids=["kill-coordinator", "hang-1"])
def test_a_process_that_dies_or_hangs_stops_the_other_with_one_line(shards, cache, tmp_path,
                                                                    victim, sig):
    heartbeat = 4
    procs = launch(["--data", str(shards), "--run-dir", str(tmp_path / "run"), *FLAGS,
                    "--steps", "100000", "--eval-every", "0", "--ckpt-every", "0"], cache,
                   heartbeat=heartbeat)
    seen = ""
    try:
        if sig == signal.SIGKILL:  # training, both of them
            for line in procs[0].stdout:
                if re.match(r"step +[2-9]/", line):
                    break
        else:  # a hang is a hang from the start: both set up, before compiling the step
            for line in procs[0].stderr:
                seen += line
                if line.startswith("model tiny:"):
                    break
        trainer = _children(procs[victim].pid)[0]  # the `train` process runs the trainer
        os.kill(trainer, sig)
        t0 = time.monotonic()
        other = procs[1 - victim]
        other.wait(timeout=60)  # it ends by itself: no hang
        waited = time.monotonic() - t0
        if sig == signal.SIGSTOP:
            os.kill(trainer, signal.SIGKILL)
        results = finish(procs, timeout=60)
        results[0] = (results[0][0], results[0][1], seen + results[0][2])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r[0] for r in results] == [2, 2], results
    for i, (_, _, err) in enumerate(results):
        lines = err.splitlines()
        assert not [x for x in lines if x.startswith("error:")][1:], err  # one line each
        assert lines and lines[-1].startswith(f"error: process {i} of 2: "), err
        assert "Traceback" not in err and "Check failure" not in err
        assert not [x for x in lines if re.match(r"[FEW]\d{4} ", x)], err  # XLA's own log
    said = results[1 - victim][2].splitlines()[-1]
    assert "another process of the run died or stopped answering" in said
    assert "--resume" in said
    assert "killed by SIGKILL" in results[victim][2]
    if sig == signal.SIGSTOP:  # a hang is seen by its missing heartbeats only
        assert f"process 1 sent no heartbeat for {heartbeat} s" in said
        assert waited < heartbeat + 15
    else:  # the coordinator gone: at once
        assert waited < 10


def test_a_refusal_on_process_0_reaches_process_1(shards, cache, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lock = run_lock(run)
    lock.acquire()  # another trainer holds the run
    try:
        results = finish(launch(["--data", str(shards), "--run-dir", str(run), *FLAGS], cache))
    finally:
        lock.release()
    assert [r[0] for r in results] == [2, 2]
    want = f"another `train` (pid {os.getpid()}) is training this run"
    e0, e1 = (r[2].strip().splitlines() for r in results)
    assert len(e0) == 1 and e0[0].startswith(f"error: {run}: ") and want in e0[0]
    assert len(e1) == 1 and e1[0].startswith(f"error: process 0: {run}: ") and want in e1[0]


@pytest.mark.parametrize("own, message", [
    ((["--steps", "10"], ["--steps", "12"]),
     "--steps differs between the processes of the run: 10 on process 0, 12 on process 1; "
     "start `train --distributed` on every host with the same settings"),
    ((["--seed", "1"], []),
     "--seed differs between the processes of the run: 1 on process 0, 0 on process 1; "
     "start `train --distributed` on every host with the same settings"),
    ((["--data", "{A}"], ["--data", "{B}"]),
     "--data differs between the processes of the run: process 0 reads {A} (fingerprint "
     "{fa}), process 1 {B} (fingerprint {fb}); give every process the same dataset"),
], ids=["steps", "seed", "data"])
def test_processes_with_different_settings_refuse_in_one_line(shards, cache, tmp_path, own,
                                                              message):
    """#36 item 18: two processes with other flags hung, trained on mixed data, or crashed."""
    from train.fit.reader import dataset_fingerprint, open_shards

    other = tmp_path / "other"
    synthetic.write_shards(other, {"train": synthetic.counting_rows(64, 64, seed=5),
                                   "test": synthetic.counting_rows(7, 64, seed=6)})
    names = {"A": str(shards), "B": str(other),
             "fa": dataset_fingerprint(open_shards(shards)),
             "fb": dataset_fingerprint(open_shards(other))}
    own = tuple([a.format(**names) for a in o] for o in own)
    run = tmp_path / "run"
    results = finish(launch(["--data", str(shards), "--run-dir", str(run), *FLAGS], cache,
                            own=own), timeout=120)
    assert [r[0] for r in results] == [2, 2], results
    for _, out, err in results:
        assert out == "" and err.splitlines() == [f"error: {message.format(**names)}"], err
    assert not run.exists()


@pytest.mark.parametrize("who, why", [(1, "no coordinator answered"),
                                      (0, "it runs the coordinator; not every other process "
                                          "joined it")])
def test_a_process_alone_waits_join_timeout_then_says_so(cache, tmp_path, who, why):
    """#36 item 22: process 0 alone said "no coordinator answered", yet it is the coordinator."""
    port = _port()  # no coordinator listens there (process 1), no other process (process 0)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "train.cli", "--data", str(tmp_path), "--device",
                        "cpu", "--distributed", "--coordinator", f"127.0.0.1:{port}",
                        "--num-processes", "2", "--process-id", str(who), "--join-timeout", "1"],
                       capture_output=True, text=True, env=_env(cache), cwd=REPO, timeout=120,
                       check=False)
    assert p.returncode == 2 and time.monotonic() - t0 < 60
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: --distributed: process {who} of 2 could not join the run "
                               f"at 127.0.0.1:{port} within 1 s ({why}); ")


@pytest.mark.parametrize("args, env, message", [
    (["--distributed", "--coordinator", "10.0.0.1", "--num-processes", "2", "--process-id", "0"],
     {}, "--coordinator 10.0.0.1: not HOST:PORT"),
    (["--distributed", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     {}, "--process-id 2: one of 0..1 for 2 processes"),
    (["--distributed", "--coordinator", "h:1", "--num-processes", "0"], {},
     "--num-processes 0: at least 1"),
    (["--distributed"], {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two': not a whole"),
    (["--distributed", "--coordinator", "h:1", "--heartbeat-timeout", "0"], {},
     "--heartbeat-timeout 0: at least 1 second"),
    (["--process-id", "1"], {}, "--coordinator, --num-processes and --process-id go with"),
], ids=["port", "process-id", "count", "env", "heartbeat", "without-distributed"])
def test_distributed_flags_that_cannot_work_are_one_line(args, env, message, tmp_path):
    result = CliRunner().invoke(main, ["--data", str(tmp_path), *args], env=env)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


def test_distributed_with_nothing_to_go_by_is_one_line(tmp_path):
    # called from Python: the trainer is `python -m train.cli ARGS`, not this program again
    result = CliRunner().invoke(main, ["--data", str(tmp_path), "--device", "cpu",
                                       "--distributed"],
                                env={v: None for v in multihost.ENV.values()})
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: --distributed: no --coordinator, no --num-processes, no --process-id given, "
        "and jax found no cluster environment (SLURM, Open MPI, Kubernetes, Cloud TPU) to "
        "read them from; pass them (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
        "JAX_PROCESS_ID)"]
