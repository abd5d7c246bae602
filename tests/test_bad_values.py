"""Bad values and odd files from a fault-injection trial: each is read in full and counted,
rejected under a named reason, or refused in one line (exit 2) - never changed silently,
never a traceback, never a crash.

Rows in = rows written + sum(rejected) everywhere; the tests assert the exact counts.
"""

import bz2
import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from prep.base.errors import InputError
from prep.cli import main
from prep.ingest import atlas_read
from prep.schema import validate
from prep.tokens.reference import rtt_code

T0 = 1_700_000_000
PREP = [sys.executable, "-c", "from prep.cli import main; main()"]


def result(prb, **kv):
    r = {"type": "ping", "prb_id": prb, "timestamp": T0 + prb, "af": 4, "src_addr": "10.0.0.1",
         "dst_addr": "1.1.1.1", "result": [{"rtt": 2.0}], "msm_id": 5, "size": 48}
    return {**r, **kv}


def j(*items):
    return ",".join(json.dumps(x) for x in items)


def atlas_run(*args):
    res = CliRunner().invoke(main, ["import-atlas", *map(str, args), "--json"])
    return res, (json.loads(res.stdout) if res.exit_code == 0 else None)


def counts(s):
    return s["results_read"], s["rows_in"], s["rows_written"], s["rejected"]


def prb_ids(folder):
    return pq.read_table(folder).column("prb_id").to_pylist()


def parquet(path, rows, **types):
    """rows of (event_time, prb_id, src_addr, dst_addr, ip_version, rtt)."""
    names = ["event_time", "prb_id", "src_addr", "dst_addr", "ip_version", "rtt"]
    typ = {"event_time": pa.int64(), "prb_id": pa.int64(), "src_addr": pa.string(),
           "dst_addr": pa.string(), "ip_version": pa.int8(), "rtt": pa.float64(), **types}
    cols = list(zip(*rows))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({n: pa.array(c, typ[n]) for n, c in zip(names, cols)}), path)
    return path


# --- 6: import-atlas reads every value, and a bad line is one rejected row ------------------

CONCATENATED = {
    # two arrays back to back, then an array and an object on one line, then JSON lines
    "cat.json": f"[{j(result(1), result(2))}][{j(result(3))}]\n[{j(result(4))}]{j(result(5))}\n"
                f"{j(result(6))}\n{j(result(7))}\n",
    # a pretty-printed (multi-line) array, an array on a line, then lines
    "pretty.json": "[\n  " + ",\n  ".join(json.dumps(result(i)) for i in (1, 2, 3)) + "\n]\n"
                   f"[{j(result(4), result(5))}]\n{j(result(6))}\n{j(result(7))}",
}


