"""`train eval` and `train predict` end to end on a small real-pipeline dataset (time split):
exact query and target counts, strata held to a brute force, the model's answers (with and
without context) held to a brute force, --max-queries, the figure, the CLIs."""

import datetime
import ipaddress
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import python_c

from prep.schema import rows as rows_lib
from prep.schema.measurements import addr_text, addr_words
from prep.tokens import rowdecode
from prep.tokens.decode import decode_context
from tests.test_predictor import brute_band_point, brute_force
from train.cli import main
from train.eval import baselines, context_baselines
from train.eval import evaluate as evaluate_lib
from train.eval.evaluate import PREDICTORS, EvalConfig, evaluate, local_scope, source_groups
from train.eval.metrics import STRATA
from train.eval.report import fail_prior_line, format_report, label, point_line
from train.fit import reader
from train.fit.config import TrainConfig
from train.fit.loop import train
from train.model import failprior
from train.predict import predictor as P

L = 128


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    d = tmp_path_factory.mktemp("eval")
    synth(SynthConfig(out=d / "raw", rows=6_000, probes=60, days=1, seed=0))
    run_shards([str(d / "raw")], str(d / "shards"),
               ShardsConfig(seed=0, row_len=L, split="time", test_fraction=0.2),
               workers=1, progress=False)
    cfg = TrainConfig(data=str(d / "shards"), run_dir=str(d / "run"), steps=6, batch_size=4,
                      lr=3e-3, warmup=2, log_every=3, eval_every=3, eval_rows=8, ckpt_every=0)
    train(cfg)
    return d


@pytest.fixture(scope="module")
def full(run):
    return evaluate(EvalConfig(run_dir=str(run / "run")), progress=False)


