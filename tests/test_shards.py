"""prep shards end to end: exact rows on a tiny input, nothing lost or duplicated, no
probe in both splits, byte-identical output across workers and file order, kill-safety,
bad input."""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import (
    PREP,
    T0,
    TINY_CFG,
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
from prep.schema import rows
from prep.schema.measurements import Measurements, addr_words
from prep.shards.bucket import ShardsConfig, is_test_probe, process_bucket
from prep.shards.local_runner import run_shards
from prep.tokens.decode import decode_context, rtt_ms
from prep.tokens.reference import rtt_code
from prep.tools.verify import verify_dir


def rtt_q(ms: float) -> float:
    return -1.0 if ms == -1.0 else rtt_ms(*rtt_code(ms))


def key(family, src_hi, src_lo, dst_hi, dst_lo, rtt):
    return (int(family), int(src_hi), int(src_lo), int(dst_hi), int(dst_lo), rtt)


# --- a tiny input with rows you can count by hand (tests/helpers.py's tiny_input) --------

def test_tiny_input_exact_rows_and_counts(tmp_path):
    out = tmp_path / "out"
    s = run_shards([str(tiny_input(tmp_path))], str(out), TINY_CFG, progress=False)
    got = read_split(out, "train")
    # Best fit decreasing: 55 alone (9 left, no measurement fits), then 39 + 21 = 60.
    assert [seg.tolist() for _, _, seg in got] == [[1] * 55 + [0] * 9,
                                                   [1] * 39 + [2] * 21 + [0] * 4]
    row1 = [decode_context(got[1][1][got[1][2] == sid].tolist()) for sid in (1, 2)]
    ip = lambda text: addr_words(text)[2]  # noqa: E731
    assert [(x.src_lo, x.time, x.rtt) for x in row1[0]] == [
        (ip("192.0.2.1"), T0, rtt_q(10.0)), (ip("192.0.2.1"), T0 + 60, rtt_q(20.0))]
    assert [(x.src_lo, x.time, x.failed) for x in row1[1]] == [(ip("192.0.2.2"), T0, True)]
    assert all(tok[seg == 0].tolist() == [0] * int((seg == 0).sum()) for _, tok, seg in got)
    assert s["rejected_by_reason"] == {"bad_rtt": 1, "empty_src_addr": 1, "family_mismatch": 1}
    assert (s["measurements_in"], s["measurements_tokenized"], s["contexts"]) == (9, 6, 3)
    assert (s["rows"], s["tokens"], s["lower_bound_rows"]) == ({"train": 2, "test": 0}, 115, 2)
    m = mf.load_manifest(out)
    assert m["segments_per_row"] == {"1": 1, "2": 1}
    assert m["counts"]["padding_tokens"] == 2 * 64 - 115
    assert [e["path"] for e in m["splits"]["train"]["shards"]] == ["train/shard-b00000-e0.array_record"]
    assert m["inputs"][0]["size"] == (tmp_path / "in" / "tiny.parquet").stat().st_size
    assert verify_dir(out) == []


def test_nothing_lost_nothing_duplicated_and_splits_disjoint(tmp_path):
    recs = probe_data(n_probes=60, per_probe=150, seed=1)
    write_parquet(tmp_path / "in" / "a.parquet", recs[: len(recs) // 2])
    write_parquet(tmp_path / "in" / "b.parquet", recs[len(recs) // 2:])
    cfg = ShardsConfig(n_buckets=4, test_fraction=0.3, epochs=2, max_measurements=40)
    s = run_shards([str(tmp_path / "in")], str(tmp_path / "out"), cfg, progress=False)
    assert s["measurements_tokenized"] == 2 * len(recs) and s["measurements_rejected"] == 0
    want = collections.Counter()
    probe_of_src = {}
    for r in recs:
        fam, hi, lo = addr_words(r["src_addr"])
        _, dhi, dlo = addr_words(r["dst_addr"])
        want[key(fam, hi, lo, dhi, dlo, rtt_q(r["rtt"]))] += 1
        probe_of_src[(hi, lo)] = r["prb_id"]
    times = collections.Counter((r["prb_id"], r["event_time"]) for r in recs)
    for epoch in (0, 1):
        got, probes = collections.Counter(), {"train": set(), "test": set()}
        for split in ("train", "test"):
            for name, ms in decoded_segments(tmp_path / "out", split):
                if not name.endswith(f"-e{epoch}.array_record"):
                    continue
                seg_probes = {probe_of_src[(x.src_hi, x.src_lo)] for x in ms}
                assert len(seg_probes) == 1  # no segment crosses a probe
                probes[split] |= seg_probes
                for x in ms:
                    got[key(x.family, x.src_hi, x.src_lo, x.dst_hi, x.dst_lo, x.rtt)] += 1
                    if x.time is not None:  # a timestamp that came back is the measured one
                        assert times[(next(iter(seg_probes)), x.time)] > 0
        assert got == want  # every accepted measurement exactly once per epoch
        assert not probes["train"] & probes["test"]
        test = is_test_probe(np.array(sorted(probes["test"]), np.uint64), 0.3)
        assert test.all() and len(probes["test"]) + len(probes["train"]) == 60
    m = mf.load_manifest(tmp_path / "out")
    assert {e["epoch"] for e in m["splits"]["train"]["shards"]} == {0, 1}
    # Each epoch has its own field orders, timestamp modes and cuts: no row repeats.
    e0 = {tok.tobytes() for n, tok, _ in read_split(tmp_path / "out", "train") if "-e0" in n}
    e1 = {tok.tobytes() for n, tok, _ in read_split(tmp_path / "out", "train") if "-e1" in n}
    assert e0 and e1 and not e0 & e1
    assert verify_dir(tmp_path / "out") == []


def test_same_bytes_for_any_worker_count_and_file_order(tmp_path):
    recs = probe_data(n_probes=40, per_probe=100, seed=2)
    a = write_parquet(tmp_path / "in" / "a.parquet", recs[::2])
    b = write_parquet(tmp_path / "in" / "b.parquet", recs[1::2])
    cfg = ShardsConfig(n_buckets=3, test_fraction=0.25)
    run_shards([str(a), str(b)], str(tmp_path / "w1"), cfg, workers=1, progress=False)
    run_shards([str(b), str(a)], str(tmp_path / "w2"), cfg, workers=2, progress=False)
    one, two = tree_bytes(tmp_path / "w1"), tree_bytes(tmp_path / "w2")
    assert len(one) == 6 and one == two  # 3 buckets x 2 splits
    assert manifest_sans_timing(tmp_path / "w1") == manifest_sans_timing(tmp_path / "w2")


def test_process_bucket_is_pure(tmp_path):
    from prep.schema.validate import read_validated

    recs = probe_data(n_probes=10, per_probe=50, seed=3)
    m, _, _ = read_validated([write_parquet(tmp_path / "x.parquet", recs)])
    cfg = ShardsConfig(test_fraction=0.5)
    r1 = process_bucket(7, m, cfg, str(tmp_path / "a"))
    r2 = process_bucket(7, m.take(np.arange(len(m))[::-1]), cfg, str(tmp_path / "b"))
    assert r1 == r2 and json.loads(json.dumps(r1)) == r1
    assert [s["path"] for s in r1["shards"]] == ["train/shard-b00007-e0.array_record",
                                                 "test/shard-b00007-e0.array_record"]
    assert sum(s["measurements"] for s in r1["shards"]) == len(recs)
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def _dataset_bytes(d: Path) -> dict[str, bytes]:
    """The dataset's files: manifest.json, train/*, test/*."""
    files = [d / mf.MANIFEST_NAME] + sorted(d.glob("train/*")) + sorted(d.glob("test/*"))
    return {str(p.relative_to(d)): p.read_bytes() for p in files if p.is_file()}


def test_killed_rerun_keeps_the_old_dataset_and_next_run_completes(tmp_path):
    # 20,000 measurements of 200 probes: the kill lands mid-run by the buckets' lingering
    # below, not by the input's size
    inp = write_parquet(tmp_path / "in" / "a.parquet", probe_data(n_probes=200, per_probe=100, seed=4))
    out = tmp_path / "out"
    args = ["shards", str(inp), "--out", str(out), "--workers", "2", "--buckets", "32", "--quiet",
            "--seed", "1", "--overwrite"]
    cmd = [str(PREP)] + args
    # Each bucket lingers after writing its shards, so the kill below always lands mid-run.
    slow = ("import sys, time, prep.shards.local_runner as s; from prep.cli import main\n"
            "real = s.process_bucket\n"
            "def slow(*a, **k):\n    r = real(*a, **k); time.sleep(0.5); return r\n"
            "s.process_bucket = slow; main(sys.argv[1:])")
    run_shards([str(inp)], str(out), ShardsConfig(n_buckets=32), progress=False)  # an old dataset
    old = _dataset_bytes(out)
    proc = subprocess.Popen([sys.executable, "-c", slow] + args, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(out.glob(".tmp-*/train/*.array_record")) and time.monotonic() < deadline:
        time.sleep(0.005)  # kill once the first bucket's shards are written
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(out.glob(".tmp-*/train/*.array_record")), "the run ended before it could be killed"
    # The old dataset is untouched: nothing of the killed run outside its staging folder.
    assert _dataset_bytes(out) == old and verify_dir(out) == []
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL, timeout=120)
    assert not list(out.glob(".tmp-*")) and verify_dir(out) == []
    assert mf.load_manifest(out)["seed"] == 1 and _dataset_bytes(out) != old


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"event_time": [1], "src_addr": ["192.0.2.1"]}), bad)
    r = CliRunner().invoke(main, ["shards", str(bad), "--out", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "missing required column" in r.output
    assert not (tmp_path / "out" / mf.MANIFEST_NAME).exists()
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    r = CliRunner().invoke(main, ["shards", str(tmp_path / "junk.parquet"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "junk.parquet" in r.output and "Traceback" not in r.output
    good = tiny_input(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = CliRunner().invoke(main, ["shards", str(good), "--out", str(tmp_path / "mine")])
    assert r.exit_code == 2 and "notes.txt" in r.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_json_summary(tmp_path):
    r = CliRunner().invoke(main, ["shards", str(tiny_input(tmp_path)), "--out", str(tmp_path / "o"),
                                  "--row-len", "64", "--test-fraction", "0", "--buckets", "1",
                                  "--workers", "1", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert (s["measurements_in"], s["measurements_rejected"], s["rows"]) == (9, 3, {"train": 2, "test": 0})
    assert "padding" in r.stderr and "9 in, 3 rejected" in r.stderr
    # under 100 measurements, and --test-fraction 0's empty test split: warnings, on stderr
    # and in the summary
    want = ["the train split holds 2 of 2 rows (100 %) and 6 measurements: too little to "
            "train on; lower --test-fraction or give more data",
            "the test split holds 0 of 2 rows (0 %) and 0 measurements: a `train eval` on it "
            "means little; give more probes, a larger --test-fraction or an earlier --test-from"]
    assert s["warnings"] == want
    assert r.stderr.strip().splitlines()[-2:] == [f"warning: {w}" for w in want]


def test_atlas_sample_round_trips(atlas_dir, tmp_path):
    """The real RIPE Atlas sample: every accepted measurement comes back exactly once."""
    from prep.ingest.atlas import AtlasConfig, import_atlas
    from prep.schema.validate import read_validated

    import_atlas(AtlasConfig(inputs=(atlas_dir / "api", atlas_dir / "dump"), out=tmp_path / "pq"))
    m, rejected, rows_in = read_validated([tmp_path / "pq"])
    s = run_shards([str(tmp_path / "pq")], str(tmp_path / "out"), ShardsConfig(n_buckets=4),
                   workers=2, progress=False)
    assert (s["measurements_in"], s["measurements_tokenized"]) == (rows_in, len(m))
    assert s["rejected_by_reason"] == rejected
    want = collections.Counter(key(*x[:5], rtt_q(float(x[5]))) for x in zip(
        m.family, m.src_hi, m.src_lo, m.dst_hi, m.dst_lo, m.rtt))
    timed = collections.Counter(zip(m.src_hi.tolist(), m.src_lo.tolist(), m.dst_lo.tolist(),
                                    m.time.tolist()))
    got = collections.Counter()
    for split in ("train", "test"):
        for _, ms in decoded_segments(tmp_path / "out", split):
            for x in ms:
                got[key(x.family, x.src_hi, x.src_lo, x.dst_hi, x.dst_lo, x.rtt)] += 1
                assert x.time is None or timed[(x.src_hi, x.src_lo, x.dst_lo, x.time)] > 0
    assert len(m) > 1000 and got == want
    assert verify_dir(tmp_path / "out") == []


def test_damaged_file_mid_run_stops_cleanly(tmp_path):
    inp = tmp_path / "in"
    write_parquet(inp / "a.parquet", probe_data(n_probes=5, per_probe=20, seed=7))
    good = (inp / "a.parquet").read_bytes()
    # A valid footer and schema, but the data pages are garbage: found only when read.
    (inp / "b.parquet").write_bytes(good[:4] + bytes(b ^ 0x55 for b in good[4:200]) + good[200:])
    r = CliRunner().invoke(main, ["shards", str(inp), "--out", str(tmp_path / "out"),
                                  "--workers", "2"])
    assert r.exit_code == 2 and "b.parquet" in r.output.splitlines()[-1], r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "out").exists()  # the failed run removed the folder it made


def test_assemble_rows_places_pieces_in_slot_order():
    from prep.shards.bucket import assemble_rows

    tokens = np.arange(1, 11, dtype=np.uint16)  # pieces of 3, 2 and 5 tokens
    block = assemble_rows(tokens, np.array([0, 3, 5, 10]), np.array([0, 0, 1]), 2, 6)
    got = [rows.decode_row(r.tobytes()) for r in block]
    assert [t.tolist() for t, _ in got] == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 0]]
    assert [s.tolist() for _, s in got] == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 0]]
    assert [int.from_bytes(r[8:10].tobytes(), "little") for r in block] == [2, 1]
    with pytest.raises(ValueError, match="row past row_len"):
        assemble_rows(tokens, np.array([0, 3, 5, 10]), np.array([0, 0, 1]), 2, 4)


@pytest.mark.parametrize("row_len", [96, 97])
def test_encoding_into_the_records_gives_the_assembled_block(row_len):
    """prep.shards.bucket.encode_rows: the pieces encoded straight into the rows' records
    (an even row_len), or end to end then assembled (odd), give the block that encoding
    end to end and ``assemble_rows`` give, byte for byte: headers, tokens, segment ids,
    and zero padding where the encoder left garbage past a row's last piece."""
    from prep.pack.contexts import ContextConfig, plan_contexts
    from prep.pack.packing import pack
    from prep.shards.bucket import assemble_rows, encode_rows
    from prep.tokens.kernel import encode_pieces

    m = Measurements(**{k: np.asarray(v) for k, v in tiny_bucket_columns().items()})
    plan = plan_contexts(m, ContextConfig(row_len=row_len, max_gap_s=3_600), 7)
    packing = pack(plan.ctx_start, plan.ctx_end, plan.cost, plan.has_ts, plan.abs_extra,
                   row_len=row_len)
    tokens, offsets = encode_pieces(plan.sorted, plan, packing.piece_start, packing.piece_end, 7)
    want = assemble_rows(tokens, offsets, packing.piece_row, packing.n_rows, row_len)
    got, n_tokens = encode_rows(plan, packing, 7, row_len)
    assert n_tokens == len(tokens) == int(offsets[-1])
    assert got.shape == want.shape == (packing.n_rows, rows.record_size(row_len))
    assert np.array_equal(got, want)
    tails = [row_len - int((r[16 + 2 * row_len:] > 0).sum()) for r in got]
    assert sum(tails) > 0  # rows with padding: where the encoder's garbage was cleared
    assert packing.n_rows > 3 and sum(np.bincount(packing.piece_row) > 1) > 0


def tiny_bucket_columns() -> dict:
    """600 measurements of 9 probes: both families, failures, gaps (planted)."""
    i = np.arange(600)
    six = i % 4 == 0
    return dict(probe=(i % 9 + 1).astype(np.uint64),
                time=(1_767_225_600 + i * 53 + (i > 400) * 90_000).astype(np.int64),
                family=np.where(six, 6, 4).astype(np.uint8),
                src_hi=np.where(six, 0x2001_0db8 << 32, 0).astype(np.uint64),
                src_lo=(0xC000_0200 + i % 9).astype(np.uint64),
                dst_hi=np.where(six, 0x2001_0db8 << 32, 0).astype(np.uint64),
                dst_lo=(0xC100_0000 + i % 13).astype(np.uint64),
                rtt=np.where(i % 7 == 0, -1.0, 1.0 + i * 0.41))


def test_encode_pieces_at_places_and_refuses_overlaps():
    """encode_pieces ``at``: each piece's tokens at its own place in ``out`` (gaps
    between them kept), the same tokens as end to end; places that overlap, or an ``out``
    without the kernel's slack past ``at[-1]``, are refused."""
    from prep.pack.contexts import ContextConfig, plan_contexts
    from prep.tokens.kernel import SLACK, encode_pieces

    m = Measurements(**{k: np.asarray(v) for k, v in tiny_bucket_columns().items()})
    plan = plan_contexts(m, ContextConfig(row_len=128), 3)
    ps, pe = plan.ctx_start[:4], plan.ctx_end[:4]
    tokens, offsets = encode_pieces(plan.sorted, plan, ps, pe, 3)
    lens = np.diff(offsets)
    at = np.concatenate([[0], np.cumsum(lens + 20)])  # 20 tokens apart
    out = np.full(int(at[-1]) + SLACK, 7, np.uint16)
    encode_pieces(plan.sorted, plan, ps, pe, 3, out=out, at=at)
    for j in range(4):
        assert out[at[j]:at[j] + lens[j]].tolist() == tokens[offsets[j]:offsets[j + 1]].tolist()
    assert out[at[0] + lens[0] + 10:at[1]].tolist() == [7] * 10  # past the garbage: untouched
    with pytest.raises(ValueError, match="in order"):
        bad = at.copy()
        bad[1] = lens[0] - 1
        encode_pieces(plan.sorted, plan, ps, pe, 3, out=out, at=bad)
    with pytest.raises(ValueError, match="SLACK"):
        encode_pieces(plan.sorted, plan, ps, pe, 3, out=out[:-1], at=at)


def test_the_console_script_ends_with_the_collector_frozen(monkeypatch):
    """`prep` (pyproject's console script, prep.cli.run) runs the click group, then freezes
    the garbage collector, so that the interpreter's last collection at exit walks nothing
    (~0.1 s of every `prep shards`). The group itself (what the tests invoke) freezes nothing."""
    import gc
    import tomllib

    from prep.cli import run

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert scripts["project"]["scripts"]["prep"] == "prep.cli:run"
    gc.unfreeze()
    assert CliRunner().invoke(main, ["--version"]).exit_code == 0
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(sys, "argv", ["prep", "--version"])
    with pytest.raises(SystemExit) as e:
        run()
    assert e.value.code == 0 and gc.get_freeze_count() > 0
    gc.unfreeze()


def test_max_segments_caps_every_row(tmp_path):
    inp = write_parquet(tmp_path / "a.parquet", probe_data(n_probes=60, per_probe=5, seed=8))
    s = run_shards([str(inp)], str(tmp_path / "out"), ShardsConfig(n_buckets=1, max_segments=2),
                   progress=False)
    hist = mf.load_manifest(tmp_path / "out")["segments_per_row"]
    assert max(map(int, hist)) == 2 and s["measurements_tokenized"] == 300
    assert all(int(seg.max()) <= 2 for _, _, seg in read_split(tmp_path / "out", "train"))


def test_summary_says_what_the_buckets_cost():
    from prep.shards.dataset import format_summary

    s = {"elapsed_s": 1.0, "measurements_per_s": 10, "workers": 2, "measurements_in": 100,
         "measurements_rejected": 0, "rejected_by_reason": {}, "contexts": 9, "segments": 9,
         "split": {"rule": "probe", "test_fraction": 0.1, "test_from": None},
         "rows": {"train": 90, "test": 21}, "lower_bound_rows": 100,
         "rows_over_lower_bound": 1.11, "tokens": 100_000, "padding_fraction": 0.12,
         "buckets": 4, "bucket_tail_rows": 8}
    lines = format_summary(s).splitlines()
    assert lines[5] == ("  buckets       4; up to 8 of the 11 rows over the lower bound are the "
                        "buckets' part-filled last rows (fewer --buckets pack tighter, with more "
                        "memory per worker)")
    s |= {"buckets": 1, "bucket_tail_rows": 2}
    assert format_summary(s).splitlines()[5] == "  buckets       1"


def test_a_first_run_says_it_compiles_and_leaves_it_out_of_the_rate(tmp_path, monkeypatch):
    """Item 15: the first run after an install compiles the Numba kernels (15-25 s): it says
    so before the progress bars, and the summary's rate is that of the run's own work. With
    the cache filled, the driver loads nothing (its workers load what they run), silently."""
    import time as _time

    from prep.ingest.synth import SynthConfig, synth
    from prep.shards import kernels
    from prep.shards.kernels import KernelsReady

    def warm(compiled, loaded):
        def warm_kernels(d):
            _time.sleep(1.5)  # a compile, or a slow load
            return KernelsReady(compiled, loaded, 1)
        return warm_kernels

    raw = tmp_path / "raw"
    synth(SynthConfig(out=raw, rows=2_000, probes=20, days=1, seed=1))
    monkeypatch.setattr(kernels, "kernels_cached", lambda: False)  # a cold cache
    monkeypatch.setattr(kernels, "warm_kernels", warm(("a.b", "a.c"), ("a.d",)))
    r = CliRunner().invoke(main, ["shards", str(raw), "--out", str(tmp_path / "out"),
                                  "--workers", "1", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[1] == "prep shards: compiling kernels (once; Numba caches them for later runs)"
    assert lines[2].startswith("prep shards: kernels compiled in 1.")
    assert lines[2].endswith(" s (2 on 1 process, 1 loaded from Numba's cache; Numba caches "
                             "them for later runs)")
    s = json.loads(r.stdout)
    assert 1.5 <= s["compile_s"] < s["elapsed_s"] and s["kernels_compiled"] == 2
    # the summary's times are rounded to the millisecond, and this run's work takes tens of
    # them: the rate lies within what the rounding of both allows
    work = s["elapsed_s"] - s["compile_s"]
    lo, hi = 2_000 / (work + 0.001) - 1, 2_000 / max(work - 0.001, 1e-3) + 1
    assert lo <= s["measurements_per_s"] <= hi
    assert f"(the {s['compile_s']:.1f} s of compiling kernels left out of the rate)" in r.stderr
    # cached: nothing loaded in the driver (the workers load what they run), nothing said
    def no_warm(d):
        raise AssertionError("the driver loaded the cached kernels")
    monkeypatch.setattr(kernels, "kernels_cached", lambda: True)
    monkeypatch.setattr(kernels, "warm_kernels", no_warm)
    r = CliRunner().invoke(main, ["shards", str(raw), "--out", str(tmp_path / "out2"),
                                  "--workers", "1", "--quiet", "--json"])
    assert r.exit_code == 0 and "kernels" not in r.stderr, r.output
    s = json.loads(r.stdout)
    assert s["compile_s"] == 0.0 and s["kernels_compiled"] is None
    assert "kernels left out of the rate" not in r.stderr