@pytest.mark.parametrize("chunk", [1 << 20, 7])  # 7: every value spans several reads
@pytest.mark.parametrize("name", sorted(CONCATENATED))
def test_concatenated_arrays_and_array_then_lines_read_in_full(tmp_path, monkeypatch, chunk, name):
    monkeypatch.setattr(atlas_read, "CHUNK", chunk)
    (tmp_path / name).write_text(CONCATENATED[name])
    res, s = atlas_run(tmp_path / name, "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert counts(s) == (7, 7, 7, {})
    assert prb_ids(tmp_path / "o") == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("chunk", [1 << 20, 5])
def test_byte_order_mark_is_accepted(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(atlas_read, "CHUNK", chunk)
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.json").write_bytes(bom + f"[{j(result(1), result(2))}]".encode())
    (tmp_path / "b.json").write_bytes(bom + b"[\n" + j(result(3)).encode() + b"\n]\n")
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(bom + f"{j(result(4))}\n{j(result(5))}\n".encode()))
    res, s = atlas_run(tmp_path, "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert counts(s) == (5, 5, 5, {})
    assert sorted(prb_ids(tmp_path / "o")) == [1, 2, 3, 4, 5]


def only_the_bad_value_rejected(src, tmp_path) -> str:
    """Import ``src``, results 1 and 2 around one bad value: that value is the one rejected
    row. Returns the first line on stderr."""
    res, s = atlas_run(src, "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert counts(s) == (3, 3, 2, {"malformed_json": 1})
    assert prb_ids(tmp_path / "o") == [1, 2]
    return res.stderr.splitlines()[0]


def test_a_non_utf8_line_is_one_rejected_row(tmp_path):
    src = tmp_path / "d.jsonl.bz2"
    bad = b'{"prb_id": 9, "note": "\xff"}'
    src.write_bytes(bz2.compress(b"\n".join([j(result(1)).encode(), bad, j(result(2)).encode(), b""])))
    assert only_the_bad_value_rejected(src, tmp_path) == \
        f"{src}:2: malformed JSON (not UTF-8: invalid start byte 0xff at column 24), rejected"

    res = CliRunner().invoke(main, ["import-atlas", str(src), "--out", str(tmp_path / "s"), "--strict"])
    assert res.exit_code == 2
    assert res.stderr == (f"error: {src}:2: malformed JSON line (not UTF-8: invalid start byte "
                          "0xff at column 24); fix or drop the line, or run without --strict\n")


@pytest.mark.parametrize("chunk", [1 << 20, 6])
def test_a_non_utf8_array_element_is_one_rejected_row(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(atlas_read, "CHUNK", chunk)
    src = tmp_path / "a.json"
    src.write_bytes(b"[" + j(result(1)).encode() + b',\n{"prb_id": 9, "note": "\xfe\xff"},'
                    + j(result(2)).encode() + b"]")
    assert only_the_bad_value_rejected(src, tmp_path) == \
        f"{src}:2: malformed JSON (result 2 of an array is not UTF-8 text), rejected"


def test_null_is_a_value_not_a_malformed_line(tmp_path):
    (tmp_path / "n.jsonl").write_text(f"null\n{j(result(1))}\n")
    res, s = atlas_run(tmp_path / "n.jsonl", "--out", tmp_path / "o")
    assert counts(s) == (2, 2, 1, {"not_a_result": 1})


# --- 7 and 8: out-of-range values are rejected by name, never stored changed ---------------

def test_rtt_ceiling_is_the_encodings():
    assert validate.RTT_MAX_MS == 2047 * 2**31 / 1000
    assert rtt_code(validate.RTT_MAX_MS) == (31, 2047)  # the largest code there is
    assert rtt_code(1e12) == (31, 2047)  # what 1e12 ms was stored as: ~4.4e9 ms


def test_readme_states_the_codes_rtt_ceiling_exactly():
    """The README's ceiling is the code's, to the µs: 2047 × 2^31 µs = 4,395,899,027.456 ms
    (it said 4,396,972,769 ms, half a mantissa step more, which `prep` rejects)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    stated = re.findall(r"(\d,\d{3},\d{3},\d{3}(?:\.\d+)?) ms", readme)  # billions of ms
    assert stated and {float(x.replace(",", "")) for x in stated} == {validate.RTT_MAX_MS}
    assert f"{validate.RTT_MAX_MS:,.3f}" == "4,395,899,027.456" in stated


def test_out_of_range_values_are_rejected_by_name_in_parquet(tmp_path):
    ok = (T0, 1, "10.0.0.1", "1.1.1.1", 4, 5.0)
    top = math.nextafter(validate.RTT_MAX_MS, math.inf)
    rows = [
        ok,
        (T0, 1, "10.0.0.1", "1.1.1.1", 4, validate.RTT_MAX_MS),  # the ceiling itself: kept
        (T0, 1, "10.0.0.1", "1.1.1.1", 4, top),                  # rtt_out_of_range
        (T0, 1, "10.0.0.1", "1.1.1.1", 4, 1e12),                 # rtt_out_of_range
        (T0, 1, "10.0.0.1", "1.1.1.1", 4, 1.7e308),              # rtt_out_of_range
        (2**62, 1, "10.0.0.1", "1.1.1.1", 4, 5.0),               # time_out_of_range
        (2**61, 1, "10.0.0.1", "1.1.1.1", 4, 5.0),               # time_out_of_range
        (4_102_444_800, 1, "10.0.0.1", "1.1.1.1", 4, 5.0),       # time_out_of_range (2100)
        (4_102_444_799, 1, "10.0.0.1", "1.1.1.1", 4, 5.0),       # kept
        (-1, 1, "10.0.0.1", "1.1.1.1", 4, 5.0),                  # time_out_of_range (1969)
        (T0, 1, "fe80::1%eth0", "fe80::2", 6, 5.0),              # invalid_src_addr (zone id)
        (T0, 1, "fe80::1", "fe80::2%1", 6, 5.0),                 # invalid_dst_addr (zone id)
    ]
    m, rejected = validate.validate_table(pa.Table.from_pylist(
        [dict(zip(["event_time", "prb_id", "src_addr", "dst_addr", "ip_version", "rtt"], r))
         for r in rows]), source="t")
    assert rejected == {"rtt_out_of_range": 3, "time_out_of_range": 4, "invalid_src_addr": 1,
                        "invalid_dst_addr": 1}
    assert m.rtt.tolist() == [5.0, validate.RTT_MAX_MS, 5.0]
    assert m.time.tolist() == [T0, T0, 4_102_444_799]


def test_misread_times_counts_integers_in_range_as_ms_or_us():
    col = pa.array([T0, T0 * 1000, T0 * 1000 + 999, T0 * 1_000_000, 2**62, -1000, None,
                    validate.TIME_MAX * 1_000_000], pa.int64())
    assert validate.misread_times(col) == {"ms": 2, "us": 1}
    assert validate.misread_times(pa.array([T0 * 1000], pa.timestamp("s"))) == {}
    assert validate.time_unit_hint({"time_out_of_range": 5}, {"ms": 2, "us": 1}) is None
    assert validate.time_unit_hint({"time_out_of_range": 3}, {"us": 2}) == (
        "2 of the 3 time_out_of_range event_times are in range as microseconds: an integer "
        "event_time is read as Unix seconds; divide it by 1,000,000 or store a timestamp")


def test_unsigned_values_past_int64_are_rejected_not_wrapped(tmp_path):
    u64 = 2**64 - 1
    path = parquet(tmp_path / "u.parquet", [
        (T0, 7, "10.0.0.1", "1.1.1.1", 4, 5.0),
        (u64, 7, "10.0.0.1", "1.1.1.1", 4, 5.0),   # was 1969-12-31T23:59:59
        (T0, u64, "10.0.0.1", "1.1.1.1", 4, 5.0),  # was prb_id -1 (or, cast, 2**64 - 1)
        (T0, 2**63, "10.0.0.1", "1.1.1.1", 4, 5.0),
        (T0, 2**63 - 1, "10.0.0.1", "1.1.1.1", 4, 5.0),  # the largest prb_id: kept
        (T0, 7, "10.0.0.1", "1.1.1.1", u64 - 1, 5.0),  # would wrap to -2
    ], event_time=pa.uint64(), prb_id=pa.uint64(), ip_version=pa.uint64())
    m, rejected, rows_in = validate.read_validated([path])
    assert (rows_in, len(m)) == (6, 2)
    assert rejected == {"time_out_of_range": 1, "bad_prb_id": 2, "bad_ip_version": 1}
    assert m.probe.tolist() == [7, 2**63 - 1] and m.time.tolist() == [T0, T0]


def test_import_atlas_rejects_out_of_range_values_by_name(tmp_path):
    items = [
        result(1),
        result(2, result=[{"rtt": 1e12}]),                     # rtt_out_of_range (was ~4.4e9 ms)
        result(3, result=[{"rtt": 1e306}, {"rtt": 1e306}]),   # rtt_out_of_range (the sum overflows)
        result(4, avg=1e306, result=None),                     # rtt_out_of_range (firmware 0)
        result(5, timestamp=2**64 - 1),                        # time_out_of_range (was 1969)
        result(6, timestamp=2**62),                            # time_out_of_range
        result(7, timestamp=2**61),                            # time_out_of_range (was a traceback)
        result(8, timestamp=2**70),                            # time_out_of_range
        result(12, prb_id=2**70),                              # bad_prb_id (was a traceback)
        result(9, src_addr="fe80::1%eth0", dst_addr="fe80::2", af=6),  # invalid_src_addr
        result(10, msm_id=2**70, size=2**64),                  # kept; msm_id and size null
        result(11, result=[{"rtt": 10**400}]),                 # bad_rtt: beyond float, infinite
    ]
    items[3].pop("result")
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps(x) for x in items) + "\n")
    res, s = atlas_run(tmp_path / "x.jsonl", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert counts(s) == (12, 12, 2, {"rtt_out_of_range": 3, "time_out_of_range": 4,
                                     "bad_prb_id": 1, "invalid_src_addr": 1, "bad_rtt": 1})
    t = pq.read_table(tmp_path / "o").to_pylist()
    assert [(r["prb_id"], r["rtt"], r["msm_id"], r["size"]) for r in t] == [
        (1, 2.0, 5, 48), (10, 2.0, None, None)]

    res, s = atlas_run(tmp_path / "x.jsonl", "--out", tmp_path / "p", "--per-packet")
    assert counts(s) == (12, 13, 2, {"rtt_out_of_range": 4, "time_out_of_range": 4,
                                     "bad_prb_id": 1, "invalid_src_addr": 1, "bad_rtt": 1})


def test_an_address_that_is_not_text_is_invalid_not_a_traceback(tmp_path):
    lines = [json.dumps(result(1, src_addr="\ud800")),  # a lone surrogate: no UTF-8 for it
             json.dumps(result(2, dst_addr=12345)), json.dumps(result(3))]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    res, s = atlas_run(tmp_path / "a.jsonl", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert counts(s) == (3, 3, 1, {"invalid_src_addr": 1, "invalid_dst_addr": 1})


def shards(inputs, out, timeout=120):
    """`prep shards` in a subprocess: a crash is a return code, a hang a TimeoutExpired."""
    p = subprocess.run([*PREP, "shards", *map(str, inputs), "--out", str(out), "--workers", "1",
                        "--json", "--quiet"], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    return json.loads(p.stdout)


def test_huge_finite_rtt_is_rejected_before_the_tokenizer(tmp_path):
    # >= ~1.8e305 ms is inf in µs: it segfaulted `prep shards --workers 1` (hung the pool).
    parquet(tmp_path / "in" / "a.parquet", [(T0, 1, "10.0.0.1", "1.1.1.1", 4, 2e305),
                                            (T0 + 1, 1, "10.0.0.1", "1.1.1.1", 4, 1.7e308),
                                            (T0 + 2, 1, "10.0.0.1", "1.1.1.1", 4, 5.0)])
    s = shards([tmp_path / "in"], tmp_path / "shards")
    assert (s["measurements_in"], s["measurements_tokenized"]) == (3, 1)
    assert s["rejected_by_reason"] == {"rtt_out_of_range": 2}


def test_huge_finite_rtt_from_ripe_json_is_rejected_at_import(tmp_path):
    (tmp_path / "r.json").write_text(f"[{j(result(1, result=[{'rtt': 1e306}]), result(2))}]")
    res, s = atlas_run(tmp_path / "r.json", "--out", tmp_path / "in")
    assert res.exit_code == 0, res.output
    assert counts(s) == (2, 2, 1, {"rtt_out_of_range": 1})
    s = shards([tmp_path / "in"], tmp_path / "shards")
    assert (s["measurements_in"], s["measurements_tokenized"], s["rejected_by_reason"]) == (1, 1, {})


# --- 11: one line, not a traceback -------------------------------------------------------

def test_duplicate_column_names_are_one_line(tmp_path):
    t = pa.Table.from_arrays([pa.array([T0]), pa.array(["10.0.0.1"]), pa.array(["1.1.1.1"]),
                              pa.array([4]), pa.array([1.0]), pa.array([2.0])],
                             names=["event_time", "src_addr", "dst_addr", "ip_version", "rtt", "rtt"])
    (tmp_path / "in").mkdir()
    pq.write_table(t, tmp_path / "in" / "d.parquet")
    res = CliRunner().invoke(main, ["shards", str(tmp_path / "in"), "--out", str(tmp_path / "s"),
                                    "--workers", "1", "--quiet"])
    assert res.exit_code == 2, res.output
    assert res.stderr == (f"error: {tmp_path / 'in' / 'd.parquet'}: column rtt appears 2 times; "
                          "keep one (rename or drop the others) before running prep\n")
    with pytest.raises(InputError, match="column rtt appears 2 times"):
        validate.read_validated([tmp_path / "in"])


def test_deep_nesting_is_a_counted_row_or_one_line(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "a.jsonl").write_text(f'{j(result(1))}\n{{"prb_id": {deep}}}\n{j(result(2))}\n')
    res, s = atlas_run(tmp_path / "a.jsonl", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert counts(s) == (3, 3, 2, {"malformed_json": 1})
    assert res.stderr.splitlines()[0] == \
        f"{tmp_path / 'a.jsonl'}:2: malformed JSON (nested too deeply), rejected"

    (tmp_path / "b.json").write_text(deep)  # an array whose first element cannot be decoded
    res, _ = atlas_run(tmp_path / "b.json", "--out", tmp_path / "p")
    assert res.exit_code == 2
    assert res.stderr == (f"error: {tmp_path / 'b.json'}:1: result 1 of a JSON array is nested too "
                          "deeply to decode; these are not RIPE Atlas results: fix or remove the file\n")


# --- a user trial: flags refused before any work, in one line ----------------------------

@pytest.mark.parametrize("command", ["shards", "analyze-padding"])
def test_a_negative_seed_is_refused(tmp_path, command):
    # `prep shards --seed -5` ran (the seed masked to 64 bits: the bytes of seed 2**64 - 5),
    # `prep analyze-padding --seed -1` was a ValueError traceback (numpy's generator)
    out = [] if command == "analyze-padding" else ["--out", str(tmp_path / "s")]
    res = CliRunner().invoke(main, [command, str(tmp_path), *out, "--seed", "-5"])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[-1] == \
        "Error: Invalid value for '--seed': -5 is not in the range x>=0."
    assert not (tmp_path / "s").exists()


FORMS = "use zstd:N (N up to 22), brotli:N (N up to 11), snappy or uncompressed"


@pytest.mark.parametrize("value, why", [
    ("foo", f"foo: Unknown option foo; {FORMS}"),
    ("zstd:99", f"zstd:99: Option zstd: invalid value: 99; {FORMS}"),
    ("snappy,group_size:100", "snappy,group_size:100: Option group_size is present more than "
                              f"once; {FORMS}; prep sets group_size:1 itself"),
], ids=["unknown", "level", "group_size"])
def test_a_compression_arrayrecord_refuses_is_one_line_before_the_read_pass(tmp_path, value,
                                                                            why):
    # it was a _RemoteTraceback from a worker (ValueError: Unknown option foo) after the
    # whole read pass
    parquet(tmp_path / "in" / "a.parquet", [(T0, 1, "10.0.0.1", "1.1.1.1", 4, 5.0)])
    res = CliRunner().invoke(main, ["shards", str(tmp_path / "in"), "--out", str(tmp_path / "s"),
                                    "--workers", "1", "--quiet", "--compression", value])
    assert res.exit_code == 2, res.output
    assert res.stderr.splitlines()[-1] == f"Error: Invalid value for '--compression': {why}"
    assert "Traceback" not in res.output and not (tmp_path / "s").exists()


@pytest.mark.parametrize("value", ["zstd:-1", "brotli:11", "uncompressed"])
def test_a_compression_arrayrecord_takes_writes_the_shards(tmp_path, value):
    parquet(tmp_path / "in" / "a.parquet", [(T0, 1, "10.0.0.1", "1.1.1.1", 4, 5.0)])
    res = CliRunner().invoke(main, ["shards", str(tmp_path / "in"), "--out", str(tmp_path / "s"),
                                    "--workers", "1", "--quiet", "--compression", value])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["config"]["compression"] \
        == value


# --- 13: a broken link is not skipped silently -------------------------------------------

def test_dangling_symlink_is_a_warning_under_a_folder_and_an_error_named(tmp_path, capsys):
    parquet(tmp_path / "d" / "a.parquet", [(T0, 1, "10.0.0.1", "1.1.1.1", 4, 5.0)])
    os.symlink(tmp_path / "gone.parquet", tmp_path / "d" / "b.parquet")
    assert validate.list_inputs([tmp_path / "d"]) == [tmp_path / "d" / "a.parquet"]
    assert capsys.readouterr().err == (
        f"warning: {tmp_path / 'd' / 'b.parquet'}: broken symbolic link (its target "
        f"{tmp_path / 'gone.parquet'} does not exist), skipped; fix or remove the link\n")
    with pytest.raises(InputError, match=r"b\.parquet: broken symbolic link \(its target .*gone"):
        validate.list_inputs([tmp_path / "d" / "b.parquet"])

    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text(j(result(1)) + "\n")
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "j" / "b.jsonl")
    res, s = atlas_run(tmp_path / "j", "--out", tmp_path / "o")
    assert counts(s) == (1, 1, 1, {}) and s["files"] == 1
    assert res.stderr.splitlines()[0] == (
        f"warning: {tmp_path / 'j' / 'b.jsonl'}: broken symbolic link (its target "
        f"{tmp_path / 'gone.jsonl'} does not exist), skipped; fix or remove the link")