@pytest.mark.slow
def test_eval_counts_every_query_and_target(run, full):
    report, detail = full
    manifest = reader.open_shards(run / "shards")
    tok, seg = reader.read_split(run / "shards", manifest, "test")
    # queries: every measurement of every test segment whose measurements all carry a time
    n_q = n_rtt = 0
    for r in range(len(tok)):
        for s in range(1, int(seg[r].max()) + 1):
            ms = decode_context(tok[r][seg[r] == s].tolist())
            if all(m.time is not None for m in ms):
                n_q += len(ms)
                n_rtt += sum(not m.failed for m in ms)
    assert (report["queries"], report["queries_with_rtt"]) == (n_q, n_rtt)
    assert n_q > 100 and len(detail.queries) == n_q
    targets = int(rows_lib.loss_mask(seg).sum())
    assert report["loss"]["tokens"] == targets
    assert sum(v["tokens"] for v in report["loss"]["by_role"].values()) == targets
    assert sorted(report["loss"]["by_role"]) == ["dst", "marker", "result", "rtt", "src", "timestamp"]
    # the model (its point, its median) and without its context, six context and eight
    # train-fit baselines, each scored on the same queries, by stratum and by context length
    assert list(report["rtt"]) == list(PREDICTORS) == [
        "model", "model_median", "model_no_context", "context_last", "context_ema", "context_median",
        "context_vivaldi", "context_knn", "context_krig", "global_median", "dst_median",
        "pair_last", "pair_ema", "pair_median", "pair_mode", "vivaldi", "matrix_factorization"]
    # the model's point: the band point at the band pair_mode picked on the train split
    # (its pairs have 5 replies and more), scored and reported as such
    band = report["point"]["band"]
    assert band in baselines.PAIR_MODE_BANDS and len(report["point"]["band_errors"]) == 7
    assert report["point"]["band_errors"][str(band)] == min(report["point"]["band_errors"].values())
    has = ~detail.queries.failed
    # the model's own point: per stratum, the band whose median relative error it expects
    # least of itself (no truth read), its band point there
    by = report["point"]["model_by_stratum"]
    assert set(by) == {STRATA[k] for k in np.unique(detail.stratum)}
    for name, v in by.items():
        exp = v["expected"]
        assert exp[str(v["band"])] == min(exp.values()) and len(exp) == 7
        k = STRATA.index(name)
        col = [None, *baselines.PAIR_MODE_BANDS].index(v["band"])
        sel = has & (detail.stratum == k)
        assert detail.rtt_ms["model"][sel].tolist() == detail.model.band_points[sel, col].tolist()
    assert np.isfinite(detail.rtt_ms["model"][has]).all()
    assert detail.rtt_ms["model_median"][has].tolist() == detail.model.quantile_ms[has, 1].tolist()
    for m in report["rtt"].values():
        assert m["n"] == n_q and m["n_rtt"] == n_rtt
        assert sum(b["n"] for b in m["by_history"].values()) == n_q
        assert sum(b["n"] for b in m["by_stratum"].values()) == n_q
        assert m["median_rel_ci"][0] <= m["median_rel"] <= m["median_rel_ci"][1]
    assert 0 <= report["rtt"]["model"]["interval_coverage"] <= 1
    assert "interval_coverage" in report["rtt"]["model"]["by_stratum"]["cold"]
    assert report["data_matches_run"] is True
    assert report["split"]["split"] == "time"
    written = json.loads((run / "run" / "eval" / "step-6.json").read_text())
    assert written["rtt"] == report["rtt"]
    text = format_report(report)
    assert "matrix factorization" in text and "Vivaldi" in text and f"{n_q:,} RTT queries" in text
    assert "context last-seen" in text and "inside its [p10, p90]" in text
    assert point_line(report["point"]) in text.splitlines()
    # the context baselines' P(failed): the context's counts over the beta priors fit on the
    # train split's contexts (their pseudo-pings and its rate in the report, said in a line)
    fp = report["fail_prior"]
    assert {fp["pair"], fp["context"]} <= set(context_baselines.FAIL_STRENGTHS)
    assert fp["dead"] in (0.0, *context_baselines.DEAD_PRIORS)
    assert fail_prior_line(fp) in text.splitlines()
    q = detail.queries
    train = rowdecode.decode_rows(*reader.read_split(run / "shards", manifest, "train"))
    ((t_src, t_dst), (_, q_dst)), n_nodes = evaluate_lib.node_ids([train, q])
    counts = context_baselines.fail_counts(
        context_baselines.context_starts(q.row * 256 + q.segment), q_dst, q.failed)
    prior = context_baselines.FailPrior(
        **{k: v for k, v in fp.items() if k not in ("rate", "dst_shrink")})
    # each destination's priors from its train pairs (failprior.dst_offsets), shrunk over 20
    assert fp["dst_shrink"] == 20.0
    off = context_baselines.fail_offsets(t_src, t_dst, train.failed, n_nodes)[:, q_dst]
    want = context_baselines.fail_shares(counts, fp["rate"], prior, off)
    # where each earlier ping of the query's family failed, the family may be broken
    starts = context_baselines.context_starts(q.row * 256 + q.segment)
    chain = context_baselines.family_chain(starts, q.family, q.failed, want)
    want = context_baselines.broken_shares(want, q.family, *chain, prior.broken)
    assert len(fp["broken"]) == 2 and set(fp["broken"]) <= {0.0, *failprior.BROKEN_PRIORS}
    for name in ("context_last", "context_krig"):
        np.testing.assert_allclose(detail.p_failed[name], want, rtol=1e-12)
    plain = context_baselines.fail_shares(counts, fp["rate"], prior)
    assert np.abs(want - plain).max() > 0.01 and (np.abs(off) > 0.05).any()
    assert (counts[1] > 0).sum() > 50 and (counts[0] > 0).sum() > 5  # pairs, and failures
    # fewer than 1,000 replies: a warning, in the report and its table; the split was the limit
    assert n_rtt < 1000 and report["warnings"] == [
        f"only {n_rtt:,} queries have a reply (fewer than 1,000): the medians and their "
        "intervals are rough; evaluate on a larger test split"]
    assert text.splitlines()[1] == f"warning: {report['warnings'][0]}"
    config = json.loads((run / "run" / "config.json").read_text())["model"]
    assert config["n_layers"] == 2 and report["trained"] == {
        "model": "tiny", "steps": 6, "batch_size": 4, "loss_weights": "uniform",
        "config": config}
    assert "model tiny, 6 steps of 4 rows, objective weights by role: uniform" in text
    # a history bucket without replies prints "-", aligned in its column
    r2 = json.loads(json.dumps(report))
    for m in r2["rtt"].values():
        m["by_history"][next(iter(m["by_history"]))]["median_rel"] = None
    lines = format_report(r2).splitlines()
    i = lines.index("median relative error by earlier measurements in the context")
    scored = [k for k, m in r2["rtt"].items() if m["covered"] > 0]
    table = lines[i + 1:i + 3 + len(scored)]
    assert len({len(line) for line in table}) == 1 and table[-1][22:31] == "        -"
    # a baseline that fell back for every query names its fallback instead of its numbers
    r2["rtt"]["pair_last"]["covered"] = 0.0
    lines = format_report(r2).splitlines()
    assert f"{label('pair_last'):<22}(fell back for all: = global median)" in lines
    assert sum(line.startswith("pair last-seen") for line in lines) == 1


def _address(m, j, side):
    return (int(m.family[j]), int(getattr(m, side + "_hi")[j]), int(getattr(m, side + "_lo")[j]))


