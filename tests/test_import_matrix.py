"""`prep import-matrix`: latency matrices to parquet, with planted answers (a 3×3 matrix
with a missing entry, units, frame order and times), the bad inputs (one line, exit 2,
nothing written), the output folder's rules, and the real Seattle slice through
`prep shards`."""

import ipaddress
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.ingest.matrix import node_addresses

SEATTLE = Path(__file__).parent / "fixtures" / "seattle"
T0 = 1_000_000_000  # --start of the planted tests


def run(*args):
    return CliRunner().invoke(main, [*map(str, args)])


def imp(*args):
    return run("import-matrix", *args)


def rows(out):
    t = pq.read_table(out / "matrix.parquet").to_pylist()
    return [(int(r["event_time"].timestamp()), r["prb_id"], r["src_addr"], r["dst_addr"],
             r["ip_version"], r["rtt"], r["msm_id"]) for r in t]


def write(folder, name, text):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return folder / name


def test_addresses_are_pinned_public_and_distinct():
    # The same node gets the same address in every run: pinned here.
    assert node_addresses(3) == ["145.10.45.236", "9.170.179.108", "119.105.62.203"]
    a = node_addresses(3000)
    assert a[:3] == node_addresses(3) and len(set(a)) == 3000
    for s in a:
        ip = ipaddress.IPv4Address(s)
        assert ip.is_global and not ip.is_multicast and not ip.is_reserved, s
        assert s.split(".")[-1] not in ("0", "255"), s


def test_3x3_with_a_missing_entry_gives_exactly_these_rows(tmp_path):
    m = write(tmp_path / "in", "frame", "0 10 20\n30 0 0\n40 50.5 0\n")
    r = imp(m, "--out", tmp_path / "out", "--interval", 60, "--unit", "ms", "--start", T0,
            "--json")
    assert r.exit_code == 0, r.output
    a, b, c = node_addresses(3)
    # Source i measures i+1, i+2 (mod 3) at floor(60 * (k*3 + i) / 6) s: 0/30, 10/40, 20/50;
    # (1, 2) at +10 s is the missing entry.
    assert rows(tmp_path / "out") == [
        (T0 + 0, 1, a, b, 4, 10.0, 1),
        (T0 + 20, 3, c, a, 4, 40.0, 1),
        (T0 + 30, 1, a, c, 4, 20.0, 1),
        (T0 + 40, 2, b, a, 4, 30.0, 1),
        (T0 + 50, 3, c, b, 4, 50.5, 1)]
    s = json.loads(r.stdout)
    assert (s["frames"], s["nodes"], s["entries"], s["measurements"]) == (1, 3, 9, 5)
    assert s["rejected"] == {"diagonal": 3, "missing_rtt": 1}
    assert (s["start"], s["end"]) == (T0, T0 + 60)
    assert "5 of 9 entries; rejected 4 (diagonal 3, missing_rtt 1)" in r.stderr
    # issue 36, item 10: the "next" line is the README's walk-through, --row-len 256 included
    assert (f"next          prep shards {tmp_path / 'out'} --out shards-out --split "
            "time+probe --row-len 256") in r.stderr


def test_the_next_command_is_the_readme_s_and_one_shards_folder_per_data_set(tmp_path,
                                                                             monkeypatch):
    # a user trial: every import suggested --out shards-matrix, where the README makes
    # shards-seattle of data/seattle, and a second data set's shards would meet the first's
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    walk = next(line for line in readme.splitlines() if line.startswith("prep shards data/sea"))
    monkeypatch.chdir(tmp_path)
    r = imp(SEATTLE / "SeattleData_1", "--out", "data/seattle", "--interval", 300, "--unit", "s")
    assert r.exit_code == 0, r.output
    assert walk == "prep shards data/seattle --out shards-seattle --split time+probe --row-len 256"
    assert r.stderr.splitlines()[-1] == f"  next          {walk}"
    m = write(tmp_path / "in", "frame", "0 10\n20 0\n")
    (tmp_path / "king").mkdir()
    for cwd, out, want in [(tmp_path, "data/king", "prep shards data/king --out shards-king"),
                           (tmp_path, "my data", "prep shards 'my data' --out 'shards-my data'"),
                           (tmp_path / "king", ".", "prep shards . --out shards-king")]:
        monkeypatch.chdir(cwd)
        r = imp(m, "--out", out, "--interval", 60, "--unit", "ms")
        assert r.exit_code == 0, r.output
        assert r.stderr.splitlines()[-1] == (f"  next          {want} --split time+probe "
                                             "--row-len 256")


