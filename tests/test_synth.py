import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from prep.cli import main
from prep.ingest.synth import SynthConfig, generate
from prep.schema import validate

ARGS = ["--rows", "200000", "--probes", "300", "--days", "1", "--seed", "7"]


def run_cli(out):
    res = CliRunner().invoke(main, ["synth", "--out", str(out), *ARGS])
    assert res.exit_code == 0, res.output
    return res


def test_synth_says_the_probes_that_have_rows(tmp_path):
    """A user trial's `--rows 10 --probes 1000` said "10 rows from 1,000 probes"."""
    from prep.ingest.synth import synth

    s = synth(SynthConfig(out=tmp_path / "s", rows=10, probes=1000, days=1))
    t = pq.read_table(tmp_path / "s")
    assert (s["probes"], s["probes_drawn"]) == (len(set(t["prb_id"].to_pylist())), 1000) == (
        10, 1000)
    res = CliRunner().invoke(main, ["synth", "--out", str(tmp_path / "c"), "--rows", "10",
                                    "--probes", "1000", "--days", "1"])
    assert res.exit_code == 0, res.output
    assert "synth: 10 rows from 10 of 1,000 probes over 1 day in " in res.stderr
    res = CliRunner().invoke(main, ["synth", "--out", str(tmp_path / "d"), "--rows", "1000",
                                    "--probes", "2", "--days", "1"])
    assert "synth: 1,000 rows from 2 probes over 1 day in " in res.stderr


def test_same_seed_same_bytes_and_schema(tmp_path):
    run_cli(tmp_path / "a")
    res = run_cli(tmp_path / "b")
    # 6 of the 300 probes are drawn no rows (sparse ones): the line counts those with rows
    assert "synth: 200,000 rows from 294 of 300 probes over 1 day in 24 files" in res.stderr
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == [f"2026-01-01T{h:02d}.parquet" for h in range(24)]
    for n in names:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()
    t = pq.read_table(tmp_path / "a" / names[0])
    assert t.schema.names == ["event_time", "prb_id", "src_addr", "dst_addr", "ip_version",
                              "rtt", "msm_id", "size"]
    # Parquet has no second unit: Arrow writes timestamp[s] as milliseconds.
    assert t.schema.field("event_time").type == pa.timestamp("ms", tz="UTC")
    assert [t.schema.field(c).type for c in ("src_addr", "rtt", "prb_id")] == [
        pa.string(), pa.float64(), pa.int64()]
    other = generate(SynthConfig(out=tmp_path, rows=1000, probes=30, days=1, seed=8))
    mine = generate(SynthConfig(out=tmp_path, rows=1000, probes=30, days=1, seed=7))
    assert not np.array_equal(other["rtt"], mine["rtt"])

    # Every row accounted for by validation; the malformed ~0.1 % are rejected by reason.
    m, rejected, rows_in = validate.read_validated([tmp_path / "a"])
    assert rows_in == 200_000
    assert rejected == {"empty_src_addr": 68, "empty_dst_addr": 62, "family_mismatch": 89}
    assert len(m) == 200_000 - 219
    assert m.time.min() >= 1_767_225_600 and m.time.max() < 1_767_225_600 + 86_400


def test_statistics_look_like_ripe_atlas():
    c = generate(SynthConfig(out=".", rows=400_000, probes=600, days=2, seed=0))
    rtt, v6 = c["rtt"], c["ip_version"] == 6
    ok = rtt != -1
    assert 0.38 <= v6.mean() <= 0.46  # RIPE: 42 % IPv6
    assert 0.15 <= (~ok).mean() <= 0.20  # RIPE: ~17 % failed
    p50, p99 = np.percentile(rtt[ok], [50, 99])
    # RIPE: 50 ms, 343 ms. The flat world (FLAT below) reached 355 ms through a lognormal of
    # sigma 0.9 per (probe, root), the draws that made a probe's RTTs unrelated; the default's
    # roots are near (30 anycast sites), so its tail is the far user targets': 295 ms
    assert 40 <= p50 <= 60 and 280 <= p99 <= 420
    assert np.all(np.diff(c["time"]) >= 0) and len(rtt) == 400_000

    # Busyness: a few very busy probes, many sparse ones.
    _, per_probe = np.unique(c["prb_id"], return_counts=True)
    assert per_probe.max() > 8 * np.median(per_probe) and np.percentile(per_probe, 10) < 100

    # NAT: one private src_addr shared by probes with distinct prb_id.
    pool = np.array(c["pool"], dtype=object)
    v4 = ~v6
    nat = pool[c["src"][v4]] == "192.168.1.2"
    assert len(np.unique(c["prb_id"][v4][nat])) >= 3

    # Some probes' IPv6 always fails while their IPv4 works.
    dead = [p for p in np.unique(c["prb_id"][v6])
            if np.all(rtt[v6 & (c["prb_id"] == p)] == -1) and np.any(rtt[~v6 & (c["prb_id"] == p)] > 0)]
    assert len(dead) >= 3