_SHARED = [ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.168.0.0/16", "::/128", "::1/128", "fc00::/7", "fe80::/10")]


def _shared(address):
    """A source address that unrelated hosts share (a NAT's private side and the like)."""
    a = ipaddress.ip_address(addr_text(*address))
    return any(a in n for n in _SHARED if n.version == a.version)


def test_local_scope_marks_the_addresses_unrelated_hosts_share():
    texts = ["192.168.1.2", "10.0.0.2", "172.16.0.2", "172.32.0.1", "100.64.0.1", "100.128.0.1",
             "8.8.8.8", "127.0.0.1", "169.254.1.1", "0.1.2.3", "192.0.2.1", "::", "::1",
             "fc00::1", "fd12::1", "fe80::1", "febf::1", "fec0::1", "2001:db8::1", "::2"]
    fam, hi, lo = (np.array(c, np.uint64) for c in zip(*(addr_words(t) for t in texts)))
    got = local_scope(fam.astype(np.uint8), hi, lo)
    assert [t for t, g in zip(texts, got) if g] == [
        "192.168.1.2", "10.0.0.2", "172.16.0.2", "100.64.0.1", "127.0.0.1", "169.254.1.1",
        "0.1.2.3", "::", "::1", "fc00::1", "fd12::1", "fe80::1", "febf::1"]


def test_strata_and_context_last_equal_brute_force(run, full):
    report, detail = full
    q = detail.queries
    manifest = reader.open_shards(run / "shards")
    train = rowdecode.decode_rows(*reader.read_split(run / "shards", manifest, "train"))
    known = {_address(train, j, side) for j in range(len(train)) for side in ("src", "dst")}
    counts = dict.fromkeys(STRATA, 0)
    sources = {s: set() for s in STRATA}
    behind_nat = 0  # queries whose private source address the train split also holds: cold
    ms = q.rtt_ms()
    for i in range(len(q)):
        before = [j for j in range(len(q)) if (q.row[j], q.segment[j]) == (q.row[i], q.segment[i])
                  and q.index[j] < q.index[i] and _address(q, j, "dst") == _address(q, i, "dst")
                  and not q.failed[j]]
        src = _address(q, i, "src")
        stratum = ("pair_in_context" if before else "node_known"
                   if src in known and not _shared(src) else "cold")
        counts[stratum] += 1
        behind_nat += not before and src in known and _shared(src)
        sources[stratum].add(_address(q, i, "src"))
        if before:  # the last earlier reply to the same destination, exactly
            assert detail.rtt_ms["context_last"][i] == ms[max(before, key=lambda j: q.index[j])]
    assert {s: v["n"] for s, v in report["rtt"]["model"]["by_stratum"].items()} == counts
    assert counts["pair_in_context"] > 0 and counts["node_known"] + counts["cold"] > 0
    assert behind_nat > 0  # the fixture's NAT addresses exercise the rule (28 queries)
    # the intervals' groups: one per source address, counted per stratum
    assert report["sources_by_stratum"] == {s: len(v) for s, v in sources.items()}
    groups = source_groups(q)
    assert report["sources"] == len(set().union(*sources.values())) == groups.max() + 1
    for i in range(len(q)):  # the same address, the same group; another, another
        same = [j for j in range(len(q)) if _address(q, j, "src") == _address(q, i, "src")]
        assert set(np.flatnonzero(groups == groups[i])) == set(same)


def test_eval_answers_equal_brute_force(run, full):  # full: the full report is written
    full_json = (run / "run" / "eval" / "step-6.json").read_text()
    report, detail = evaluate(EvalConfig(run_dir=str(run / "run"), max_queries=40, seed=1),
                              progress=False)
    q = detail.queries
    assert len(q) == report["queries"] == 40  # whole contexts, the last one cut
    # each context is whole or a prefix (indices 0, 1, ..., k - 1)
    ctx = q.row.astype(np.int64) * 256 + q.segment
    first = np.r_[True, ctx[1:] != ctx[:-1]]
    assert (q.index[first] == 0).all() and (np.diff(q.index)[~first[1:]] == 1).all()
    assert report["written_to"] == str(run / "run" / "eval" / "step-6-q40.json")
    assert (run / "run" / "eval" / "step-6.json").read_text() == full_json  # not overwritten
    pred = P.load(run / "run")
    checked = 0
    for i in np.flatnonzero(~q.failed)[:5]:
        ctx = np.flatnonzero((q.row == q.row[i]) & (q.segment == q.segment[i]) & (q.index <= q.index[i]))
        ms = [P.Measurement(int(q.family[j]), int(q.src_hi[j]), int(q.src_lo[j]), int(q.dst_hi[j]),
                            int(q.dst_lo[j]), int(q.time[j]), int(q.rtt_code[j])) for j in ctx]
        tokens, choice, rtt = P.encode_context(ms)
        p_fail, codes, joint = brute_force(pred, tokens, choice[-1], rtt[-1])
        assert detail.model.quantile_code[i].tolist() == codes
        assert detail.p_failed["model"][i] == pytest.approx(p_fail, rel=1e-4)
        # its point: the band point at the band the report names for its stratum (its
        # median where that is None)
        stratum = STRATA[detail.stratum[i]]
        band = report["point"]["model_by_stratum"][stratum]["band"]
        point = P.code_ms(codes[1]) if band is None else brute_band_point(*joint, band)
        assert detail.rtt_ms["model"][i] == pytest.approx(point, rel=1e-12)
        # without context: the query alone, a one-measurement context
        tokens, choice, rtt = P.encode_context(ms[-1:])
        p_fail, codes, joint = brute_force(pred, tokens, choice[-1], rtt[-1])
        band = report["point"]["model_no_context_by_stratum"][stratum]["band"]
        point = P.code_ms(codes[1]) if band is None else brute_band_point(*joint, band)
        assert detail.rtt_ms["model_no_context"][i] == pytest.approx(point, rel=1e-12)
        assert detail.p_failed["model_no_context"][i] == pytest.approx(p_fail, rel=1e-4)
        checked += 1
    assert checked == 5


def test_eval_and_predict_cli(run, tmp_path):
    pdf = tmp_path / "eval.pdf"
    r = CliRunner().invoke(main, ["eval", str(run / "run"), "--max-queries", "30", "--json",
                                  "--plot", str(pdf)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["queries"] == 30
    assert "warning: only " in r.stderr  # 30 queries: fewer than 1,000 with a reply
    assert pdf.read_bytes()[:5] == b"%PDF-"

    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--src", "192.0.2.7", "--dst",
                                  "193.0.14.129", "--time", "2026-01-01T12:00:00Z", "--json"])
    assert r.exit_code == 0, r.output
    one = json.loads(r.stdout)
    assert set(one) >= {"rtt_ms", "p10_ms", "p90_ms", "p_failed", "history_used"}
    assert one["p10_ms"] <= one["rtt_ms"] <= one["p90_ms"] and 0 <= one["p_failed"] <= 1

    hist = tmp_path / "h.parquet"
    pq.write_table(pa.table({"event_time": [1767268800, 1767268860], "src_addr": ["192.0.2.7"] * 2,
                             "dst_addr": ["193.0.14.129"] * 2, "ip_version": [4, 4],
                             "rtt": [20.0, -1.0]}), hist)
    queries = _two_queries(tmp_path)
    out = tmp_path / "a.parquet"
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(queries),
                                  "--history", str(hist), "--out", str(out)])
    assert r.exit_code == 0, r.output
    got = pq.read_table(out).to_pylist()
    assert [(g["src_addr"], g["history_used"]) for g in got] == [("192.0.2.7", 2), ("192.0.2.8", 0)]
    # the file's first query is the single query with that history
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--src", "192.0.2.7", "--dst",
                                  "193.0.14.129", "--time", "1767272400", "--history", str(hist),
                                  "--json"])
    single = json.loads(r.stdout)
    assert {k: single[k] for k in P_KEYS} == {k: got[0][k] for k in P_KEYS}