@pytest.mark.parametrize("unit, text, want", [
    ("s", "0 0.17\n0.02 0\n", [170.0, 20.0]),
    ("ms", "0 0.17\n-1 0\n", [0.17]),
    ("us", "0 1500\n250 0\n", [1.5, 0.25]),
    ("s", "0 1e-12\n0.02 0\n", [1e-6, 20.0]),  # #36 item 22: a positive entry never 0.0
])
def test_units_become_ms(tmp_path, unit, text, want):
    m = write(tmp_path / "in", "frame", text)
    r = imp(m, "--out", tmp_path / "out", "--interval", 10, "--unit", unit)
    assert r.exit_code == 0, r.output
    assert [row[5] for row in rows(tmp_path / "out")] == want


def test_frames_in_natural_order_each_over_its_interval(tmp_path):
    d = tmp_path / "in"
    write(d, "f_10", "0 2\n2 0\n")
    write(d, "f_9", "0 1\n1 0\n")
    write(d, "README.md", "not a frame")
    # given as a shell glob sorts them (f_10 first), and as the folder: f_9 is the first
    for i, args in enumerate([(d / "f_10", d / "f_9"), (d,)]):
        out = tmp_path / f"out{i}"
        r = imp(*args, "--out", out, "--interval", 100, "--unit", "ms",
                "--start", "2026-01-01T00:00:00Z", "--json")
        assert r.exit_code == 0, r.output
        start = 1_767_225_600
        # two nodes: source 0 at +0 s, source 1 at +50 s of each frame
        assert [(t - start, prb, rtt, msm) for t, prb, _, _, _, rtt, msm in rows(out)] == [
            (0, 1, 1.0, 1), (50, 2, 1.0, 1), (100, 1, 2.0, 2), (150, 2, 2.0, 2)]
        s = json.loads(r.stdout)
        assert (s["frames"], s["end"] - s["start"]) == (2, 200)
        assert s["first_file"].endswith("f_9") and s["last_file"].endswith("f_10")


def test_a_frame_s_time_comes_from_the_number_in_its_name(tmp_path):
    """#36 item 21: frames were timed by their place in the sorted list of paths."""
    a, b = tmp_path / "b", tmp_path / "a"  # b/Data_1 sorts after a/Data_2 as a path
    write(a, "Data_1", "0 1\n1 0\n")
    write(b, "Data_2", "0 2\n2 0\n")
    write(b, "Data_4.txt", "0 4\n4 0\n")
    out = tmp_path / "out"
    r = imp(b / "Data_4.txt", b / "Data_2", a, "--out", out, "--interval", 300, "--unit", "ms",
            "--start", "2026-01-01T00:00:00Z", "--json")
    assert r.exit_code == 0, r.output
    # frame 1 at 0-300 s, frame 2 at 300-600 s, none at 600-900 s, frame 4 at 900-1200 s
    assert [(t - 1_767_225_600, rtt, msm) for t, _, _, _, _, rtt, msm in rows(out)] == [
        (0, 1.0, 1), (150, 1.0, 1), (300, 2.0, 2), (450, 2.0, 2), (900, 4.0, 4), (1050, 4.0, 4)]
    s = json.loads(r.stdout)
    assert (s["frames"], s["end"] - s["start"]) == (3, 1200)
    assert (f"note: 1 frame missing between {a}/Data_1 and {b}/Data_4.txt (by their names; "
            "the first: frame 3); its interval holds no measurements") in r.stderr


