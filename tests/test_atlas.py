import bz2
import gzip
import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.ingest import atlas_read


def run(*args):
    return CliRunner().invoke(main, ["import-atlas", *map(str, args)])


def read_rows(folder):
    t = pq.read_table(folder)
    return [tuple(r.values()) for r in t.to_pylist()]


def rows_by(folder, prb, ts):
    t = pq.read_table(folder).to_pylist()
    return [(r["src_addr"], r["dst_addr"], r["ip_version"], r["rtt"], r["msm_id"], r["size"])
            for r in t if r["prb_id"] == prb and int(r["event_time"].timestamp()) == ts]


def test_real_sample_every_result_accounted(atlas_dir, tmp_path):
    # Defaults --source public --errors skip (the behaviour before them, --source local
    # --errors failed, is pinned in tests/test_atlas_source.py).
    res = run(atlas_dir / "api", atlas_dir / "dump", "--out", tmp_path / "x", "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert (s["results_read"], s["rows_in"], s["rows_written"]) == (7725, 7725, 7592)
    # 133 results whose one packet is {"error": ...}; one of them (dump line 3141) has
    # "src_addr": "" (empty_src_addr before --source public)
    assert s["rejected"] == {"local_error": 133}
    assert s["files"] == 37 and len(list((tmp_path / "x").glob("*.parquet"))) == 37
    out = tmp_path / "x"
    # Duplicate reply left out of the mean: (664.750625 + 187.372292) / 2. The source is
    # the probe's public address ("from"); its local one was 10.0.27.2.
    assert rows_by(out / "ping-sample.parquet", 52543, 1635001080) == [
        ("81.217.68.120", "193.0.14.129", 4, (664.750625 + 187.372292) / 2, 1001, 32)]
    assert rows_by(out / "3359986_results.parquet", 3183, 1453256556) == [
        ("212.122.42.107", "193.170.114.242", 4, (34.506247 + 34.261254 + 34.22132) / 3, 3359986, 48)]
    assert rows_by(out / "RIPE-Atlas-measurement-47848471.parquet", 1001040, 1671120843) == [
        ("98.97.113.188", "3.105.132.193", 4, (179.801394 + 184.984237 + 164.792343) / 3, 47848471, 48)]
    # An error packet only: nothing was sent, so no row (local_error), not a failed ping.
    assert rows_by(out / "ping-sample.parquet", 21580, 1634960815) == []
    t = pq.read_table(out)
    assert sum(r == -1 for r in t.column("rtt").to_pylist()) == 521  # 653 less the 132 kept before

    res = run(atlas_dir / "api", atlas_dir / "dump", "--out", tmp_path / "p", "--per-packet", "--json")
    s = json.loads(res.stdout)
    assert (s["results_read"], s["rows_in"], s["rows_written"]) == (7725, 22868, 22727)
    assert s["rejected"] == {"duplicate_reply": 8, "packet_error": 133}
    assert sorted(rows_by(tmp_path / "p" / "ping-sample.parquet", 52543, 1635001080)) == [
        ("81.217.68.120", "193.0.14.129", 4, -1.0, 1001, 32),
        ("81.217.68.120", "193.0.14.129", 4, 187.372292, 1001, 32),
        ("81.217.68.120", "193.0.14.129", 4, 664.750625, 1001, 32)]


VARIANTS = [
    # firmware 0: numbers as strings, no result list, addr instead of dst_addr, no af/src_addr
    {"prb_id": "12", "timestamp": "1300000000", "addr": "193.0.14.129", "from": "81.1.2.3",
     "avg": "58.042", "msm_id": "1001", "size": "48", "type": "ping"},
    # firmware 1: addr/name, every packet lost
    {"prb_id": 13, "timestamp": 1300000001, "addr": "2001:7fd::1", "name": "k.root",
     "from": "2a02::5", "result": [{"x": "*"}, {"x": "*"}], "msm_id": 2001, "size": 48},
    "[1, 2]",  # a top-level array stands for its elements: two values that are not results
    {"type": "traceroute", "prb_id": 1},
    {"prb_id": 14, "timestamp": 1300000002, "dst_addr": "1.1.1.1", "src_addr": "10.0.0.1",
     "af": 6, "result": [{"rtt": 1.0}], "msm_id": 5, "size": 48},
    {"prb_id": 15, "timestamp": 1300000003, "dst_addr": "1.1.1.1", "src_addr": "10.0.0.1",
     "result": [{"error": "connect failed"}, {"rtt": "2.5"}], "msm_id": 5, "size": 48},
]


def write_lines(path, items, garbage_at=None):
    lines = [x if isinstance(x, str) else json.dumps(x) for x in items]
    if garbage_at is not None:
        lines.insert(garbage_at, '{"prb_id": 1, "timestamp": ')
    path.write_text("\n".join(lines) + "\n")


def test_firmware_variants_and_malformed_lines(tmp_path):
    src = tmp_path / "old.jsonl"
    write_lines(src, VARIANTS, garbage_at=3)
    res = run(src, "--out", tmp_path / "o", "--json")
    assert res.exit_code == 0, res.output
    assert f"{src}:4: malformed JSON" in res.stderr
    s = json.loads(res.stdout)
    assert (s["results_read"], s["rows_written"]) == (8, 3)
    assert s["rejected"] == {"malformed_json": 1, "not_a_result": 2, "not_ping": 1,
                             "family_mismatch": 1}
    # the last column, src_addr_local, is the result's own src_addr (none before fw 4460)
    assert [r[1:] for r in read_rows(tmp_path / "o")] == [
        (12, "81.1.2.3", "193.0.14.129", 4, 58.042, 1001, 48, None),
        (13, "2a02::5", "2001:7fd::1", 6, -1.0, 2001, 48, None),
        (15, "10.0.0.1", "1.1.1.1", 4, 2.5, 5, 48, "10.0.0.1")]
    assert [int(t.timestamp()) for t in pq.read_table(tmp_path / "o").column("event_time").to_pylist()] == [
        1300000000, 1300000001, 1300000003]

    res = run(src, "--out", tmp_path / "pp", "--per-packet", "--json")
    s = json.loads(res.stdout)
    assert (s["results_read"], s["rows_in"], s["rows_written"]) == (8, 10, 4)
    assert s["rejected"] == {"malformed_json": 1, "not_a_result": 2, "not_ping": 1,
                             "family_mismatch": 1, "packet_error": 1}

    res = run(src, "--out", tmp_path / "s", "--strict")
    assert res.exit_code == 2
    assert res.stderr == f"error: {src}:4: malformed JSON line (Expecting value); " \
                         "fix or drop the line, or run without --strict\n"
    assert not list((tmp_path / "s").glob("**/*.parquet"))


def test_json_array_streams_across_reads_and_bz2(tmp_path, monkeypatch):
    monkeypatch.setattr(atlas_read, "CHUNK", 7)  # every object spans several reads
    items = [VARIANTS[0], VARIANTS[4], VARIANTS[5]]
    (tmp_path / "a.json").write_text(" \n[" + ",\n ".join(json.dumps(x) for x in items) + "]\n")
    (tmp_path / "b.jsonl.bz2").write_bytes(bz2.compress(
        ("\n".join(json.dumps(x) for x in items)).encode()))
    res = run(tmp_path / "a.json", tmp_path / "b.jsonl.bz2", "--out", tmp_path / "o", "--json")
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert (s["results_read"], s["rows_written"], s["rejected"]) == (6, 4, {"family_mismatch": 2})
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["a.parquet", "b.parquet"]
    assert pq.read_table(tmp_path / "o" / "a.parquet").column("rtt").to_pylist() == [58.042, 2.5]


@pytest.mark.parametrize("name,content,problem", [
    ("t.json", b'[{"prb_id": 1}, {"prb_id"', "malformed or truncated JSON array after 1 results"),
    ("u.json", b'[{"prb_id": 1}, ', "truncated JSON array (no closing ']' after 1 results)"),
    ("v.jsonl.bz2", bz2.compress(b'{"prb_id": 1}\n' * 50)[:-10], "unreadable or truncated"),
    # a flipped bit in the deflate stream: zlib.error, which was a traceback
    ("w.jsonl.gz", (lambda b: b[:20] + bytes([b[20] ^ 0xFF]) + b[21:])(
        gzip.compress(b'{"prb_id": 1}\n' * 500, mtime=0)), "unreadable or truncated"),
])
def test_bad_files_are_one_line_exit_2_nothing_written(tmp_path, name, content, problem):
    good = tmp_path / "a.jsonl"
    write_lines(good, [VARIANTS[5]])
    (tmp_path / name).write_bytes(content)
    res = run(good, tmp_path / name, "--out", tmp_path / "o")
    assert res.exit_code == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / name}: {problem}")
    assert not (tmp_path / "o").exists()  # not even the good file's output, nor the folder


def test_missing_path(tmp_path):
    res = run(tmp_path / "nope.json", "--out", tmp_path / "o")
    assert res.exit_code == 2
    assert res.stderr == f"error: {tmp_path / 'nope.json'}: no such file or folder; check the path\n"
