"""The Beam runner writes exactly what the local runner writes, and fails without leftovers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_beam_equals_local(raw, tmp_path):
    local = run_shards([str(raw)], str(tmp_path / "local"), CFG, workers=1, progress=False)
    viabeam = beam_runner.run_beam([str(raw)], str(tmp_path / "beam"), CFG, progress=False)
    a, b = _files(tmp_path / "local"), _files(tmp_path / "beam")
    # 2 epochs x 8 buckets for train; 2 of the 8 buckets hold none of the 12 test probes.
    assert len(a) == 28 and sum(k.startswith("train/") for k in a) == 16
    assert a == b
    assert _manifest(tmp_path / "local") == _manifest(tmp_path / "beam")
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


def test_failed_beam_run_leaves_no_dataset_and_rerun_completes(raw, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = beam_runner.process_bucket

    def failing(bucket, m, cfg, out_dir):
        if bucket == 3 and len(m):
            raise RuntimeError("worker lost")
        return real(bucket, m, cfg, out_dir)

    monkeypatch.setattr(beam_runner, "process_bucket", failing)
    with pytest.raises(Exception, match="worker lost"):
        beam_runner.run_beam([str(raw)], str(out), CFG, progress=False)
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.glob("t*/*.array_record"))  # nothing in train/ or test/
    monkeypatch.setattr(beam_runner, "process_bucket", real)
    beam_runner.run_beam([str(raw)], str(out), CFG, progress=False)
    assert (out / MANIFEST_NAME).exists()
    assert not list(out.glob(".tmp-*"))
    assert len(_files(out)) == 28


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
