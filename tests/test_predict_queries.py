"""`train predict --queries` on many queries (#36 item 23): answered a piece at a time under
a progress bar, each piece streamed to the answers file and to --json as it comes, the same
answers as one query at a time; SIGINT stops it with one line saying what it wrote and
leaves the old answers file; a long history costs a few encodings per query, not one per
measurement."""

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import python_c

from prep.tools import synthetic_shards as synthetic
from train.cli import main
from train.fit.config import TrainConfig
from train.fit.loop import train
from train.model import model
from train.model.arch import MODELS
from train.predict import predictor as P
from train.predict import queries as Q

pytestmark = pytest.mark.no_kernel_warmup  # synthetic shards: no prep kernel
N = 7


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("predict")
    synthetic.write_shards(d / "shards", {"train": synthetic.counting_rows(16, 128, seed=0),
                                          "test": synthetic.counting_rows(4, 128, seed=1)})
    train(TrainConfig(data=str(d / "shards"), run_dir=str(d / "run"), steps=1, batch_size=2,
                      warmup=1, log_every=1, eval_every=0, ckpt_every=0))
    q = d / "q.parquet"
    pq.write_table(pa.table({"src_addr": [f"192.0.2.{i}" for i in range(N)],
                             "dst_addr": ["193.0.14.129"] * N,
                             "event_time": [1767272400 + i for i in range(N)]}), q)
    h = d / "h.parquet"
    pq.write_table(pa.table({"event_time": [1767268800 + 60 * i for i in range(20)],
                             "src_addr": ["192.0.2.1"] * 20, "dst_addr": ["193.0.14.129"] * 20,
                             "ip_version": [4] * 20, "rtt": [20.0 + i for i in range(20)]}), h)
    return d


def test_queries_are_answered_and_streamed_in_pieces(run, tmp_path, monkeypatch):
    monkeypatch.setattr(Q, "PIECE", 3)
    bars = []

    class Bar(Q.tqdm):  # the bar shows on a terminal only; here, what it was told
        def __init__(self, **kw):
            super().__init__(**kw)
            bars.append([kw["total"], kw["unit"]])

        def update(self, n=1):
            bars[-1].append(n)
            return super().update(n)

    monkeypatch.setattr(Q, "tqdm", Bar)
    out = tmp_path / "a.parquet"
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(run / "q.parquet"),
                                  "--history", str(run / "h.parquet"), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    f = pq.ParquetFile(out)
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [3, 3, 1]
    got = f.read().to_pylist()
    printed = [json.loads(x) for x in r.stdout.splitlines()]
    assert [p["src_addr"] for p in printed] == [g["src_addr"] for g in got] == [
        f"192.0.2.{i}" for i in range(N)]
    assert [g["history_used"] for g in got] == [0, 6, 0, 0, 0, 0, 0]  # 6 of 20 fit 128 tokens
    # one bar of queries, moved by each batch of rows of each piece
    assert len(bars) == 1 and bars[0][:2] == [N, " queries"] and sum(bars[0][2:]) == N
    assert len(bars[0][2:]) >= 3
    assert r.stderr.splitlines()[-1] == f"wrote {N:,} answers to {out}"
    assert not (tmp_path / "a.parquet.part").exists()
    # the same answers as one query at a time
    one = CliRunner().invoke(main, ["predict", str(run / "run"), "--src", "192.0.2.1", "--dst",
                                    "193.0.14.129", "--time", "1767272401", "--history",
                                    str(run / "h.parquet"), "--json"])
    keys = ("rtt_ms", "p10_ms", "p90_ms", "p_failed", "history_used")
    assert {k: json.loads(one.stdout)[k] for k in keys} == {k: got[1][k] for k in keys}


# `train predict ARGS` with SIGNAL sent to itself at WHERE: as the 2nd piece of 2 queries
# is answered (the 1st for one --src query), or once the answers file is renamed into place
STOPPED_PREDICT = """
import os, signal, sys
from train.cli import main
from train.predict import predictor as P, queries as Q

where, name = sys.argv[1:3]
Q.PIECE, calls = 2, []
real = P.Predictor.predict_measurements if where == "answering" else Q.Histories.say_cut

def stop(*a, **k):
    calls.append(1)
    if where != "answering" or len(calls) == (2 if "--queries" in sys.argv else 1):
        os.kill(os.getpid(), getattr(signal, name))
    return real(*a, **k)

if where == "answering":
    P.Predictor.predict_measurements = stop
else:
    Q.Histories.say_cut = stop
main(sys.argv[3:], prog_name="train")
"""