P_KEYS = ("rtt_ms", "p10_ms", "p90_ms", "p_failed", "history_used")

# `train eval ARGS` with SIGINT sent to itself as WHERE's function is called: in step 2 of
# the evaluation, as the report is written, or as the figure is drawn
STOPPED_EVAL = """
import os, signal, sys
from train.cli import main
from train.eval import evaluate, plot

module, name = {"queries": (evaluate, "full_mode_queries"), "report": (evaluate, "write_report"),
                "figure": (plot, "figure")}[sys.argv[1]]
real = getattr(module, name)

def stop(*a, **k):
    os.kill(os.getpid(), signal.SIGINT)
    return real(*a, **k)

setattr(module, name, stop)
main(sys.argv[2:], prog_name="train")
"""


STOPPED_LINES = {  # where -> (the line's end, the files in RUN_DIR/eval)
    "queries": ("while evaluating {run}; nothing was written", []),
    "report": ("after writing {run}/eval/step-6-q30.json and its answers; {png} was not "
               "written", ["step-6-q30.answers.npz", "step-6-q30.json"]),
    "figure": ("after writing {run}/eval/step-6-q30.json and its answers; {png} was not "
               "written", ["step-6-q30.answers.npz", "step-6-q30.json"]),
}


@pytest.mark.parametrize("where", STOPPED_LINES)
def test_ctrl_c_of_eval_says_what_it_wrote_and_exits_130(run, tmp_path, where):
    """A user trial: Ctrl-C of `train eval` printed click's "Aborted!" alone (exit 1, or a
    crash in Python's shutdown: an XLA compile it cut short went on in its thread)."""
    line, files = STOPPED_LINES[where]
    copy = shutil.copytree(run / "run", tmp_path / "run",
                           ignore=shutil.ignore_patterns("eval"))  # other tests' reports
    png = tmp_path / "eval.png"
    p = python_c(STOPPED_EVAL, where, "eval", copy, "--max-queries", "30", "--plot", png)
    assert p.returncode == 130, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1] == (
        f"error: train eval: stopped by SIGINT {line.format(run=copy, png=png)}")
    assert "Traceback" not in p.stderr and "Aborted" not in p.stderr
    assert sorted(f.name for f in (copy / "eval").glob("*")) == files  # each whole, no temp
    assert sorted(f.name for f in tmp_path.iterdir()) == ["run"]  # no figure, nor its temp


