"""`prep import-atlas` --source, --errors and --workers, on the real RIPE Atlas sample and on
small hand-made results; the fast (msgspec) path held to the stdlib one value for value."""

import bz2
import collections
import ipaddress
import json
import random

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from prep.cli import main
from prep.ingest import atlas, atlas_read

COUNTS = ("files", "results_read", "rows_in", "rows_written", "rejected", "per_packet", "source",
          "errors")  # the summary but its timings
MEAN_52543 = (664.750625 + 187.372292) / 2  # its duplicate reply left out


def run(*args, stderr=False):
    res = CliRunner().invoke(main, ["import-atlas", *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["rows_in"] == s["rows_written"] + sum(s["rejected"].values())
    return (s, res.stderr) if stderr else s


def counts(s):
    return {k: s[k] for k in COUNTS}


def table(folder):
    return pq.read_table(folder).to_pylist()


def at(rows, prb, ts):
    return [(r["src_addr"], r["src_addr_local"], r["dst_addr"], r["rtt"]) for r in rows
            if r["prb_id"] == prb and int(r["event_time"].timestamp()) == ts]


def private(a):
    return a is not None and ipaddress.ip_address(a).is_private


def raw_results(atlas_dir):
    out = [json.loads(x) for x in bz2.decompress(
        (atlas_dir / "dump" / "ping-sample.jsonl.bz2").read_bytes()).splitlines()]
    for p in sorted((atlas_dir / "api").glob("*.json")):
        out += json.loads(p.read_bytes())
    return out


def only_errors(r):
    return bool(r["result"]) and all("error" in p for p in r["result"])


# --- the real sample ------------------------------------------------------------------

def test_public_source_is_the_default_on_the_real_sample(atlas_dir, tmp_path):
    s = run(atlas_dir / "api", atlas_dir / "dump", "--out", tmp_path / "o")
    assert counts(s) == {"files": 37, "results_read": 7725, "rows_in": 7725, "rows_written": 7592,
                         "rejected": {"local_error": 133}, "per_packet": False,
                         "source": "public", "errors": "skip"}
    rows = table(tmp_path / "o")
    # prb 52543 at 1635001080: "from": "81.217.68.120", "src_addr": "10.0.27.2",
    # result [{"x": "*"}, {"dup": 1, "rtt": 1379.331251}, {"rtt": 664.750625}, {"rtt": 187.372292}]
    assert at(rows, 52543, 1635001080) == [("81.217.68.120", "10.0.27.2", "193.0.14.129", MEAN_52543)]
    # Every row's source is its result's "from"; the 10 results without one keep src_addr.
    want = collections.Counter((r["prb_id"], r["timestamp"], r.get("from") or r["src_addr"],
                                r["src_addr"]) for r in raw_results(atlas_dir) if not only_errors(r))
    got = collections.Counter((r["prb_id"], int(r["event_time"].timestamp()), r["src_addr"],
                               r["src_addr_local"]) for r in rows)
    assert got == want
    # 83 % of the local addresses are private; of the sources, only those 10
    assert sum(private(r["src_addr_local"]) for r in rows) == 6288
    assert sum(private(r["src_addr"]) for r in rows) == 10


def test_source_local_errors_failed_is_the_behaviour_before(atlas_dir, tmp_path):
    s = run(atlas_dir / "api", atlas_dir / "dump", "--out", tmp_path / "o", "--source", "local",
            "--errors", "failed")
    assert (s["results_read"], s["rows_in"], s["rows_written"]) == (7725, 7725, 7724)
    assert s["rejected"] == {"empty_src_addr": 1}  # dump line 3141: "src_addr": ""
    rows = table(tmp_path / "o")
    assert at(rows, 52543, 1635001080) == [("10.0.27.2", "10.0.27.2", "193.0.14.129", MEAN_52543)]
    assert at(rows, 21580, 1634960815) == [("192.168.251.197", "192.168.251.197", "193.0.14.129", -1.0)]
    assert all(r["src_addr"] == r["src_addr_local"] for r in rows)
    assert sum(r["rtt"] == -1 for r in rows) == 653


def test_local_errors_are_counted_apart_from_timeouts(atlas_dir, tmp_path):
    # prb 21580 at 1634960815: "result": [{"error": "connect failed: Network is unreachable"}]
    s = run(atlas_dir / "dump", "--out", tmp_path / "skip")
    assert (s["rows_in"], s["rows_written"], s["rejected"]) == (4633, 4500, {"local_error": 133})
    rows = table(tmp_path / "skip")
    assert at(rows, 21580, 1634960815) == []
    # timeouts only: 621 results with no reply, less the 133 local errors
    assert sum(r["rtt"] == -1 for r in rows) == 488

    s = run(atlas_dir / "dump", "--out", tmp_path / "failed", "--errors", "failed")
    assert (s["rows_in"], s["rows_written"], s["rejected"]) == (4633, 4633, {})
    rows = table(tmp_path / "failed")
    assert at(rows, 21580, 1634960815) == [("95.94.93.91", "192.168.251.197", "193.0.14.129", -1.0)]
    assert sum(r["rtt"] == -1 for r in rows) == 488 + 133

    for errors in ("skip", "failed"):  # per packet: each error entry is a packet_error
        s = run(atlas_dir / "dump", "--out", tmp_path / f"p{errors}", "--per-packet", "--errors", errors)
        assert s["rejected"] == {"duplicate_reply": 7, "packet_error": 133}


def test_shards_read_the_public_source(atlas_dir, tmp_path):
    run(atlas_dir / "api", atlas_dir / "dump", "--out", tmp_path / "pq")
    srcs = collections.Counter(r["src_addr"] for r in table(tmp_path / "pq"))
    # in this process, as run() above (three `prep` processes took 4 s more to start)
    p = CliRunner().invoke(main, ["shards", str(tmp_path / "pq"), "--out", str(tmp_path / "shards"),
                                  "--workers", "1", "--json", "--quiet"])
    assert p.exit_code == 0, p.output[-2000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert (s["measurements_in"], s["measurements_tokenized"]) == (7592, 7592)
    p = CliRunner().invoke(main, ["verify", str(tmp_path / "shards"), "--workers", "1"])
    assert p.exit_code == 0, p.output[-2000:]
    p = CliRunner().invoke(main, ["inspect", str(tmp_path / "shards"), "--json"])
    assert p.exit_code == 0, p.output[-2000:]
    decoded = collections.Counter(m["src"] for line in p.stdout.splitlines()
                                  for seg in json.loads(line)["segments"] for m in seg)
    assert decoded == srcs
    # probe 52543's one result comes back from its public address, not its local one
    assert decoded["81.217.68.120"] == 1 and decoded["10.0.27.2"] == 0


# --- --workers ------------------------------------------------------------------------

def test_workers_do_not_change_the_output(atlas_dir, tmp_path):
    for inputs in ([atlas_dir / "api", atlas_dir / "dump"],  # 37 files on 2 processes
                   [atlas_dir / "dump"]):  # one .bz2 on 2 decompression threads
        outs = {}
        for w in (1, 2):
            s = run(*inputs, "--out", tmp_path / f"{len(inputs)}-{w}", "--workers", w)
            outs[w] = (counts(s), {p.name: p.read_bytes()
                                   for p in sorted((tmp_path / f"{len(inputs)}-{w}").iterdir())})
        assert outs[1] == outs[2]
        assert len(outs[1][1]) == (37 if len(inputs) == 2 else 1)


def test_malformed_lines_are_logged_in_file_order_whatever_the_workers(tmp_path):
    good = json.dumps(result(1))
    for i in range(3):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"f{i}.jsonl").write_text("\n".join([good, "{bad"] * (8 + i)) + "\n")
    logs = {}
    for w in (1, 2):
        s, err = run(tmp_path / "in", "--out", tmp_path / f"o{w}", "--workers", w, stderr=True)
        assert s["rejected"] == {"malformed_json": 27} and s["rows_written"] == 27
        logs[w] = err.splitlines()[:-1]  # the last line has the timings
    assert logs[1] == logs[2]
    assert logs[1][0] == f"{tmp_path / 'in' / 'f0.jsonl'}:2: malformed JSON (Expecting property " \
                         "name enclosed in double quotes), rejected"
    assert logs[1][8].startswith(f"{tmp_path / 'in' / 'f1.jsonl'}:2: ")
    assert logs[1][20:] == ["... and 7 more malformed JSON lines"]


# --- hand-made results ----------------------------------------------------------------

T0 = 1_700_000_000


def result(prb, **kv):
    r = {"type": "ping", "prb_id": prb, "timestamp": T0 + prb, "af": 4, "src_addr": "10.0.0.1",
         "from": "81.0.0.1", "dst_addr": "1.1.1.1", "result": [{"rtt": 2.0}], "msm_id": 5, "size": 48}
    return {k: v for k, v in {**r, **kv}.items() if v is not DROP}


DROP = object()
SOURCES = [
    result(1),                                                  # from
    result(2, **{"from": "2a02::1"}),                           # v6 from, v4 measurement: src_addr
    result(3, **{"from": "2a02::1", "src_addr": "2a02::2"}),    # neither matches: family_mismatch
    result(4, af=6, dst_addr="2001:db8::1", src_addr="2a02::2"),  # v4 from, v6 measurement: src_addr
    result(5, **{"from": ""}),                                  # empty: src_addr
    result(6, **{"from": DROP}),                                # absent: src_addr
    result(7, **{"from": None}),                                # null: src_addr
    result(8, **{"from": 12345}),                               # not text: src_addr
    result(9, src_addr=DROP),                                   # no src_addr: from, local null
    result(10, src_addr=DROP, **{"from": DROP}),                # neither: empty_src_addr
    result(11, src_addr="", **{"from": ""}),                    # neither: empty_src_addr
]


@pytest.mark.parametrize("fast", [True, False])
def test_source_choice_and_family_fallback(tmp_path, monkeypatch, fast):
    monkeypatch.setattr(atlas, "_FAST", fast)
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in SOURCES) + "\n")
    got = {}
    for source in ("public", "local"):
        s = run(tmp_path / "a.jsonl", "--out", tmp_path / source, "--source", source)
        got[source] = (s["rejected"], [(r["prb_id"], r["src_addr"], r["src_addr_local"], r["ip_version"])
                                       for r in table(tmp_path / source)])
    assert got["public"] == ({"family_mismatch": 1, "empty_src_addr": 2}, [
        (1, "81.0.0.1", "10.0.0.1", 4), (2, "10.0.0.1", "10.0.0.1", 4), (4, "2a02::2", "2a02::2", 6),
        (5, "10.0.0.1", "10.0.0.1", 4), (6, "10.0.0.1", "10.0.0.1", 4), (7, "10.0.0.1", "10.0.0.1", 4),
        (8, "10.0.0.1", "10.0.0.1", 4), (9, "81.0.0.1", None, 4)])
    assert got["local"] == ({"family_mismatch": 1, "empty_src_addr": 2}, [
        (1, "10.0.0.1", "10.0.0.1", 4), (2, "10.0.0.1", "10.0.0.1", 4), (4, "2a02::2", "2a02::2", 6),
        (5, "10.0.0.1", "10.0.0.1", 4), (6, "10.0.0.1", "10.0.0.1", 4), (7, "10.0.0.1", "10.0.0.1", 4),
        (8, "10.0.0.1", "10.0.0.1", 4), (9, "81.0.0.1", None, 4)])