STOPPED_PREDICT_LINES = {  # case -> (where, signal, exit code, the line's end, flags)
    "old-file": ("answering", "SIGINT", 130, "while answering {q} from {run}; {out} holds what "
                 "it held before and the first 2 answers were printed", ["--overwrite", "--json"]),
    "new-file": ("answering", "SIGTERM", 143, "while answering {q} from {run}; {out} was not "
                 "written", []),
    "published": ("published", "SIGINT", 130, "after writing {out}", []),
    "one-query": ("answering", "SIGINT", 130, "while answering 192.0.2.1 -> 193.0.14.129 from "
                  "{run}; nothing was written", []),
}


@pytest.mark.parametrize("case", STOPPED_PREDICT_LINES)
def test_a_signal_is_one_line_saying_what_was_written_and_exits_128_plus_it(run, tmp_path,
                                                                           case):
    """A user trial: Ctrl-C of `train predict --queries` crashed in Python's shutdown about
    one time in three (SIGSEGV: an XLA compile it cut short went on in its thread), as
    `train eval` did; it leaves as eval does, and its line says what it wrote."""
    where, name, code, line, flags = STOPPED_PREDICT_LINES[case]
    out, q = tmp_path / "a.parquet", run / "q.parquet"
    if "--overwrite" in flags:
        out.write_bytes(b"the answers of an earlier run")
    asked = (["--src", "192.0.2.1", "--dst", "193.0.14.129"] if case == "one-query" else
             ["--queries", q, "--out", out])
    p = python_c(STOPPED_PREDICT, where, name, "predict", run / "run", *asked, *flags)
    assert p.returncode == code, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1] == (
        f"error: train predict: stopped by {name} {line.format(q=q, run=run / 'run', out=out)}")
    assert "Traceback" not in p.stderr and "Aborted" not in p.stderr
    printed = [json.loads(x)["src_addr"] for x in p.stdout.splitlines()]
    assert printed == (["192.0.2.0", "192.0.2.1"] if "--json" in flags else [])
    if case == "published":  # whole, and said so before the stop
        assert pq.read_table(out)["src_addr"].to_pylist() == [f"192.0.2.{i}" for i in range(N)]
        assert p.stderr.splitlines()[-2] == f"wrote {N:,} answers to {out}"
    elif "--overwrite" in flags:
        assert out.read_bytes() == b"the answers of an earlier run"
    names = ["a.parquet"] if case == "published" or "--overwrite" in flags else []
    assert sorted(f.name for f in tmp_path.iterdir()) == names  # no .part