def _root_correlation(c) -> float:
    """Across probes, the correlation of the log median RTT to a probe's first IPv4 root
    with that to its second."""
    ok = (c["rtt"] > 0) & (c["msm_id"] < 2001)  # built-in IPv4 root pings: msm 1001 + root
    keys = c["prb_id"][ok] * 100 + (c["msm_id"][ok] - 1001)
    u, inv = np.unique(keys, return_inverse=True)
    med = np.array([np.median(c["rtt"][ok][inv == i]) for i in range(len(u))])
    _, at, n = np.unique(u // 100, return_index=True, return_counts=True)
    at = at[n >= 2]
    return float(np.corrcoef(np.log(med[at]), np.log(med[at + 1]))[0, 1])


FLAT = dict(access_ms=0.0, detour=0.35, anycast_sites=0)  # the built-in world before 11-29
GEO = dict(access_ms=5.0, access_sigma=0.8, detour=0.15, anycast_sites=30)  # §8.10's


def test_a_placeable_world_changes_only_the_rtts(tmp_path):
    # Access delays, smaller detours and anycast sites: what a probe's replies to some
    # targets say of its RTT to others (real RTTs are like this: docs/learning.md §8.10)
    flat = generate(SynthConfig(out=".", rows=200_000, probes=300, days=1, seed=7, **FLAT))
    base = generate(SynthConfig(out=".", rows=200_000, probes=300, days=1, seed=7))
    geo = generate(SynthConfig(out=".", rows=200_000, probes=300, days=1, seed=7, **GEO))
    for other in (flat, geo):
        for k in ("time", "prb_id", "src", "dst", "ip_version", "msm_id", "size"):
            assert np.array_equal(base[k], other[k]), k
        assert base["pool"] == other["pool"]
        assert np.array_equal(base["rtt"] == -1, other["rtt"] == -1)  # the same pings fail
        assert not np.array_equal(base["rtt"], other["rtt"])
    # 291 probes ping two IPv4 roots or more: in the flat world their RTTs to them are
    # unrelated draws; with sites, both are distances from the same place plus the same
    # access delay (the default's heavier-tailed access delays correlate them more)
    assert round(_root_correlation(flat), 2) == 0.02
    assert round(_root_correlation(geo), 2) == 0.76
    assert round(_root_correlation(base), 2) == 0.83
    # the command passes the options through: its files hold generate's RTTs in time order
    res = CliRunner().invoke(main, ["synth", "--out", str(tmp_path), *ARGS, "--access-ms", "5",
                                    "--access-sigma", "0.8", "--detour", "0.15",
                                    "--anycast-sites", "30"])
    assert res.exit_code == 0, res.output
    files = sorted(tmp_path.glob("*.parquet"))
    rtt = np.concatenate([pq.read_table(f, columns=["rtt"])["rtt"].to_numpy() for f in files])
    assert np.array_equal(rtt, geo["rtt"])


def test_float_options_that_are_not_finite_are_refused(tmp_path):
    # a user trial: --detour nan wrote RTTs of NaN (p50 "nan ms"), --access-sigma inf too;
    # every float option of prep is a prep.base.options.Finite, as train's are
    for flag, value, why in [("--access-ms", "nan", "nan is not a finite number."),
                             ("--access-sigma", "inf", "inf is not a finite number."),
                             ("--detour", "nan", "nan is not a finite number."),
                             ("--detour", "-inf", "-inf is not in the range x>=0."),
                             ("--access-ms", "-1", "-1.0 is not in the range x>=0.")]:
        res = CliRunner().invoke(main, ["synth", "--out", str(tmp_path / "s"), "--rows", "10",
                                        "--probes", "2", "--days", "1", flag, value])
        assert res.exit_code == 2, res.output
        assert res.stderr.splitlines()[-1] == f"Error: Invalid value for '{flag}': {why}"
        assert not (tmp_path / "s").exists()
    res = CliRunner().invoke(main, ["shards", str(tmp_path), "--out", str(tmp_path / "x"),
                                    "--test-fraction", "nan"])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[-1] == \
        "Error: Invalid value for '--test-fraction': nan is not a finite number."
    assert not (tmp_path / "x").exists()