PACKETS = [
    [{"error": "connect failed: Network is unreachable"}],   # 1 local error
    [{"error": "a"}, {"error": "b"}],                          # 2 local error
    [{"error": "a"}, 7],                                       # 3 local error (7 is no packet)
    [{"error": "a"}, {"x": "*"}],                              # 4 a timeout besides: -1
    [{"error": "a"}, {"rtt": 5.0}],                            # 5 a reply: 5.0
    [{"error": "a"}, {"rtt": 9.0, "dup": 1}],                  # 6 a duplicate came back: -1
    [{"x": "*"}, {"x": "*"}],                                  # 7 timeouts: -1
    [],                                                        # 8 no packets: -1
    [{"error": "a", "rtt": 3.0}],                              # 9 a reply with an error: 3.0
]


@pytest.mark.parametrize("fast", [True, False])
def test_local_error_rule(tmp_path, monkeypatch, fast):
    monkeypatch.setattr(atlas, "_FAST", fast)
    items = [result(i + 1, result=pk) for i, pk in enumerate(PACKETS)]
    items.append(result(10, result=DROP, avg=-1))  # firmware 0: nothing received
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in items) + "\n")
    s = run(tmp_path / "a.jsonl", "--out", tmp_path / "skip")
    assert s["rejected"] == {"local_error": 3}
    assert [(r["prb_id"], r["rtt"]) for r in table(tmp_path / "skip")] == [
        (4, -1.0), (5, 5.0), (6, -1.0), (7, -1.0), (8, -1.0), (9, 3.0), (10, -1.0)]
    s = run(tmp_path / "a.jsonl", "--out", tmp_path / "failed", "--errors", "failed")
    assert s["rejected"] == {}
    assert [(r["prb_id"], r["rtt"]) for r in table(tmp_path / "failed")] == [
        (1, -1.0), (2, -1.0), (3, -1.0), (4, -1.0), (5, 5.0), (6, -1.0), (7, -1.0), (8, -1.0),
        (9, 3.0), (10, -1.0)]
    s = run(tmp_path / "a.jsonl", "--out", tmp_path / "pp", "--per-packet")
    assert s["rejected"] == {"packet_error": 8, "bad_result": 1, "duplicate_reply": 1, "no_packets": 1}
    assert [(r["prb_id"], r["rtt"]) for r in table(tmp_path / "pp")] == [
        (4, -1.0), (5, 5.0), (7, -1.0), (7, -1.0), (10, -1.0)]