def test_a_plot_already_there_is_replaced_only_with_overwrite_not_the_report(run, tmp_path):
    """A user trial: `train eval --plot FILE` replaced an existing FILE without a word; like
    `train predict --out`, it takes --overwrite, refused before the evaluation. The report
    under RUN_DIR/eval/ is the evaluation's own: evaluating again rewrites it."""
    copy = shutil.copytree(run / "run", tmp_path / "run",
                           ignore=shutil.ignore_patterns("eval"))  # other tests' reports
    png, report = tmp_path / "eval.png", copy / "eval" / "step-6-q30.json"
    png.write_bytes(b"an earlier figure")
    args = ["eval", str(copy), "--max-queries", "30", "--plot", str(png)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: --plot {png}: already there; pass --overwrite to replace it (it stays as it "
        "was until the figure is drawn), or use another --plot"]
    assert png.read_bytes() == b"an earlier figure" and not (copy / "eval").exists()
    r = CliRunner().invoke(main, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(report.read_text())["queries"] == 30
    report.write_text("an earlier report")  # rewritten, with no --overwrite
    r = CliRunner().invoke(main, ["eval", str(copy), "--max-queries", "30"])
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["queries"] == 30
    assert sorted(f.name for f in (copy / "eval").iterdir()) == [
        "step-6-q30.answers.npz", "step-6-q30.json"]


@pytest.mark.parametrize("as_json", [False, True])
def test_few_replies_are_said_once_and_name_max_queries_when_it_cut_them(run, full, as_json):
    """A user trial: the warning came twice (stderr as it arose, then the table), and said
    to evaluate on a larger test split when --max-queries 30 was the limit."""
    n = full[0]["queries"]
    r = CliRunner().invoke(main, ["eval", str(run / "run"), "--max-queries", "30"]
                           + ["--json"] * as_json)
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if line.startswith("warning: only ")]
    assert len(said) == 1
    assert said[0].endswith(f"are rough; raise --max-queries (the test split has {n:,} RTT "
                            "queries)")
    assert said[0] in (r.stderr if as_json else r.stdout).splitlines()
    if as_json:
        assert json.loads(r.stdout)["warnings"] == [said[0].removeprefix("warning: ")]


def test_eval_keeps_its_answers_and_pooling_them_alone_gives_its_report(run, full):
    """`train eval` writes each query's answers beside its report (train.eval.answers);
    `train pool` of that one evaluation (its run folder) reproduces the report's scores and
    verdict exactly, from the file alone."""
    from train.eval.answers import read_answers
    from train.eval.pool import pool

    report, detail = full
    path = run / "run" / "eval" / f"step-{report['step']}.answers.npz"
    assert report["answers_written_to"] == str(path)
    a = read_answers(path)
    assert a["names"] == list(report["rtt"]) == list(detail.rtt_ms)
    for i, name in enumerate(a["names"]):
        np.testing.assert_array_equal(a["pred_ms"][i], detail.rtt_ms[name])
        np.testing.assert_array_equal(a["p_failed"][i], detail.p_failed[name])
    np.testing.assert_array_equal(a["source"], source_groups(detail.queries))
    np.testing.assert_array_equal(a["stratum"], detail.stratum)
    assert a["interval_of"] == ["model", "model_no_context"]
    np.testing.assert_array_equal(a["interval_ms"][0, 1], detail.model.quantile_ms[:, 2])
    assert a["about"]["data_fingerprint"] == report["data_fingerprint"]
    pooled = pool([str(run / "run")])
    assert pooled["inputs"][0]["answers"] == str(path)
    assert json.dumps(pooled["rtt"]) == json.dumps(report["rtt"])
    assert pooled["verdict"] == report["verdict"]
    assert (pooled["queries"], pooled["sources"], pooled["sources_by_stratum"]) == (
        report["queries"], report["sources"], report["sources_by_stratum"])


def test_verdict_per_stratum_against_the_strongest_baseline(full):
    # issue 36, item 8: per stratum, the model minus the strongest baseline (lowest median
    # relative error, not a model) on the same queries, with Brier and MAE
    report, detail = full
    rtt, v = report["rtt"], report["verdict"]
    assert list(v) == ["all", *STRATA]
    for k, scope in enumerate(["all", *STRATA]):
        row = v[scope]
        get = (lambda m: m) if scope == "all" else (lambda m: m["by_stratum"][scope])
        if not get(rtt["model"])["n_rtt"]:
            assert row["baseline"] is None
            continue
        medians = {n: get(m)["median_rel"] for n, m in rtt.items()
                   if not n.startswith("model")}
        assert row["baseline"] in medians and medians[row["baseline"]] == min(medians.values())
        assert row["median_rel"]["model"] == get(rtt["model"])["median_rel"]
        assert row["median_rel"]["baseline"] == get(rtt[row["baseline"]])["median_rel"]
        assert row["mae_ms"]["model"] == pytest.approx(get(rtt["model"])["mae_ms"])
        assert row["brier"]["baseline"] == pytest.approx(get(rtt[row["baseline"]])["brier"])
        briers = {n: get(m)["brier"] for n, m in rtt.items() if not n.startswith("model")}
        f = row["failures"]  # P(failed)'s bar: the lowest Brier, whichever baseline has it
        assert briers[f["baseline"]] == min(briers.values())
        assert f["brier"]["model"] == pytest.approx(get(rtt["model"])["brier"])
        assert f["brier"]["baseline"] == pytest.approx(min(briers.values()))
        lo, hi = row["median_rel"]["diff_ci"]
        assert lo <= row["median_rel"]["diff"] <= hi
        assert row["winner"] == ("model" if hi < 0 else "baseline" if lo > 0 else "neither")
    text = format_report(report).splitlines()
    head = ("verdict: the model minus the strongest baseline, paired on the same queries "
            "[95 % interval]; intervals resample whole sources: ")
    at = next(i for i, line in enumerate(text) if line.startswith(head))
    assert text[at] == head + f"{report['sources']:,} (" + ", ".join(
        f"{s} {report['sources_by_stratum'][s]:,}" for s in STRATA) + ")"
    scopes = [line for line in text[at + 1:at + 9] if not line.startswith("    ")]
    assert [line.split(" (")[0].strip() for line in scopes] == ["all", *STRATA]
    assert text[at + 2].startswith(f"    P(failed) ({v['all']['n']:,} queries): ")


def test_max_queries_beyond_the_split_says_so_and_names_the_file_by_what_it_holds(run, full):
    # issue 36, item 4: --max-queries 10000 on 57 queries quietly used 57 and wrote
    # eval/step-S-q10000.json
    n = full[0]["queries"]
    r = CliRunner().invoke(main, ["eval", str(run / "run"), "--max-queries", str(10 * n),
                                  "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["queries"] == n
    said = (f"--max-queries {10 * n:,}: the test split has only {n:,} RTT queries; all of "
            "them are used")
    assert f"warning: {said}" in r.stderr.splitlines() and said in got["warnings"]
    assert got["written_to"] == str(run / "run" / "eval" / f"step-{got['step']}-q{n}.json")


def test_eval_of_a_shards_folder_names_it_and_the_commands_that_take_it(run):
    # issue 36, item 11: "not a run folder" without saying what it is
    r = CliRunner().invoke(main, ["eval", str(run / "shards")])
    assert r.exit_code == 2, r.output
    d = run / "shards"
    assert r.stderr.splitlines() == [
        f"error: {d}: a shards folder (`prep shards` wrote it), not a run folder; train a "
        f"model on it with `train --data {d}`, then give that run's folder (runs/...), or "
        f"evaluate a run on it: train eval RUN_DIR --data {d}"]


def test_eval_and_predict_without_run_dir_take_the_newest_run(run, tmp_path, monkeypatch):
    """`train eval` and `train predict` alone take the newest run under runs/, as `train
    --resume` resumes."""
    shutil.copytree(run / "run", tmp_path / "runs" / "tiny-new")
    shutil.copytree(run / "run", tmp_path / "runs" / "tiny-old")
    for step in (tmp_path / "runs" / "tiny-old" / "checkpoints").iterdir():  # saved earlier
        os.utime(step, (1_000_000, 1_000_000))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["eval", "--max-queries", "30", "--json"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == "evaluating runs/tiny-new, the newest run under runs/"
    assert json.loads(r.stdout)["run_dir"] == "runs/tiny-new"
    # `train predict` takes the same run, and answers as it does given it
    ping = ["--src", "192.0.2.7", "--dst", "193.0.14.129", "--time", "1767272400", "--json"]
    r = CliRunner().invoke(main, ["predict", *ping])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == ["answering from runs/tiny-new, the newest run under runs/"]
    given = CliRunner().invoke(main, ["predict", "runs/tiny-new", *ping])
    assert given.exit_code == 0 and given.stderr == "", given.output
    assert json.loads(r.stdout) == json.loads(given.stdout)
    shutil.rmtree(tmp_path / "runs")
    r = CliRunner().invoke(main, ["predict", *ping])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == ["error: no run with checkpoints under runs/; give RUN_DIR, "
                                     "e.g. train predict runs/tiny-20261123-101500"]
UTC = datetime.UTC


def test_predict_history_is_filtered_by_source_on_both_paths(run, tmp_path):
    """One rule for --history: a query reads only the rows with its src_addr, single query
    or queries file, and the rows left out are counted on stderr."""
    hist = tmp_path / "h.parquet"
    pq.write_table(pa.table({
        "event_time": [1767268800, 1767268860, 1767268800, 1767268830, 1767268890],
        "src_addr": ["192.0.2.7"] * 2 + ["198.51.100.9"] * 3,
        "dst_addr": ["193.0.14.129"] * 5, "ip_version": [4] * 5,
        "rtt": [20.0, -1.0, 900.0, 950.0, 990.0]}), hist)
    note = f"{hist}: 3 of 5 history rows left out (their src_addr is no query's source)"
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--src", "192.0.2.7", "--dst",
                                  "193.0.14.129", "--time", "1767272400", "--history", str(hist),
                                  "--json"])
    assert r.exit_code == 0, r.output
    single = json.loads(r.stdout)
    assert single["history_used"] == 2
    assert r.stderr.splitlines() == [note]
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"src_addr": ["192.0.2.7"], "dst_addr": ["193.0.14.129"],
                             "event_time": [1767272400]}), queries)
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(queries),
                                  "--history", str(hist), "--json"])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [note]
    assert {k: single[k] for k in P_KEYS} == {k: json.loads(r.stdout)[k] for k in P_KEYS}


