"""The per-stage seconds of `prep shards` (prep.shards.stages): the clock's arithmetic on
planted times, and the report's exact keys in a real run's summary and manifest."""

import pytest
from helpers import TINY_CFG, tiny_input

from bench.bench_etl import stage_shares
from prep.schema import manifest as mf
from prep.shards import stages
from prep.shards.local_runner import run_shards
from prep.shards.stages import MAIN_STAGES, STAGES, WORKER_STAGES, StageClock


def test_clock_adds_stages_and_gives_the_rest_of_a_task_to_task(monkeypatch):
    walls = iter([0.0, 10.0, 11.0, 13.0, 14.5, 20.0, 100.0, 103.0, 200.0])
    cpus = iter([0.0, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0])
    monkeypatch.setattr(stages.time, "perf_counter", lambda: next(walls))
    monkeypatch.setattr(stages.time, "process_time", lambda: next(cpus))
    clock, ran = StageClock(), []
    with clock.task():                     # wall 0, CPU 0
        with clock("read"):                # wall 10 -> 11, CPU 1 -> 1.5
            ran.append("read")
        with clock("validate"):            # wall 13 -> 14.5, CPU 2 -> 3
            ran.append("validate")
    with clock("read"):                    # (the task ended at 20, CPU 4) 100 -> 103, 5 -> 7
        ran.append("read")
    assert ran == ["read", "validate", "read"]  # each body ran once, inside its stage
    assert clock.seconds == {"read": 4.0, "validate": 1.5, "task": 17.5}
    assert clock.cpu == {"read": 2.5, "validate": 1.0, "task": 2.5}
    clock.add({"stage_s": {"read": 1.0, "write": 2.0}, "stage_cpu_s": {"write": 0.5}})
    clock.since("main_units", (190.0, 8.0))  # now: wall 200, CPU 9
    report = clock.report()
    assert list(report) == ["stage_s", "stage_cpu_s"]
    assert [list(d) for d in report.values()] == [list(STAGES)] * 2
    assert {k: v for k, v in report["stage_s"].items() if v} == {
        "read": 5.0, "validate": 1.5, "write": 2.0, "task": 17.5, "main_units": 10.0}
    assert {k: v for k, v in report["stage_cpu_s"].items() if v} == {
        "read": 2.5, "validate": 1.0, "write": 0.5, "task": 2.5, "main_units": 1.0}
    with pytest.raises(KeyError, match="unknown stage 'sort'"), clock("sort"):
        ran.append("sort")
    assert ran[-1] == "read"  # an unknown stage fails on entry: its body never runs


@pytest.mark.parametrize("workers", [1, 2])
def test_report_has_every_stage_and_the_shares_add_up(tmp_path, workers):
    out = tmp_path / "out"
    s = run_shards([str(tiny_input(tmp_path))], str(out), TINY_CFG, workers=workers,
                   progress=False)
    timing = mf.load_manifest(out)["timing"]
    for key in ("stage_s", "stage_cpu_s"):
        assert list(s[key]) == list(STAGES)
        assert timing[key] == s[key]
        assert min(s[key].values()) >= 0
    # every worker stage ran on this input (the driver may find nothing to compile)
    assert [k for k in WORKER_STAGES if s["stage_s"][k] <= 0] == []
    assert min(s["stage_s"][k] for k in MAIN_STAGES) >= 0
    shares = stage_shares(s["stage_cpu_s"])
    assert list(shares) == [f"etl.stage_share.{k}" for k in STAGES]
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)


def test_bench_etl_write_floor_writes_the_very_bytes_of_each_shard(tmp_path, monkeypatch):
    """bench.bench_etl.write_again: a shard's records written again as `prep shards` wrote
    them, so the write floor times the same bytes (the manifest's sha256, every record)."""
    import json

    from bench import bench_etl

    monkeypatch.setattr(bench_etl, "DATA", tmp_path)
    run_shards([str(tiny_input(tmp_path))], str(tmp_path / "shards"), TINY_CFG,
               progress=False)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    shards = [e for sp in manifest["splits"].values() for e in sp["shards"]]
    assert [e["records"] for e in shards] == [2]  # 115 tokens in rows of 64
    for e in shards:
        records, cpu, sha = bench_etl.write_again(str(tmp_path / "shards" / e["path"]))
        assert (records, sha) == (e["records"], e["sha256"]) and cpu > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "shards"]  # nothing left


def test_bench_etl_against_times_two_checkouts_by_turns(tmp_path, monkeypatch, capsys):
    """bench.bench_etl --against: each checkout's `prep shards` run in a fresh process of its
    own folder (here this checkout against itself, on the tiny input), warmed once, then
    timed by turns; the table has every stage, the ratios, and the rate of each."""
    from pathlib import Path

    from bench import bench_etl

    inp = tiny_input(tmp_path)
    calls = []
    real = bench_etl._checkout_shards

    def counted(repo, where, buckets):
        calls.append((Path(repo), where, buckets))
        return real(repo, where, buckets)
    monkeypatch.setattr(bench_etl, "DATA", tmp_path / "bench")
    monkeypatch.setattr(bench_etl, "_synth", lambda rows: inp.parent)
    monkeypatch.setattr(bench_etl, "_checkout_shards", counted)
    repo = Path(bench_etl.__file__).resolve().parents[1]
    assert bench_etl.main(["--against", str(repo), "--rounds", "2"]) == 0
    assert len(calls) == 2 + 2 * 2 and {c[1] for c in calls} == {inp.parent}
    assert {c[2] for c in calls} == {bench_etl.SIZES[-1] // bench_etl.BUCKET_ROWS}
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "prep shards, 10,000,000 rows, 2 workers, medians of 2 runs each"
    rows = {line.split()[0]: line.split()[1:] for line in out[2:-1]}
    assert set(rows) == {"wall_s", "cpu_s", "peak_rss_mb", *STAGES}
    assert float(rows["wall_s"][0]) > 0 and float(rows["cpu_s"][1]) > 0
    assert out[-1].startswith("measurements/s: ")
    with pytest.raises(SystemExit) as e:  # not a checkout: one line naming the fix, exit 2
        bench_etl.main(["--against", str(tmp_path)])
    assert e.value.code == 2 and "git worktree add" in capsys.readouterr().err