# --- the fast path is the stdlib path, faster ------------------------------------------

def mutated(rng, base):
    """Real results with fields dropped or replaced by values of other types."""
    odd = [None, True, 0, -1, 1.5, "12", "1.5e3", "", "x", 2**64, 2**70, 10**400, [], {},
           "2001:db8::1", "1.2.3.4", 1e308]
    packets = [{"rtt": 1.0}, {"rtt": 2}, {"x": "*"}, {"error": "e"}, {"rtt": 3.0, "dup": 1},
               {"rtt": None}, {"rtt": "4"}, {"rtt": 5.0, "error": "e"}, 5, {"dup": 1},
               {"rtt": True}, {"rtt": 2**70}, {}, {"rtt": 1, "dup": True}]
    fields = ["timestamp", "prb_id", "dst_addr", "addr", "af", "result", "type", "src_addr", "from",
              "msm_id", "size", "avg"]
    lines = []
    for _ in range(600):
        r = dict(rng.choice(base))
        for _ in range(rng.choice([0, 0, 1, 2])):
            k = rng.choice(fields)
            if rng.random() < 0.3:
                r.pop(k, None)
            elif k == "result":
                r[k] = [rng.choice(packets) for _ in range(rng.randrange(4))]
            else:
                r[k] = rng.choice(odd)
        x = rng.random()
        lines.append(json.dumps(r) if x < 0.9 else "" if x < 0.92 else json.dumps(r)[:-3]
                     if x < 0.95 else json.dumps([r, rng.choice(base)]))
    return "\n".join(lines) + "\n"