def _two_queries(tmp_path):
    """192.0.2.7 and 192.0.2.8 to 193.0.14.129, the second without a time."""
    queries = tmp_path / "q.parquet"
    pq.write_table(pa.table({"src_addr": ["192.0.2.7", "192.0.2.8"],
                             "dst_addr": ["193.0.14.129", "193.0.14.129"],
                             "event_time": [1767272400, None]}), queries)
    return queries


def test_predict_answers_name_their_time_event_time_as_the_input_schema(run, tmp_path):
    """The answers' time column is the input schema's: ``event_time``, a UTC timestamp
    (null for a query without one), so an answers file reads back as a queries file."""
    queries = _two_queries(tmp_path)
    out = tmp_path / "a.parquet"
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(queries),
                                  "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    table = pq.read_table(out)
    assert table.column_names == ["src_addr", "dst_addr", "event_time", "rtt_ms", "p10_ms",
                                  "p90_ms", "p_failed", "history_used"]
    # whole seconds, UTC; parquet stores a seconds timestamp as milliseconds, as it does the
    # event_time of `prep synth`'s and the importers' files
    assert table.schema.field("event_time").type == pa.timestamp("ms", tz="UTC")
    assert table.column("event_time").to_pylist() == [
        datetime.datetime(2026, 1, 1, 13, tzinfo=UTC), None]
    assert [json.loads(line)["event_time"] for line in r.stdout.splitlines()] == [
        "2026-01-01T13:00:00Z", None]
    again = tmp_path / "b.parquet"
    r = CliRunner().invoke(main, ["predict", str(run / "run"), "--queries", str(out),
                                  "--out", str(again)])
    assert r.exit_code == 0, r.output
    assert pq.read_table(again).equals(table)