def test_an_answers_file_already_there_is_replaced_only_with_overwrite(run, tmp_path):
    """A user trial: `train predict --out FILE` replaced an existing FILE without a word;
    like `prep`'s --out, it takes --overwrite to replace one."""
    out = tmp_path / "a.parquet"
    out.write_bytes(b"the answers of an earlier run")
    args = ["predict", str(run / "run"), "--queries", str(run / "q.parquet"), "--out", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: --out {out}: already there; pass --overwrite to replace it (it stays as it "
        "was until every query is answered), or use another --out"]
    assert out.read_bytes() == b"the answers of an earlier run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet"]
    r = CliRunner().invoke(main, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert pq.read_table(out)["src_addr"].to_pylist() == [f"192.0.2.{i}" for i in range(N)]


def test_one_query_with_out_writes_the_answers_file_a_queries_file_of_it_gives(run, tmp_path):
    """A user trial: `train predict --src A --dst B --out FILE` wrote nothing, without a
    word. --json prints one query's answer as a queries file's, so --out writes it as a
    queries file's too: one row, and a file already there only with --overwrite."""
    one = ["predict", str(run / "run"), "--src", "192.0.2.1", "--dst", "193.0.14.129", "--time",
           "1767272401", "--history", str(run / "h.parquet")]
    out, many = tmp_path / "one.parquet", tmp_path / "many.parquet"
    r = CliRunner().invoke(main, [*one, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[-1] == f"wrote 1 answer to {out}"
    got = pq.read_table(out)
    assert got.column_names == Q.ANSWERS_SCHEMA.names and got.num_rows == 1
    r2 = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(run / "q.parquet"),
                                   "--history", str(run / "h.parquet"), "--out", str(many)])
    assert r2.exit_code == 0, r2.output
    assert got.to_pylist() == pq.read_table(many).slice(1, 1).to_pylist()  # its query 1
    assert got.to_pylist()[0]["history_used"] == 6
    printed = json.loads(r.stdout)  # and as --json prints it
    assert {k: printed[k] for k in got.column_names} == {
        **got.to_pylist()[0], "event_time": "2026-01-01T13:00:01Z"}
    before = out.read_bytes()
    r = CliRunner().invoke(main, [*one, "--out", str(out)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: --out {out}: already there; pass --overwrite to replace it (it stays as it "
        "was until every query is answered), or use another --out"]
    assert out.read_bytes() == before
    r = CliRunner().invoke(main, [*one, "--out", str(out), "--overwrite"])
    assert r.exit_code == 0 and r.stdout.startswith("192.0.2.1 -> 193.0.14.129: RTT median ")
    assert pq.read_table(out).to_pylist() == got.to_pylist()
    assert sorted(f.name for f in tmp_path.iterdir()) == ["many.parquet", "one.parquet"]


def test_a_long_history_costs_a_few_encodings_not_one_per_measurement(monkeypatch):
    cfg = dataclasses.replace(MODELS["tiny"], seq_len=1024)
    pred = P.Predictor(model.init_params(cfg, 0), cfg)
    q = P.query_measurement("192.0.2.1", "193.0.14.129", 1_000_000 + 10_000)
    hist = [dataclasses.replace(q, time=1_000_000 + 10 * i, rtt_code=0x2E1B) for i in range(1000)]
    real, calls = P.encode_context, []
    monkeypatch.setattr(P, "encode_context", lambda ms: calls.append(len(ms)) or real(ms))
    tokens, choice, rtt, kept = pred._fit_row(hist, q)
    # 1,024 tokens: 23 for the first, 16 for each later one, 14 for the query -> 62 fit
    assert kept == 62 and len(tokens) == 23 + 16 * 61 + 14
    assert (tokens, choice, rtt) == (lambda t, c, r: (t, c[-1], r[-1]))(*real(hist[-62:] + [q]))
    # bisection over the newest 1,024 // 12 = 85 (one encoding per start tried: 24 before)
    assert len(calls) == 7, calls


def _hist(path, times, prb=None):
    cols = {"event_time": times, "src_addr": ["192.0.2.1"] * len(times),
            "dst_addr": ["193.0.14.129"] * len(times), "ip_version": [4] * len(times),
            "rtt": [20.0 + i for i in range(len(times))]}
    if prb is not None:
        cols["prb_id"] = prb
    pq.write_table(pa.table(cols), path)
    return str(path)


def test_a_history_stops_at_a_silence_longer_than_the_datasets_gap(tmp_path, capsys):
    """A training context never spans a silence of more than max_gap_s (prep shards
    --max-gap), so neither does a query's history: rows before the query's last such
    silence are not read (a user trial's query two months after a one-hour history read
    14 of its rows), the query's own distance from its newest row included; each query
    that lost rows so is counted, in one line on stderr."""
    t0, day = 1767225600, 86_400
    h = _hist(tmp_path / "h.parquet", [t0 + 60 * i for i in range(6)]
              + [t0 + 3 * day + 60 * i for i in range(4)])
    q = lambda t: P.query_measurement("192.0.2.1", "193.0.14.129", t)
    src = {(q(t0).family, q(t0).src_hi, q(t0).src_lo)}
    hist = Q.Histories(Q.history_of(h), h, src, 100, day)
    # after the silence: only the 4 rows since it; in the first hour: all rows so far
    assert [m.time - t0 for m in hist.context(q(t0 + 3 * day + 600))] == [
        3 * day + 60 * i for i in range(4)]
    assert [m.time - t0 for m in hist.context(q(t0 + 330))] == [60 * i for i in range(6)]
    assert hist.context(q(t0 + 60 * day)) == []  # two months after its newest row
    assert len(hist.context(q(None))) == 4  # a query without a time: the newest stretch
    assert hist.cut == 3
    hist.say_cut(h, day, "the run's dataset shards")
    assert capsys.readouterr().err == (
        f"{h}: 3 queries read their history only from after its last silence of more than "
        "86,400 s (training contexts are cut there; the gap from the run's dataset shards)\n")
    # the row budget alone is no cut; and gap 0 (--max-gap 0) cuts nothing
    few = Q.Histories(Q.history_of(h), h, src, 3, day)
    assert len(few.context(q(t0 + 330))) == 3 and few.cut == 0
    never = Q.Histories(Q.history_of(h), h, src, 100, 0)
    assert len(never.context(q(t0 + 60 * day))) == 10 and never.cut == 0


def test_history_rows_of_several_probes_behind_one_address_are_named(tmp_path, capsys):
    h = _hist(tmp_path / "h.parquet", [1767225600 + 60 * i for i in range(6)],
              prb=[7, 7, 8, 9, 7, 8])
    q = P.query_measurement("192.0.2.1", "193.0.14.129", 1767229200)
    Q.Histories(Q.history_of(h), h, {(q.family, q.src_hi, q.src_lo)}, 100, 86_400)
    assert capsys.readouterr().err == (
        f"{h}: the history rows of 1 query source(s) come from several probes (prb_id; e.g. "
        "192.0.2.1: 3), an address hosts behind a NAT share; the model reads them as one "
        "probe's context; give each probe's rows alone\n")



FILE_FIX = "give IPv4 or IPv6 addresses in src_addr and dst_addr"
FLAG_FIX = "give IPv4 or IPv6 addresses, e.g. --src 192.0.2.7 --dst 193.0.14.129"


@pytest.mark.parametrize("src, dst, in_file, by_flag", [
    ("1.2.3.999", "193.0.14.129",
     f"query 2, src_addr: '1.2.3.999' does not appear to be an IPv4 or IPv6 address; {FILE_FIX}",
     f"--src: '1.2.3.999' does not appear to be an IPv4 or IPv6 address; {FLAG_FIX}"),
    ("192.0.2.9", "fe80::1%eth0",
     "query 2, dst_addr: 'fe80::1%eth0' has an IPv6 zone id (%eth0); give the address "
     f"without it; {FILE_FIX}",
     f"--dst: 'fe80::1%eth0' has an IPv6 zone id (%eth0); give the address without it; {FLAG_FIX}"),
    ("192.0.2.9", "2001:db8::1",
     "query 2: source 192.0.2.9 is IPv4 and destination 2001:db8::1 IPv6; a ping has one "
     "address family",
     "source 192.0.2.9 is IPv4 and destination 2001:db8::1 IPv6; a ping has one address family"),
])
def test_a_bad_address_in_a_queries_file_names_the_file_the_query_and_the_address(
        run, tmp_path, src, dst, in_file, by_flag):
    """A user trial: a bad address in a queries file was named without the file or its row
    (queries count from 0, as the file's other errors count them)."""
    q = tmp_path / "q.parquet"
    pq.write_table(pa.table({"src_addr": ["192.0.2.7", "192.0.2.8", src],
                             "dst_addr": ["193.0.14.129", "193.0.14.129", dst]}), q)
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(q), "--json"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: {q}: {in_file}"]
    # one query on the command line: named by its flag
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--src", src, "--dst", dst])
    assert r.exit_code == 2 and r.stderr.splitlines() == [f"error: {by_flag}"]


def test_band_adds_each_answers_band_point_last_and_leaves_the_rest_as_it_was(run, tmp_path):
    """--band E: point_ms, each query's band point at E as train.predict.predictor answers it
    on the same context (held to a brute force in tests/test_predictor.py), after the other
    columns, which stay bit for bit; one query prints it; a band of 1 or more is refused."""
    args = ["predict", str(run / "run"), "--queries", str(run / "q.parquet"), "--history",
            str(run / "h.parquet"), "--out"]
    plain, banded = tmp_path / "plain.parquet", tmp_path / "band.parquet"
    for out, extra in ((plain, []), (banded, ["--band", "0.05"])):
        r = CliRunner().invoke(main, [*args, str(out), *extra])
        assert r.exit_code == 0, r.output
    got, before = pq.read_table(banded), pq.read_table(plain)
    assert got.column_names == [*Q.ANSWERS_SCHEMA.names, "point_ms"]
    assert got.drop_columns(["point_ms"]).to_pylist() == before.to_pylist()
    pred = P.load(run / "run")
    qs = [P.query_measurement(f"192.0.2.{i}", "193.0.14.129", 1767272400 + i) for i in range(N)]
    hist = Q.Histories(Q.history_of(str(run / "h.parquet")), str(run / "h.parquet"),
                       {(q.family, q.src_hi, q.src_lo) for q in qs}, pred.max_history,
                       Q.run_max_gap(run / "run")[0])
    direct = pred.predict_measurements([(q, hist.context(q)) for q in qs], band=0.05)
    assert got["point_ms"].to_pylist() == [a["point_ms"] for a in direct]
    codes = P.code_ms(np.arange(1 << 16))
    assert all(np.isin(got["point_ms"].to_numpy(), codes))  # a code's value, each one
    one = CliRunner().invoke(main, ["predict", str(run / "run"), "--src", "192.0.2.1", "--dst",
                                    "193.0.14.129", "--time", "1767272401", "--history",
                                    str(run / "h.parquet"), "--band", "0.05"])
    assert one.exit_code == 0, one.output
    a = got.to_pylist()[1]
    assert one.stdout == (
        f"192.0.2.1 -> 193.0.14.129: RTT median {a['rtt_ms']:.2f} ms (p10 {a['p10_ms']:.2f}, "
        f"p90 {a['p90_ms']:.2f}), band point at 0.05 {a['point_ms']:.2f} ms, P(failed) "
        f"{a['p_failed']:.3f}; 6 earlier measurements as context\n")
    r = CliRunner().invoke(main, [*args, str(tmp_path / "x.parquet"), "--band", "1"])
    assert r.exit_code == 2 and "--band" in r.stderr and "0<=x<1" in r.stderr
    assert not (tmp_path / "x.parquet").exists()