def test_fast_and_stdlib_paths_write_the_same_bytes(atlas_dir, tmp_path, monkeypatch):
    rng = random.Random(7)
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "m.jsonl").write_text(mutated(rng, raw_results(atlas_dir)[::7]))
    for extra in ([], ["--per-packet"], ["--source", "local", "--errors", "failed"]):
        outs = []
        for fast in (True, False):
            monkeypatch.setattr(atlas, "_FAST", fast)
            out = tmp_path / f"{fast}{len(extra)}"
            s = run(atlas_dir / "api", atlas_dir / "dump", tmp_path / "odd", "--out", out, *extra)
            outs.append((counts(s), {p.name: p.read_bytes() for p in sorted(out.iterdir())}))
        assert outs[0] == outs[1]
        assert outs[0][0]["rows_written"] > 7000


def odd_arrays(rng, base):
    """Arrays longer than WHOLE_LINE chunks (they stream): one line, pretty-printed, strings
    with brackets, commas and escaped quotes, commas in a row, a value that is not UTF-8."""
    def el():
        r = dict(rng.choice(base))
        if rng.random() < 0.2:
            r["note"] = rng.choice(['a,b]}{[', 'q"uo\\"te', "\\", 'x\\"]', "é,]"])
        return json.dumps(r, ensure_ascii=rng.random() < 0.5)
    one = "[" + ",".join(el() for _ in range(60)) + "]"
    pretty = json.dumps([json.loads(el()) for _ in range(30)], indent=2)
    odd = "[" + ",, ".join(el() for _ in range(30)) + ",]" + el()
    bad = ("[" + ",".join(el() for _ in range(20)) + ',{"prb_id": 1, "n": "@@"},'
           + ",".join(el() for _ in range(20)) + "]").encode().replace(b'"@@"', b'"\xff"')
    return {"one.json": one.encode(), "pretty.json": pretty.encode(), "odd.json": odd.encode(),
            "bad.json": bad}


