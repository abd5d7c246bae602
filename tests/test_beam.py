"""The Beam runner writes exactly what the local runner writes, and fails without leftovers."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import TWO_PROCESSES, running

beam = pytest.importorskip("apache_beam")

from prep.ingest.synth import SynthConfig, synth  # noqa: E402
from prep.schema.manifest import MANIFEST_NAME  # noqa: E402
from prep.shards import beam_runner  # noqa: E402
from prep.shards.bucket import ShardsConfig  # noqa: E402
from prep.shards.local_runner import run_shards  # noqa: E402

CFG = ShardsConfig(seed=7, n_buckets=8, epochs=2)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("beam") / "raw"
    synth(SynthConfig(out=str(out), rows=40_000, probes=120, days=1, seed=5))
    return out


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes()
            for p in sorted(d.rglob("*.array_record"))}


def _manifest(d: Path) -> dict:
    m = json.loads((d / MANIFEST_NAME).read_text())
    for k in ("elapsed_s", "timing"):
        m.pop(k)
    return m


@pytest.fixture(scope="module")
def local(raw, tmp_path_factory) -> tuple[Path, dict]:
    """The local runner's dataset of ``raw`` with CFG, and its summary."""
    out = tmp_path_factory.mktemp("local") / "local"
    return out, run_shards([str(raw)], str(out), CFG, workers=1, progress=False)


def test_beam_equals_local(raw, local, tmp_path):
    local_dir, local = local
    viabeam = beam_runner.run_beam([str(raw)], str(tmp_path / "beam"), CFG, progress=False)
    a, b = _files(local_dir), _files(tmp_path / "beam")
    # 2 epochs x 8 buckets for train; 2 of the 8 buckets hold none of the 12 test probes.
    assert len(a) == 28 and sum(k.startswith("train/") for k in a) == 16
    assert a == b
    assert _manifest(local_dir) == _manifest(tmp_path / "beam")
    for k in ("measurements_in", "measurements_tokenized", "rows", "tokens", "contexts"):
        assert local[k] == viabeam[k]
    assert viabeam["measurements_in"] == 40_000
    assert not list((tmp_path / "beam").glob(".tmp-*"))


