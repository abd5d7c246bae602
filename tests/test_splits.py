"""Split rules of `prep shards`: --split time and time+probe leak no future into train, the
default cutoff is exact and deterministic, excluded measurements are counted, and
`prep verify` holds the rows to the rule (prep/schema/splits.py, prep/shards/bucket.py, prep/tools/verify.py)."""

import collections
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import (
    T0,
    decoded_segments,
    manifest_sans_timing,
    probe_data,
    read_split,
    tiny_input,
    tree_bytes,
    write_parquet,
)

from prep.cli import main
from prep.schema import manifest as mf
from prep.schema.measurements import addr_words
from prep.schema.splits import default_cutoff, format_time, more_test_rows, parse_time
from prep.shards.bucket import ShardsConfig, bucket_of, is_test_probe
from prep.shards.local_runner import run_shards
from prep.tools.verify import check_counts, verify_dir

FULL = (1.0, 0.0, 0.0)  # every measurement carries its timestamp: the rule covers them all
CUT = T0 + 86_400  # probe_data spans about two and a half days from T0


def decoded(d: Path, split: str) -> list[tuple[int, int]]:
    """(source address low word, time) of every measurement of a split, as decoded."""
    out = []
    for _, ms in decoded_segments(d, split):
        for x in ms:
            assert x.time is not None  # FULL mode
            out.append((x.src_lo, x.time))
    return out


def src_of(r: dict) -> int:
    return addr_words(r["src_addr"])[2]


@pytest.fixture(scope="module")
def recs():
    r = probe_data(n_probes=24, per_probe=60, seed=11)
    return r + [dict(r[0], event_time=CUT)]  # one measurement right at the cutoff: test


