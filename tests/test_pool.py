"""The one worker pool (prep.jobs.pool) of `prep shards`, `prep verify` and `prep import-atlas`:
a worker that dies is an error within seconds that names the task it was on, never a hang,
and each command stops with one line and leaves no worker behind."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import ATLAS, PREP, children, error_lines, running

from prep.jobs.pool import Pool, WorkerDied, cores


def _square(x):
    return x * x


def _dies(task):
    how, x = task
    if how != "ok":
        time.sleep(0.3)  # the other tasks are done: no other worker is on a task
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if how == "exit":
        os._exit(3)
    return x


def test_cores_are_this_processs_share():
    assert cores() == len(os.sched_getaffinity(0))


def test_imap_keeps_the_task_order_whatever_order_they_start_in():
    with Pool(2) as pool:
        assert list(pool.imap(_square, [1, 2, 3, 4], order=[3, 1, 2, 0])) == [1, 4, 9, 16]
        assert sorted(pool.imap_unordered(_square, [5, 6])) == [25, 36]


def _frozen(_):
    import gc
    return gc.get_freeze_count()


def test_a_worker_starts_with_what_it_inherits_frozen():
    """The objects a forked worker starts with (the driver's modules) sit in the garbage
    collector's permanent generation: its collections do not walk them. The driver's own
    generations are left as they were."""
    import gc

    before = gc.get_freeze_count()
    with Pool(2) as pool:
        frozen = list(pool.imap(_frozen, [0, 1]))
    assert min(frozen) > 1000  # this test process's modules, at least
    assert gc.get_freeze_count() == before


def test_a_pool_that_fails_before_its_first_task_closes_at_once():
    """Under a fork server (this process runs a thread) workers start with the first task:
    a run that fails before it (bad input, a foreign file in --out) has none to wait for,
    and closed 10 s late (multiprocessing.connection.wait([]) sleeps its whole timeout)."""
    import threading

    hold = threading.Event()
    thread = threading.Thread(target=hold.wait)
    thread.start()
    try:
        pool = Pool(2)
    finally:
        hold.set()
        thread.join()
    t0 = time.monotonic()
    pool.close(failed=True)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("how, words, oom", [
    ("kill", "was killed by SIGKILL while on b.json, most likely by the kernel's out-of-memory", True),
    ("term", "was stopped by SIGTERM while on b.json", False),
    ("exit", "exited with code 3 while on b.json", False),
])
def test_a_dead_worker_is_an_error_naming_its_task(how, words, oom):
    t0 = time.monotonic()
    with pytest.raises(WorkerDied) as e, Pool(2) as pool:
        list(pool.imap(_dies, [("ok", 1), (how, 2), ("ok", 3)], ["a.json", "b.json", "c.json"]))
    assert words in e.value.what and e.value.oom is oom
    assert time.monotonic() - t0 < 10


def _kill_a_worker(args: list[str], slow: str, on=lambda label: True) -> tuple[int, str, float]:
    """Run ``prep ARGS`` with its task function slowed (``slow``: Python run before main),
    SIGKILL one of its workers once it is on a task whose label ``on`` accepts (the pool
    keeps each busy worker's label in a file named by its pid); exit code, stderr, seconds
    from the kill to the exit. No worker may outlive the run. The callers slow each task by
    3 s, so the worker is still on the task it was seen on when the kill lands, even on a
    loaded 2-core machine (at 1 s, a run beside other tests once saw the worker between
    tasks: "killed" without "while on")."""
    code = f"import sys, time\n{slow}\nfrom prep.cli import main\nmain(sys.argv[1:])"
    # label folders left by runs that were killed name pids that are reused since (pid_max
    # is 32,768 here): only the folders this run's pool makes name its workers
    stale = set(Path(tempfile.gettempdir()).glob("prep-pool-*"))
    proc = subprocess.Popen([sys.executable, "-c", code] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    workers: list[int] = []
    victim = None
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        workers = children(proc.pid)
        for w in workers:
            for f in Path(tempfile.gettempdir()).glob(f"prep-pool-*/{w}"):
                if f.parent in stale:
                    continue
                try:
                    if on(f.read_text()):
                        victim = w
                except OSError:
                    pass
        time.sleep(0.02)
    assert victim is not None, "the run ended before a worker could be killed"
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while any(running(p) for p in workers):
        assert time.monotonic() < deadline, f"workers {workers} still running"
        time.sleep(0.02)
    assert "Traceback" not in err, err
    assert f"(pid {victim})" in err
    return proc.returncode, err, took


def test_prep_verify_with_a_killed_worker_names_the_shard(synth_shards):
    shards_dir = synth_shards
    slow = ("import prep.tools.verify as v\nreal = v.check_shard\n"
            "def check_shard(t):\n    time.sleep(3.0); return real(t)\n"
            "v.check_shard = check_shard")
    rc, err, took = _kill_a_worker(["verify", str(shards_dir), "--workers", "2"], slow)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert "prep verify: a worker process (pid " in lines[0]
    assert "was killed by SIGKILL while on " + str(shards_dir) in lines[0]
    assert ".array_record" in lines[0] and "with fewer --workers" in lines[0]
    assert took < 10


def test_prep_import_atlas_with_a_killed_worker_names_the_file(tmp_path):
    out = tmp_path / "out"
    slow = ("import prep.ingest.atlas as a\nreal = a.import_file\n"
            "def import_file(t):\n    time.sleep(3.0); return real(t)\n"
            "a.import_file = import_file")
    rc, err, took = _kill_a_worker(["import-atlas", str(ATLAS / "api"), "--out", str(out),
                                    "--workers", "2"], slow)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert "import-atlas: a worker process (pid " in lines[0]
    assert f"was killed by SIGKILL while on {ATLAS / 'api'}/" in lines[0] and ".json" in lines[0]
    assert f"nothing was written to {out}" in lines[0]
    assert not out.exists()  # not even an empty folder
    assert took < 10


def test_prep_shards_with_a_killed_worker_names_the_bucket(tmp_path, synth_raw):
    out = tmp_path / "out"
    slow = ("import prep.shards.local_runner as s\nreal = s.process_bucket\n"
            "def slow(*a, **k):\n    time.sleep(3.0); return real(*a, **k)\n"
            "s.process_bucket = slow")
    rc, err, took = _kill_a_worker(["shards", str(synth_raw), "--out", str(out), "--workers", "2",
                                    "--buckets", "8", "--quiet"], slow,
                                   on=lambda label: label.startswith("bucket "))
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1, err
    assert "was killed by SIGKILL while on bucket " in lines[0]
    assert "nothing was published; use more --buckets" in lines[0]
    assert not (out / "manifest.json").exists()
    assert took < 10


@pytest.fixture(scope="module")
def synth_raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pool") / "raw"
    subprocess.run([str(PREP), "synth", "--out", str(out), "--rows", "20000", "--probes", "100",
                    "--days", "1"], check=True, capture_output=True, timeout=60)
    return out


@pytest.fixture(scope="module")
def synth_shards(synth_raw) -> Path:
    out = synth_raw.parent / "shards"
    subprocess.run([str(PREP), "shards", str(synth_raw), "--out", str(out), "--buckets", "4",
                    "--quiet"], check=True, capture_output=True, timeout=120)
    assert len(list(out.glob("*/*.array_record"))) >= 4
    return out