def test_beam_default_cutoff_equals_local(raw, tmp_path):
    from prep.schema.validate import read_validated

    cfg = ShardsConfig(seed=7, n_buckets=4, split="time+probe", test_fraction=0.2)
    local = run_shards([str(raw)], str(tmp_path / "local"), cfg, workers=2, progress=False)
    viabeam = beam_runner.run_beam([str(raw)], str(tmp_path / "beam"), cfg, progress=False)
    assert _files(tmp_path / "local") == _files(tmp_path / "beam")
    assert _manifest(tmp_path / "local") == _manifest(tmp_path / "beam")
    assert local["split"] == viabeam["split"]
    # the rule, by brute force: the first minute boundary with at most 20 % at or after it
    times = read_validated([raw])[0].time
    c = (int(times.min()) // 60) * 60
    while (times >= c).sum() > 0.2 * len(times):
        c += 60
    assert viabeam["split"]["test_from"] == c
    assert viabeam["measurements_excluded_by_split"] > 0



def test_two_worker_processes_write_what_the_local_runner_writes(raw, tmp_path, monkeypatch):
    import prep.shards.dataset
    from prep.shards.dataset import build, format_summary

    # a time split whose cutoff one worker finds and hands to the others (a side input)
    cfg = ShardsConfig(seed=7, n_buckets=4, epochs=2, split="time+probe", test_fraction=0.2)
    local = run_shards([str(raw)], str(tmp_path / "local"), cfg, workers=1, progress=False)
    # units of ~5,000 rows (the local run's one unit held all 40,000): the read is spread too
    monkeypatch.setattr(prep.shards.dataset, "UNIT_ROWS", 5_000)
    passes = beam_runner.BeamPasses(*beam_runner.beam_options(TWO_PROCESSES))
    summary = build([str(raw)], str(tmp_path / "beam"), cfg, passes)
    assert _files(tmp_path / "beam") == _files(tmp_path / "local")
    assert len(_files(tmp_path / "local")) == 16  # 4 buckets x 2 epochs x 2 splits
    assert _manifest(tmp_path / "beam") == _manifest(tmp_path / "local")
    assert summary["split"] == local["split"]
    # two processes did the reading and the buckets, and neither was this one
    assert len(passes.workers) == 2 and summary["workers"] == 2
    assert f"{socket.gethostname()}:{os.getpid()}" not in passes.workers
    timing = json.loads((tmp_path / "beam" / MANIFEST_NAME).read_text())["timing"]
    assert timing["beam_runner"] == "FnApiRunner, multi_processing, 2 workers"
    phases = timing["phases_s"]  # where the pipeline's time went, from the workers' records
    assert sorted(phases) == ["buckets", "pipeline", "read", "setup", "shuffle", "start",
                              "teardown"]
    assert sum(phases[k] for k in ("start", "read", "shuffle", "buckets", "teardown")) \
        == pytest.approx(phases["pipeline"], abs=0.01)
    assert " measurements/s on 2 workers" in format_summary(summary).splitlines()[0]


def _prep(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prep.cli", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _descendants(pid: int) -> list[int]:
    parent = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    out, todo = [], [pid]
    while todo:
        at = todo.pop()
        kids = [c for c, pp in parent.items() if pp == at]
        out += kids
        todo += kids
    return out


def _worker_pids(pid: int) -> list[int]:
    """The Python SDK worker processes under ``pid`` (each under a /bin/sh of its own)."""
    out = []
    for d in _descendants(pid):
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in cmd and b"apache_beam.runners.worker.sdk_worker_main" in cmd \
                and not cmd[0].endswith(b"sh"):
            out.append(d)
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes in /proc")
def test_a_worker_process_killed_mid_run_is_one_line_not_a_hang(raw, tmp_path):
    # Beam's own runner would wait for the dead worker's reply for ever.
    p = _prep("shards", str(raw), "--out", str(tmp_path / "out"), "--buckets", "8",
              "--runner", "beam", *(f"--beam-option={o}" for o in TWO_PROCESSES))
    end = time.monotonic() + 120
    while len(workers := _worker_pids(p.pid)) < 2 and time.monotonic() < end \
            and p.poll() is None:
        time.sleep(0.05)
    assert len(workers) == 2, "the worker processes did not start"
    os.kill(workers[0], signal.SIGKILL)
    try:
        _, err = p.communicate(timeout=60)  # not a hang
    finally:
        for pid in (p.pid, workers[1]):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert p.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: a Beam worker process exited mid-run (killed by signal "
                           "SIGKILL, e.g. by the OOM killer); nothing was published"), err
    assert "Traceback" not in err
    log = Path(last.rsplit("the workers' log: ", 1)[1])
    log.unlink()
    assert not (tmp_path / "out").exists()  # the run removed the folder it made
    assert not running(workers[1])  # the run stopped its other worker before it ended


def test_a_damaged_file_read_by_a_worker_process_is_one_line(tmp_path):
    from prep.schema.validate import list_inputs

    inp = tmp_path / "in"
    synth(SynthConfig(out=str(inp), rows=2_000, probes=20, days=1, seed=3))
    bad = list_inputs([inp])[5]
    good = bad.read_bytes()
    # A valid footer and schema, but the data pages are garbage: found only when read.
    bad.write_bytes(good[:4] + bytes(b ^ 0x55 for b in good[4:200]) + good[200:])
    p = _prep("shards", str(inp), "--out", str(tmp_path / "out"), "--runner", "beam",
              "--beam-option=direct_running_mode=multi_processing")  # one worker process
    _, err = p.communicate(timeout=300)
    assert p.returncode == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {bad}: damaged or truncated parquet ("), err
    assert "re-create or remove it (on a Beam worker; nothing was published)" in last
    # the workers' tracebacks and start-up chatter stay out of the run's stderr
    assert not [ln for ln in err.splitlines() if ln.startswith(("INFO:", "Traceback"))], err
    log = Path(last.rsplit("the workers' log: ", 1)[1])
    assert "Traceback" in log.read_text()  # the worker's own account, kept aside
    log.unlink()
    assert not (tmp_path / "out").exists()


def test_failed_beam_run_leaves_no_dataset_and_rerun_completes(raw, tmp_path, monkeypatch):
    out = tmp_path / "out"
    from prep.shards import beam_worker

    real = beam_worker.process_bucket

    def failing(bucket, m, cfg, out_dir):
        if bucket == 3 and len(m):
            raise RuntimeError("worker lost")
        return real(bucket, m, cfg, out_dir)

    monkeypatch.setattr(beam_worker, "process_bucket", failing)
    with pytest.raises(Exception, match="worker lost"):
        beam_runner.run_beam([str(raw)], str(out), CFG, progress=False)
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.glob("t*/*.array_record"))  # nothing in train/ or test/
    monkeypatch.setattr(beam_worker, "process_bucket", real)
    beam_runner.run_beam([str(raw)], str(out), CFG, progress=False)
    assert (out / MANIFEST_NAME).exists()
    assert not list(out.glob(".tmp-*"))
    assert len(_files(out)) == 28


def test_a_beam_sdk_worker_process_is_told_from_a_driver_by_its_control_endpoint(
        monkeypatch):
    from prep.shards import beam_worker

    monkeypatch.delenv("CONTROL_API_SERVICE_DESCRIPTOR", raising=False)
    assert beam_worker.in_sdk_worker() is False  # this process: a driver, or a test
    monkeypatch.setenv("CONTROL_API_SERVICE_DESCRIPTOR", "url: 'localhost:1'")
    assert beam_worker.in_sdk_worker() is True


def test_importing_beam_says_nothing_about_apitools():
    """#36 item 22: `WARNING:root:apitools not found` on every Beam run (Beam's GCP client,
    unused here), and the root logger configured as a side effect."""
    code = ("import logging; from prep.shards.beam_runner import _import_beam; _import_beam(); "
            "print(len(logging.getLogger().handlers))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert (p.returncode, p.stdout, p.stderr) == (0, "0\n", "")


def test_beam_options_are_parsed_and_checked():
    _, options, runner = beam_runner.beam_options(["job_name=x", "runner=DataflowRunner"])
    assert runner == "DataflowRunner"
    assert options.get_all_options()["job_name"] == "x"
    _, _, runner = beam_runner.beam_options([])
    assert type(runner).__name__ == "FnApiRunner"
    with pytest.raises(beam_runner.InputError, match="KEY=VALUE"):
        beam_runner.beam_options(["oops"])


def test_local_path_runs_without_beam(raw, tmp_path):
    # A process where `import apache_beam` fails, as on a machine without the extra.
    code = ("import sys; sys.modules['apache_beam'] = None; from prep.cli import main; "
            "main(sys.argv[1:])")
    base = [sys.executable, "-c", code, "shards", str(raw), "--workers", "1", "--quiet"]
    ok = subprocess.run(base + ["--out", str(tmp_path / "a")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "a" / MANIFEST_NAME).exists()
    bad = subprocess.run(base + ["--out", str(tmp_path / "b"), "--runner", "beam"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --runner beam needs Apache Beam: pip install 'ping-pack[beam]' "
        "(or use the default --runner local)"]


def test_a_unit_goes_to_the_stage_as_one_spill_file_per_bucket_and_only_names_travel(
        raw, tmp_path):
    from prep.schema.validate import list_inputs, read_validated
    from prep.shards import beam_worker
    from prep.shards.bucket import bucket_of

    files = [str(p) for p in list_inputs([raw])[:3]]
    task = json.dumps([7, [[f, [0]] for f in files]])
    out = list(beam_worker.read_unit(task, str(tmp_path), 8))
    m, _, rows_in = read_validated([Path(f) for f in files])
    want = np.bincount(bucket_of(m.probe, 8), minlength=8)
    assert out == [(b, f"spill/b{b:05d}/u000007.arrow") for b in np.flatnonzero(want).tolist()]
    stage = beam_worker.Stage.at(str(tmp_path))
    for b, name in out:  # each file holds exactly its bucket's rows
        got = beam_worker.read_spill(stage, [name])
        assert len(got) == want[b] and set(bucket_of(got.probe, 8).tolist()) == {b}
    # in a folder the spill is uncompressed, as the local runner's (no LZ4 frame in it);
    # in a bucket LZ4, a third of the bytes to upload
    spill = (tmp_path / out[0][1]).read_bytes()
    assert b"\x04\x22\x4d\x18" not in spill and len(spill) > want[out[0][0]] * 8 * 5
    assert stage.spill_options.compression is None
    assert beam_worker.BucketStage.spill_options.compression == "lz4"
    unit = stage.read_json("read/unit-000007.json")
    assert (unit["rows_in"], unit["accepted"], len(m)) == (rows_in, 3_840, 3_840)
    assert rows_in == 3_842 and unit["started"] <= unit["ended"]
    stage.clear_records()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["read"]  # the driver reads it later