@pytest.fixture(scope="module")
def time_dataset(recs, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("time")
    inp = write_parquet(d / "in" / "a.parquet", recs)
    run_shards([str(inp)], str(d / "out"), ShardsConfig(n_buckets=1, mode_weights=FULL,
               split="time", test_from=CUT, max_measurements=25), progress=False)
    return d / "out"


def test_time_split_puts_the_past_in_train_and_the_rest_in_test(recs, time_dataset):
    train, test = decoded(time_dataset, "train"), decoded(time_dataset, "test")
    want_train = collections.Counter((src_of(r), r["event_time"]) for r in recs
                                     if r["event_time"] < CUT)
    want_test = collections.Counter((src_of(r), r["event_time"]) for r in recs
                                    if r["event_time"] >= CUT)
    assert max(t for _, t in train) < CUT == min(t for _, t in test)
    assert collections.Counter(train) == want_train and collections.Counter(test) == want_test
    m = mf.load_manifest(time_dataset)
    assert (m["splits"]["train"]["measurements"], m["splits"]["test"]["measurements"]) == (
        sum(want_train.values()), sum(want_test.values()))
    assert len(want_train) and len(want_test)
    # whatever the probe: a probe measuring on both sides of the cutoff is in both splits
    both = {s for s, _ in want_train} & {s for s, _ in want_test}
    assert both and both == {s for s, _ in train} & {s for s, _ in test}
    assert m["config"]["split"] == "time" and m["config"]["test_from"] == CUT
    assert m["counts"]["measurements_excluded_by_split"] == 0
    assert verify_dir(time_dataset) == []


def test_time_plus_probe_holds_out_probes_and_counts_the_rest(recs, tmp_path):
    inp = write_parquet(tmp_path / "in" / "a.parquet", recs)
    cfg = ShardsConfig(n_buckets=2, mode_weights=FULL, split="time+probe", test_from=CUT,
                       test_fraction=0.3, epochs=2)
    s = run_shards([str(inp)], str(tmp_path / "out"), cfg, progress=False)
    probes = sorted({r["prb_id"] for r in recs})
    held = {p for p, t in zip(probes, is_test_probe(np.array(probes, np.uint64), 0.3)) if t}
    want = {"train": collections.Counter(), "test": collections.Counter()}
    excluded = 0
    for r in recs:
        late = r["event_time"] >= CUT
        if late == (r["prb_id"] in held):
            want["test" if late else "train"][(src_of(r), r["event_time"])] += 2  # 2 epochs
        else:
            excluded += 1
    assert 0 < len(held) < 24 and excluded > 0 and len(want["test"]) > 0
    got = {sp: collections.Counter(decoded(tmp_path / "out", sp)) for sp in ("train", "test")}
    assert got == want  # the time rule, and every measurement that is not excluded, once per epoch
    srcs = {sp: {a for a, _ in got[sp]} for sp in got}  # source address = probe here
    assert srcs["test"] == {src_of(r) for r in recs
                            if r["prb_id"] in held and r["event_time"] >= CUT}
    assert not srcs["train"] & srcs["test"]
    m = mf.load_manifest(tmp_path / "out")
    assert m["counts"]["measurements_excluded_by_split"] == excluded
    assert s["measurements_excluded_by_split"] == excluded
    assert s["measurements_tokenized"] == 2 * (len(recs) - excluded)
    assert s["split"] == {"rule": "time+probe", "test_fraction": 0.3, "test_from": CUT,
                          "test_from_iso": "2026-01-02T00:00:00Z"}
    assert verify_dir(tmp_path / "out") == []
    m["counts"]["measurements_excluded_by_split"] += 1  # the arithmetic verify checks
    assert check_counts(m) == [
        f"manifest.json: measurements_tokenized is {2 * (len(recs) - excluded):,}, "
        f"expected {2 * (len(recs) - excluded - 1):,}"]


# --- the default cutoff ----------------------------------------------------------------

def cutoff_recs() -> list[dict]:
    """40 measurements: 4 probes, 4 a minute in minutes 0-7, then 4 a minute in minutes 60-61.
    With test_fraction 0.25 at most 10 may be at or after the cutoff: minute 7 would make
    12, so the cutoff is the boundary after minute 7, T0 + 480, not minute 60's."""
    out = []
    for p in range(1, 5):
        src = f"10.0.0.{p}"
        times = [T0 + 60 * k + p for k in range(8)] + [T0 + 3600 + 60 * j + 5 * p for j in range(2)]
        out += [{"event_time": t, "prb_id": p, "src_addr": src, "dst_addr": "193.0.14.129",
                 "ip_version": 4, "rtt": 10.0 + p} for t in times]
    return out


def test_default_cutoff_is_exact_and_recorded(tmp_path, monkeypatch):
    import prep.shards.dataset

    recs = cutoff_recs()
    files = [write_parquet(tmp_path / "in" / f"{i}.parquet", recs[i::4]) for i in range(4)]
    monkeypatch.setattr(prep.shards.dataset, "UNIT_ROWS", 10)  # one read task per file
    cfg = ShardsConfig(n_buckets=3, mode_weights=FULL, split="time", test_fraction=0.25)
    s = run_shards([str(f) for f in files], str(tmp_path / "w1"), cfg, workers=1, progress=False)
    run_shards([str(f) for f in files[::-1]], str(tmp_path / "w2"), cfg, workers=2, progress=False)
    assert s["split"]["test_from"] == 1_767_226_080 == T0 + 480
    assert s["split"]["test_from_iso"] == "2026-01-01T00:08:00Z"
    m = mf.load_manifest(tmp_path / "w1")
    assert m["config"]["test_from"] == 1_767_226_080 and m["config"]["split"] == "time"
    assert m["splits"]["test"]["measurements"] == 8 and m["splits"]["train"]["measurements"] == 32
    assert sorted(t for _, t in decoded(tmp_path / "w1", "test")) == sorted(
        r["event_time"] for r in recs if r["event_time"] >= T0 + 3600)
    one, two = tree_bytes(tmp_path / "w1"), tree_bytes(tmp_path / "w2")
    buckets = set(bucket_of(np.arange(1, 5, dtype=np.uint64), 3).tolist())
    assert len(one) == 2 * len(buckets) and one == two  # every probe measures in both splits
    assert manifest_sans_timing(tmp_path / "w1") == manifest_sans_timing(tmp_path / "w2")
    assert verify_dir(tmp_path / "w1") == []


def test_bucket_and_split_of_planted_keys():
    """bucket_of and is_test_probe: splitmix64 of the key with their salts, planted values
    (the extremes of the key included): a change here moves every probe's bucket or split."""
    keys = np.array([0, 1, 2, 3, 12345, (1 << 63) | 7, (1 << 64) - 1], np.uint64)
    assert bucket_of(keys, 7).tolist() == [0, 5, 4, 4, 0, 4, 2]
    assert is_test_probe(keys, 0.3).tolist() == [False, True, False, False, False, False, False]
    assert is_test_probe(keys, 1.0).all() and not is_test_probe(keys, 0.0).any()


def test_default_cutoff_rule():
    minutes, counts = [0, 1, 2, 7, 60, 61], [4, 4, 4, 4, 4, 4]
    assert default_cutoff(minutes, counts, 1 / 3) == 7 * 60 + 60  # 8 of 24 at or after it
    assert default_cutoff(minutes, counts, 0.0) == 62 * 60  # nothing in test
    assert default_cutoff(minutes, counts, 1.0) == 0  # everything in test: the first minute
    assert default_cutoff(minutes[::-1] + [1], counts + [2], 0.25) == 61 * 60  # any order, summed
    assert default_cutoff([-2, -1], [1, 1], 0.5) == -60  # before 1970
    assert default_cutoff([], [], 0.5) == 0


# --- flags -------------------------------------------------------------------------------

def test_more_test_rows_names_the_flag_of_the_rule():
    """A time split's test rows are those from its cutoff on: --test-fraction above 0 (the
    probe rule's fix) does not move it."""
    assert more_test_rows({"split": "probe", "test_fraction": 0.0}) == (
        "rebuild with `prep shards --test-fraction` above 0")
    assert more_test_rows({}) == "rebuild with `prep shards --test-fraction` above 0"
    assert more_test_rows({"split": "time", "test_fraction": 0.1, "test_from": CUT}) == (
        "rebuild with `prep shards --split time --test-from` an earlier cutoff than its "
        "2026-01-02T00:00:00Z")
    assert more_test_rows({"split": "time+probe", "test_fraction": 0.0, "test_from": CUT}) == (
        "rebuild with `prep shards --split time+probe --test-from` an earlier cutoff than its "
        "2026-01-02T00:00:00Z and --test-fraction above 0 (the probes held out)")
    assert more_test_rows({"split": "time+probe", "test_fraction": 0.2, "test_from": CUT}) == (
        "rebuild with `prep shards --split time+probe --test-from` an earlier cutoff than its "
        "2026-01-02T00:00:00Z")


def test_parse_time():
    assert parse_time("2026-01-02T12:00:00Z") == 1_767_355_200 == parse_time("1767355200")
    assert parse_time("2026-01-02T13:00:00+01:00") == 1_767_355_200
    assert parse_time("2026-01-02") == 1_767_312_000 == parse_time("2026-01-02T00:00:00")
    assert parse_time("-60") == -60
    assert format_time(1_767_355_200) == "2026-01-02T12:00:00Z"
    for bad in ("yesterday", "2026-01-02T12:00:00.5Z", "2026-13-01", "1e9"):
        with pytest.raises(ValueError):
            parse_time(bad)


def test_config_checks_the_rule():
    with pytest.raises(ValueError, match="split 'hour'"):
        ShardsConfig(split="hour")
    with pytest.raises(ValueError, match="test_from applies to split time or time\\+probe"):
        ShardsConfig(test_from=T0)
    with pytest.raises(ValueError, match="int Unix seconds"):
        ShardsConfig(split="time", test_from=1.5)
    assert ShardsConfig(split="time").test_from is None  # resolved from the data by run_shards


def test_cli_test_from_iso_and_unix_seconds_agree(tmp_path):
    inp = str(tiny_input(tmp_path))
    base = ["shards", inp, "--row-len", "64", "--buckets", "1", "--workers", "1", "--quiet",
            "--split", "time", "--json"]
    configs = []
    for i, value in enumerate(["2026-01-01T00:01:00Z", "1767225660", "2026-01-01T01:01:00+01:00"]):
        r = CliRunner().invoke(main, base + ["--test-from", value, "--out", str(tmp_path / str(i))])
        assert r.exit_code == 0, r.output
        configs.append(mf.load_manifest(tmp_path / str(i))["config"])
        assert json.loads(r.stdout.strip().splitlines()[-1])["split"]["test_from"] == T0 + 60
        assert "split         time, test from 2026-01-01T00:01:00Z (1767225660)" in r.stderr
    assert configs[0] == configs[1] == configs[2] and configs[0]["test_from"] == T0 + 60
    m = mf.load_manifest(tmp_path / "0")  # tiny: 3 of its 6 measurements at T0
    assert (m["splits"]["train"]["measurements"], m["splits"]["test"]["measurements"]) == (3, 3)


def test_cli_test_from_needs_a_time_split(tmp_path):
    r = CliRunner().invoke(main, ["shards", str(tiny_input(tmp_path)), "--out", str(tmp_path / "o"),
                                  "--test-from", "2026-01-02"])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "--test-from applies to --split time" in r.output
    assert not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["shards", "x", "--out", str(tmp_path / "o"), "--split", "time",
                                  "--test-from", "soon"])
    assert r.exit_code == 2 and "Invalid value for '--test-from'" in r.output