def test_plot_png(run, full, tmp_path):
    from train.eval.plot import plot

    report, detail = full
    r2 = json.loads(json.dumps(report))
    r2["rtt"]["pair_last"]["covered"] = 0.0  # drawn as one legend line with the others like it
    plot(r2, detail, str(tmp_path / "eval.png"))
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figure_styles_are_fixed_and_panels_show_the_strongest(full):
    # issue 36, item 9: colours moved between runs (by position among the curves drawn),
    # a stratum with n = 0 got empty axes, 13 curves crowded every panel
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from train.eval import plot as plot_lib
    from train.eval.registry import PREDICTORS as ALL

    report, detail = full
    r2 = json.loads(json.dumps(report))
    r2["rtt"]["pair_last"]["covered"] = 0.0  # one fewer curve must move no other's colour
    r2["rtt"]["model"]["by_stratum"]["cold"]["n_rtt"] = 0
    colours = {}
    for rep in (report, r2):
        fig = plot_lib.figure(rep, detail)
        titles = [a.get_title() for a in fig.axes]
        assert any(t.startswith("cold") for t in titles) == (rep is report)
        panels = [a for a in fig.axes if a.get_title().startswith(("all", *STRATA))]
        assert len(panels) == (4 if rep is report else 3)
        for a in panels:
            lines = [ln for ln in a.get_lines() if not ln.get_label().startswith("_")]
            scope = a.get_title().split(" (")[0]
            names = plot_lib.panel_curves(rep["rtt"], None if scope == "all queries" else scope)
            assert [ln.get_label() for ln in lines] == [label(n) for n in names]
            assert len(names) <= 2 + plot_lib.STRONGEST and names[0] == "model"
            for ln in lines:
                colours.setdefault(ln.get_label(), set()).add(
                    (matplotlib.colors.to_hex(ln.get_color()), ln.get_linestyle()))
        plt.close(fig)
    assert all(len(v) == 1 for v in colours.values()), colours
    assert plot_lib.STYLES["vivaldi"]["color"] == plot_lib._COLORS[ALL.index("vivaldi") - 3]