@pytest.mark.parametrize("names, message", [
    ({"f_2": None, "g_2": None}, "{d}/f_2 and {d}/g_2: both frame 2 by their names"),
    ({"f_2": None, "f_3": "f_2"}, "{d}/f_2 and {d}/f_3: the same file (a link); give each "
                                  "frame once"),
    ({"f_2": None, "x": None}, "{d}/x: no frame number in its name, but {d}/f_2 has one"),
], ids=["same-number", "link", "unnumbered"])
def test_frames_that_their_names_cannot_tell_apart_are_one_line(tmp_path, names, message):
    d = tmp_path / "in"
    for name, target in names.items():
        if target is None:
            write(d, name, "0 1\n1 0\n")
        else:
            (d / name).symlink_to(d / target)
    r = imp(d, "--out", tmp_path / "out", "--interval", 60, "--unit", "ms")
    assert r.exit_code == 2 and not (tmp_path / "out").exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + message.format(d=d)), lines


@pytest.mark.parametrize("frames, message", [
    ({"a": "0 1 2\n3 0\n4 5 0\n"},
     "{d}/a: line 2 has 2 entries, line 1 has 3; every row needs one entry per node"),
    ({"a": "0 1 2\n3 0 4\n"}, "{d}/a: 2 rows of 3 entries; a latency matrix is square"),
    ({"a": "0 1 2\n\n3 0 x\n4 5 0\n"},
     "{d}/a: line 3, column 3: 'x' is not a finite number; write a missing measurement as 0"),
    ({"a": "0 nan\n1 0\n"}, "{d}/a: line 1, column 2: 'nan' is not a finite number"),
    ({"a": "0 1\n1 0\n", "b": "0 1 1\n1 0 1\n1 1 0\n"},
     "{d}/b: a 3×3 matrix, but {d}/a is 2×2; every frame must hold the same nodes"),
    ({"a": "\n \n"}, "{d}/a: holds no matrix (no numbers)"),
    ({"a": "0 0\n0 0\n"}, "import-matrix: no measurements in 1 frame of 2 nodes (rejected: "
                          "diagonal 2, missing_rtt 2); nothing was written to {o}"),
])
def test_bad_matrix_is_one_line_and_writes_nothing(tmp_path, frames, message):
    d = tmp_path / "in"
    for name, text in frames.items():
        write(d, name, text)
    for out in (tmp_path / "new", tmp_path / "old"):
        if out.name == "old":  # an earlier output stays as it was
            write(out, "matrix.parquet", "earlier")
        r = imp(d, "--out", out, "--interval", 60, "--unit", "ms", "--overwrite")
        assert r.exit_code == 2, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "error: " + message.format(d=d, o=out)), lines
        if out.name == "new":
            assert not out.exists()
        else:
            assert [p.name for p in out.iterdir()] == ["matrix.parquet"]
            assert (out / "matrix.parquet").read_text() == "earlier"


def test_out_folder_rules(tmp_path):
    m = write(tmp_path / "in", "frame", "0 1\n1 0\n")
    out = tmp_path / "out"
    write(out, "x.parquet", "earlier")
    args = (m, "--out", out, "--interval", 60, "--unit", "ms")
    r = imp(*args)
    assert r.exit_code == 2 and r.stderr.strip() == (
        f"error: {out}: not empty (holds 1 parquet file: x.parquet); pass --overwrite to "
        "replace them (they stay until the new output is complete), or use another --out")
    assert imp(*args, "--overwrite").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["matrix.parquet"]
    assert len(rows(out)) == 2
    write(out, "notes.txt", "mine")
    r = imp(*args, "--overwrite")
    assert r.exit_code == 2 and (
        "holds notes.txt, which `prep import-matrix` did not write" in r.stderr)
    shards = tmp_path / "shards"
    write(shards, "manifest.json", "{}")
    r = imp(*args, "--out", shards, "--overwrite")
    assert r.exit_code == 2 and r.stderr.startswith(
        f"error: {shards}: is a shards folder (the output of `prep shards`)")
    assert [p.name for p in shards.iterdir()] == ["manifest.json"]