# --- verify ------------------------------------------------------------------------------

def test_verify_names_rows_that_break_the_rule(recs, time_dataset, tmp_path):
    import shutil

    for new_cut, split in ((CUT + 3600, "test"), (CUT - 3600, "train")):
        d = Path(shutil.copytree(time_dataset, tmp_path / split))
        m = json.loads((d / mf.MANIFEST_NAME).read_text())
        m["config"]["test_from"] = new_cut  # the counts stay consistent: only the rule moves
        (d / mf.MANIFEST_NAME).write_text(json.dumps(m))
        shard = d / split / "shard-b00000-e0.array_record"
        wrong = (lambda t: t < new_cut) if split == "test" else (lambda t: t >= new_cut)
        bad = []  # (record, segment, time) of each record's first measurement on the wrong side
        for rec, (_, ms) in enumerate(_records(d, split)):
            hit = [(sid, x.time) for sid, seg in ms for x in seg if wrong(x.time)]
            if hit:
                bad.append((rec, *hit[0]))
        assert bad and sum(wrong(r["event_time"]) for r in recs
                           if (r["event_time"] >= CUT) == (split == "test")) > 0
        first = bad[0]
        side = "before" if split == "test" else "at or after"
        problems = verify_dir(d)
        assert problems[0] == (
            f"{shard}#{first[0]} segment {first[1]}: a measurement at {format_time(first[2])} "
            f"({first[2]}) is {side} the test cutoff {format_time(new_cut)} ({new_cut}), "
            f"in the {split} split")
        assert all(str(shard) in p for p in problems)
        assert len(problems) == min(len(bad), 5) + (len(bad) > 5)  # 5 a shard, then "…and n more"
        r = CliRunner().invoke(main, ["verify", str(d), "--workers", "1"])
        assert r.exit_code == 1 and f"{shard}#{first[0]} segment" in r.stdout


def _records(d: Path, split: str):
    """(shard name, [(segment id, its decoded measurements)]) per record of a split."""

    from prep.tokens.decode import decode_context

    for name, tok, seg in read_split(d, split):
        yield name, [(sid, decode_context(tok[seg == sid].tolist()))
                     for sid in range(1, int(seg.max()) + 1)]


def test_verify_checks_the_split_config(time_dataset):
    m = mf.load_manifest(time_dataset)
    m["config"]["test_from"] = None
    assert check_counts(m) == ["manifest.json: config split 'time' without an int cutoff "
                               "test_from (None)"]
    m["config"] |= {"split": "probe"}
    m["counts"]["measurements_excluded_by_split"] = 1
    assert check_counts(m) == [
        "manifest.json: measurements_excluded_by_split is 1, expected 0",
        f"manifest.json: measurements_tokenized is {m['counts']['measurements_tokenized']:,}, "
        f"expected {m['counts']['measurements_tokenized'] - 1:,}"]