@pytest.fixture(scope="module")
def no_test_split(run):
    """The run's data rebuilt with every probe in train: same rows length, empty test split."""
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    out = run / "shards-no-test"
    run_shards([str(run / "raw")], str(out), ShardsConfig(seed=0, row_len=L, test_fraction=0.0),
               workers=1, progress=False)
    return out


@pytest.mark.parametrize("args, message", [
    (["eval", "no/such/run"], "no such run folder"),
    (["eval", "NOTRUN"], "not a run folder"),
    (["eval", "RUN", "--data", "NOTEST"], "the test split is empty"),
    (["predict", "no/such/run", "--src", "1.2.3.4", "--dst", "5.6.7.8"], "no such run folder"),
    (["predict", "RUN", "--src", "1.2.3.999", "--dst", "5.6.7.8"], "give IPv4 or IPv6 addresses"),
    (["predict", "RUN", "--src", "1.2.3.4"], "give --src and --dst"),
    (["predict", "RUN", "--src", "1.2.3.4", "--dst", "5.6.7.8", "--history", "BADHIST"],
     "rtt"),
    (["predict", "RUN", "--src", "1.2.3.4", "--dst", "5.6.7.8", "--time", "yesterday"],
     "not an ISO-8601 time"),
    # the times `prep` accepts, never wrapped into the tokens' bytes
    (["predict", "RUN", "--src", "1.2.3.4", "--dst", "5.6.7.8", "--time", "-5"],
     "error: --time -5: outside 1970-01-01 <= t < 2100-01-01 UTC, the times `prep` accepts"),
    (["predict", "RUN", "--src", "1.2.3.4", "--dst", "5.6.7.8", "--time", str(2**62)],
     f"error: --time {2**62}: outside 1970-01-01 <= t < 2100-01-01 UTC"),
    (["predict", "RUN", "--src", "1.2.3.4", "--dst", "5.6.7.8", "--time", "2100-01-01"],
     "error: --time 2100-01-01: outside 1970-01-01 <= t < 2100-01-01 UTC"),
    (["predict", "RUN", "--queries", "BADTIMES", "--json"],
     ("bad-times.parquet: query 1 has event_time -5, outside 1970-01-01 <= t < 2100-01-01 "
      "UTC, the times `prep` accepts")),
])
def test_bad_input_is_one_line_and_exit_2(run, no_test_split, tmp_path, args, message):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"event_time": [1], "src_addr": ["1.2.3.4"], "dst_addr": ["5.6.7.8"],
                             "ip_version": [4]}), bad)  # no rtt column
    (tmp_path / "notrun").mkdir()
    (tmp_path / "notrun" / "notes.txt").write_text("a folder, not a run")
    pq.write_table(pa.table({"src_addr": ["1.2.3.4"] * 2, "dst_addr": ["5.6.7.8"] * 2,
                             "event_time": [1767272400, -5]}), tmp_path / "bad-times.parquet")
    paths = {"RUN": run / "run", "BADHIST": bad, "NOTRUN": tmp_path / "notrun",
             "NOTEST": no_test_split, "BADTIMES": tmp_path / "bad-times.parquet"}
    args = [str(paths[a]) if a in paths else a for a in args]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_the_point_line_names_pair_modes_band_and_each_stratums_own_pick():
    pt = {"band": 0.02, "band_errors": {"None": 0.03, "0.02": 0.025},
          "model_by_stratum": {"pair_in_context": {"band": 0.01, "expected": {
              "None": 0.02, "0.01": 0.0181}}, "cold": {"band": None, "expected": {
                  "None": 0.7, "0.01": 0.9}}}}
    assert point_line(pt) == (
        "point predictions: pair mode, per pair the centre of its densest window at 0.02 (the "
        "value the most of its replies lie within 0.02 of; median relative error on each "
        "pair's latest fifth of its train replies: median 0.0300, 0.02 0.0250); the model, "
        "per stratum the point whose median relative error it expects least of itself "
        "(counted over the codes of its 4 likeliest first RTT bytes, so high where it is "
        "unsure): pair_in_context band 0.01 (expected 0.0181); cold its median (expected "
        "0.7000)")
    pt = {"band": None, "band_errors": {}}  # written before 2026-12-01's own pick
    assert point_line(pt) == ("point predictions of the model and pair mode: the median (no "
                              "pair had 5 replies to score a band)")