def test_streamed_arrays_fast_and_stdlib_agree(atlas_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(atlas_read, "CHUNK", 256)  # arrays over 8 KiB on a line stream
    rng = random.Random(11)
    files = odd_arrays(rng, raw_results(atlas_dir)[::5])
    for name, data in files.items():
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_bytes(data)
    (tmp_path / "cut.json").write_bytes(files["one.json"][:-3000])  # truncated mid-array
    outs = []
    for fast in (True, False):
        monkeypatch.setattr(atlas, "_FAST", fast)
        s, err = run(tmp_path / "in", "--out", tmp_path / f"o{fast}", stderr=True)
        res = CliRunner().invoke(main, ["import-atlas", str(tmp_path / "cut.json"), "--out",
                                        str(tmp_path / f"c{fast}")])
        outs.append((counts(s), err.splitlines()[:-1], res.exit_code, res.stderr,
                     {p.name: p.read_bytes() for p in sorted((tmp_path / f"o{fast}").iterdir())}))
    assert outs[0] == outs[1]
    s, log, code, cut_err, _ = outs[0]
    assert s["results_read"] == 60 + 30 + 31 + 41 and s["rejected"]["malformed_json"] == 1
    assert log == [f"{tmp_path / 'in' / 'bad.json'}:1: malformed JSON (result 21 of an array is "
                   "not UTF-8 text), rejected"]
    assert code == 2 and cut_err == (f"error: {tmp_path / 'cut.json'}: malformed or truncated JSON "
                                     "array after 53 results; download the file again\n")


def test_small_reads_on_the_fast_path_write_what_the_stdlib_does(atlas_dir, tmp_path, monkeypatch):
    """Reads of 1,500 bytes: blocks of a line or three straight from the reused buffer, reads
    with no newline (an array of two results on a line) and blocks the fast path leaves (a
    blank line, a cut line, bytes that are not UTF-8) all come back as the stdlib reads them."""
    rng = random.Random(5)
    text = mutated(rng, raw_results(atlas_dir)[::9]).encode()
    (tmp_path / "m.jsonl").write_bytes(text.replace(b'"ICMP"', b'"IC\xffP"', 3))
    (tmp_path / "m.jsonl.bz2").write_bytes(bz2.compress(text))
    outs = []
    for fast, chunk in ((True, 1500), (False, 1 << 20)):
        monkeypatch.setattr(atlas, "_FAST", fast)
        monkeypatch.setattr(atlas_read, "CHUNK", chunk)
        out = tmp_path / f"o{fast}"
        s = run(tmp_path / "m.jsonl", tmp_path / "m.jsonl.bz2", "--out", out)
        outs.append((counts(s), {p.name: p.read_bytes() for p in sorted(out.iterdir())}))
    assert outs[0] == outs[1]
    # 623 values a file, 15 of them cut lines; 3 more not UTF-8 in the one file
    assert outs[0][0]["results_read"] == 2 * 623 and outs[0][0]["rejected"]["malformed_json"] == 2 * 15 + 3


def test_rows_converted_to_arrow_in_parts_write_the_same_bytes(atlas_dir, tmp_path, monkeypatch):
    """Rows flushed to Arrow every 30 (fast and stdlib rows mixed) or a block's run at a time,
    taken in batches of 100 across those parts: the bytes of rows kept as lists until each batch."""
    rng = random.Random(3)
    clean = "".join(json.dumps(r) + "\n" for r in raw_results(atlas_dir)[:1000])  # runs of tables
    (tmp_path / "m.jsonl").write_text(mutated(rng, raw_results(atlas_dir)) + clean)
    monkeypatch.setattr(atlas, "BATCH", 100)
    outs = []
    for flush in (30, 10**9):
        monkeypatch.setattr(atlas, "FLUSH", flush)
        out = tmp_path / f"o{flush}"
        s = run(tmp_path / "m.jsonl", "--out", out, "--workers", "1")
        outs.append((counts(s), (out / "m.parquet").read_bytes()))
    assert outs[0] == outs[1]
    assert outs[0][0]["rows_in"] == 1000 + 613
    # 1,548 rows reach validation (12 + 53 values the importer rejects): 16 row groups
    assert pq.ParquetFile(tmp_path / "o30" / "m.parquet").num_row_groups == 16


def test_fast_struct_fields_in_ripe_key_order(atlas_dir):
    # msgspec looks a key up from the field after the last one found: in the dumps' key
    # order each known key is one compare. Pinned on the sample's first dump line.
    from prep.ingest.atlas_json import _Result, decode_result
    line = bz2.decompress((atlas_dir / "dump" / "ping-sample.jsonl.bz2").read_bytes()).split(b"\n")[0]
    keys = list(json.loads(line))
    names = [_Result.__struct_encode_fields__[i] for i in range(len(_Result.__struct_fields__))]
    assert names == sorted(names, key=keys.index)
    r = decode_result(line)
    assert (r.af, r.dst_addr, r.src_addr, r.size, r.msm_id, r.prb_id, r.timestamp, r.from_, r.type) == (
        4, "193.0.14.129", "192.168.88.253", 20, 1001, 599, 1635001011, "37.60.157.131", "ping")
    assert [(p.rtt, p.dup) for p in r.result] == [(15.631107, 0), (15.43066, 0), (29.058054, 0)]