def test_seattle_slice_to_shards(tmp_path):
    frames = sorted(SEATTLE.glob("SeattleData_*"))
    assert len(frames) == 4
    mats = [np.loadtxt(f) for f in frames]
    assert all(m.shape == (99, 99) for m in mats)
    want = sum(int(((m > 0) & ~np.eye(99, dtype=bool)).sum()) for m in mats)
    r = imp(SEATTLE, "--out", tmp_path / "pq", "--interval", 300, "--unit", "s", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["frames"], s["nodes"], s["measurements"]) == (4, 99, want)
    assert s["rejected"] == {"diagonal": 4 * 99, "missing_rtt": 4 * 99 * 98 - want}
    t = pq.read_table(tmp_path / "pq" / "matrix.parquet")
    assert np.isclose(t["rtt"].to_numpy().sum(),
                      1000 * sum(m.sum() - np.trace(m) for m in mats))
    # a source's times rise within and across frames
    prb, ts = t["prb_id"].to_numpy(), t["event_time"].to_numpy().astype(np.int64)
    for p in (1, 50, 99):
        assert (np.diff(ts[prb == p]) > 0).all()

    r = run("shards", tmp_path / "pq", "--out", tmp_path / "shards", "--split", "time+probe",
            "--row-len", 256, "--workers", 1, "--quiet", "--json")
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "shards" / "manifest.json").read_text())["counts"]
    assert (c["rows_in"], c["measurements_accepted"], c["rows_rejected"]) == (want, want, {})
    assert c["measurements_tokenized"] + c["measurements_excluded_by_split"] == want
    assert c["rows"]["train"] > 0 and c["rows"]["test"] > 0

    # `prep shards` given the matrices themselves names the command that reads them, and
    # leaves the frame length and the unit (Seattle's s, not the ms it once said) to the user
    r = run("shards", SEATTLE, "--out", tmp_path / "x")
    assert r.exit_code == 2 and r.stderr.splitlines()[-1] == (
        f"error: {SEATTLE} holds latency matrices (one N×N RTT matrix per file); convert them "
        f"first: `prep import-matrix {SEATTLE} --out data/matrix --interval SECONDS --unit "
        "UNIT` (SECONDS: the time a frame covers; UNIT: the matrices' RTT unit, s, ms or us), "
        "then `prep shards data/matrix --out shards`")


def test_seattle_read_as_ms_warns_and_names_unit_s(tmp_path):
    # issue 36, item 3: Seattle (seconds) read with --unit ms: p50 0.220 ms and no warning
    r = imp(SEATTLE / "SeattleData_1", "--out", tmp_path / "out", "--interval", 300,
            "--unit", "ms", "--quiet", "--json")
    assert r.exit_code == 0, r.output
    p50 = json.loads(r.stdout)["rtt_p50_ms"]
    assert p50 < 1
    assert r.stderr.splitlines()[-1] == (
        f"warning: a median RTT of {p50:,.3f} ms (read as ms) is below 1 ms, unlikely for a "
        "wide-area latency matrix; if the matrices are in seconds, pass --unit s")
    r = imp(SEATTLE / "SeattleData_1", "--out", tmp_path / "out-s", "--interval", 300,
            "--unit", "s", "--quiet")
    assert r.exit_code == 0 and "warning" not in r.stderr, r.output


@pytest.mark.parametrize("p50, unit, fix", [
    (0.22, "us", "if the matrices are in milliseconds, pass --unit ms"),
    (0.0004, "s", "check the matrices' unit (--unit)"),
    (220_000.0, "ms", "if the matrices are in microseconds, pass --unit us"),
    (220_000.0, "s", "if the matrices are in milliseconds, pass --unit ms"),
    (1.0, "ms", None), (5_000.0, "s", None),
])
def test_unit_warning_names_the_unit_that_fits(p50, unit, fix):
    from prep.ingest.matrix import unit_warning

    got = unit_warning(p50, unit)
    assert (got is None) if fix is None else got.endswith(fix), got
