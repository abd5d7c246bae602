"""`train pool` (train.eval.pool) and the answers `train eval` keeps (train.eval.answers):
planted worlds pooled, with exact medians, sources told apart by world, the verdict's
intervals those of the pooled queries, and what it refuses. `train eval`'s own answers file
is held to its report in tests/test_evaluate.py."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from prep.base.errors import InputError
from train.cli import main
from train.eval import answers as A
from train.eval import metrics as EM
from train.eval.pool import pool, resolve


TRAINED = {"model": "small", "steps": 2400, "batch_size": 8, "loss_weights": "rtt=10",
           "config": {"n_layers": 2, "pair_fail_recent": 16, "pair_reverse": False}}


def _world(path, *, model, ema, sources, fingerprint, extra=None, p10=90.0, matches=True,
           trained=TRAINED, band=0.02):
    """An answers file of queries to a 100 ms truth (one failed at the end), each source
    with the same number of queries, the model and context EMA answering ``model``/``ema``;
    its run trained as ``trained`` says (None: an answers file from before that record)."""
    n = len(model)
    truth = np.full(n, 100.0)
    failed = np.zeros(n, bool)
    failed[-1] = True
    preds = {"model": (np.asarray(model, float), np.full(n, 0.1), np.ones(n, bool)),
             "context_ema": (np.asarray(ema, float), np.full(n, 0.2), np.ones(n, bool))}
    if extra:
        preds[extra] = (np.full(n, 100.0), np.zeros(n), np.ones(n, bool))
    source = np.repeat(np.arange(sources), n // sources)
    stratum = np.where(np.arange(n) % 2 == 0, 0, 2).astype(np.int8)
    return A.write_answers(
        path, preds=preds, intervals={"model": (np.full(n, p10), np.full(n, 120.0))},
        truth_ms=truth, failed=failed, history=np.arange(n), stratum=stratum, groups=source,
        about={"run_dir": f"runs/{fingerprint}", "step": 7, "data": f"shards-{fingerprint}",
               "data_fingerprint": fingerprint, "data_matches_run": matches,
               "split": {"split": "time"},
               "config": {"max_queries": 0, "seed": 0}}
        | ({} if trained is None else {"trained": trained})
        | ({} if band == "none" else {"point": {"band": band, "band_errors": {}}}))


def test_answers_round_trip(tmp_path):
    p = _world(tmp_path / "step-7.answers.npz", model=[110, 120, 130, 140], ema=[130] * 4,
               sources=2, fingerprint="a")
    assert A.answers_path(tmp_path / "step-7.json") == p
    a = A.read_answers(p)
    assert a["names"] == ["model", "context_ema"] and a["interval_of"] == ["model"]
    assert a["pred_ms"][0].tolist() == [110, 120, 130, 140]
    assert a["source"].tolist() == [0, 0, 1, 1] and a["stratum"].tolist() == [0, 2, 0, 2]
    assert a["failed"].tolist() == [False, False, False, True]
    assert a["interval_ms"].shape == (1, 2, 4) and a["about"]["data_fingerprint"] == "a"
    assert list(tmp_path.iterdir()) == [p]  # no temp file left


def test_two_worlds_pooled(tmp_path):
    """World a: the model 0.1 off, the EMA 0.3; world b: the model 0.2 off, the EMA 0.05.
    Pooled: medians over both worlds' replies, 2 + 3 sources (source 0 of each world is
    another probe), and the verdict of the concatenated queries with those groups."""
    fa = _world(tmp_path / "a.answers.npz", model=[110] * 6, ema=[130] * 6, sources=2,
                fingerprint="a")
    fb = _world(tmp_path / "b.answers.npz", model=[120] * 9, ema=[105] * 9, sources=3,
                fingerprint="b", extra="dst_median", p10=101.0)
    r = pool([str(fa), str(fb)])
    assert (r["queries"], r["queries_with_rtt"], r["sources"]) == (15, 13, 5)
    assert r["warnings"] == ["left out, not in every input: dst_median",
                             "only 13 queries have a reply (fewer than 1,000): the medians "
                             "and their intervals are rough"]
    assert list(r["rtt"]) == ["model", "context_ema"]
    # replies: world a 5 (model 0.1, EMA 0.3), world b 8 (model 0.2, EMA 0.05)
    assert r["rtt"]["model"]["median_rel"] == pytest.approx(0.2)
    assert r["rtt"]["context_ema"]["median_rel"] == pytest.approx(0.05)
    # the model's [p10, p90] holds the truth in world a, not in world b (p10 101 ms)
    assert r["rtt"]["model"]["interval_coverage"] == pytest.approx(5 / 13)
    assert [i["sources"] for i in r["inputs"]] == [2, 3]
    v = r["verdict"]["all"]
    assert (v["baseline"], v["n"], v["n_rtt"], v["winner"]) == ("context_ema", 15, 13, "neither")
    truth = np.full(15, 100.0)
    failed = np.array([False] * 5 + [True] + [False] * 8 + [True])
    groups = np.concatenate([np.repeat([0, 1], 3), np.repeat([2, 3, 4], 3)])
    rel_m = np.abs(np.r_[[110.0] * 6, [120.0] * 9] - truth) / truth
    rel_e = np.abs(np.r_[[130.0] * 6, [105.0] * 9] - truth) / truth
    assert v["median_rel"]["diff_ci"] == EM.paired_bootstrap_ci(
        rel_m[~failed], rel_e[~failed], seed=0, n_boot=EM.VERDICT_N_BOOT, groups=groups[~failed])
    assert r["sources_by_stratum"] == {"pair_in_context": 5, "node_known": 0, "cold": 5}


def test_runs_that_did_not_train_alike_are_named(tmp_path):
    """Pooled runs of two recipes (a model setting, the steps) make the pooled `model`
    several models: a warning names each differing setting with its inputs; answers written
    before they said how the run trained are named as unchecked."""
    other = TRAINED | {"steps": 1200, "config": TRAINED["config"] | {"pair_fail_recent": 0}}
    fa, fb, fc = (_world(tmp_path / f"{k}.answers.npz", model=[110] * 4, ema=[130] * 4,
                         sources=2, fingerprint=k, trained=t)
                  for k, t in (("a", TRAINED), ("b", TRAINED), ("c", other)))
    assert pool([str(fa), str(fb)])["warnings"][:1] == [
        "only 6 queries have a reply (fewer than 1,000): the medians and their intervals are "
        "rough"]
    assert pool([str(fa), str(fb), str(fc)])["warnings"][0] == (
        "the pooled runs did not train alike, so the pooled `model` is several models: "
        f"steps 2400 ({fa}, {fb}), 1200 ({fc}); pair_fail_recent 16 ({fa}, {fb}), 0 ({fc})")
    # a setting `train` sets from the data (no reverse pairs in one world): named apart
    fe = _world(tmp_path / "e.answers.npz", model=[110] * 4, ema=[130] * 4, sources=2,
                fingerprint="e", trained=TRAINED | {"config": TRAINED["config"]
                                                    | {"pair_reverse": True}})
    assert pool([str(fa), str(fe)])["warnings"][0] == (
        "the pooled runs differ in what `train` sets from a run's data (one recipe, other "
        f"data): pair_reverse false ({fa}), true ({fe})")
    fd = _world(tmp_path / "d.answers.npz", model=[110] * 4, ema=[130] * 4, sources=2,
                fingerprint="d", trained=None)
    assert pool([str(fa), str(fd)])["warnings"][0] == (
        f"{fd}: written before answers said how the run trained, so the pooled runs cannot be "
        "checked for one recipe; run `train eval` on it again to check")
    assert len(pool([str(fd)])["warnings"]) == 1  # one input: nothing to hold it to


def test_inputs_scored_by_different_points_are_named(tmp_path):
    """`model` is the band point at the band each evaluation's train split picked, or the
    median (a pick, or an answers file from before the band point): pooling several is
    said, with each input's rule, which `inputs` records too."""
    fa, fb, fc, fd = (_world(tmp_path / f"{k}.answers.npz", model=[110] * 4, ema=[130] * 4,
                             sources=2, fingerprint=k, band=b)
                      for k, b in (("a", 0.02), ("b", 0.02), ("c", None), ("d", "none")))
    assert [i["point"] for i in pool([str(fa), str(fb)])["inputs"]] == [
        "its band point at 0.02"] * 2
    assert not any("point differs" in w for w in pool([str(fa), str(fb)])["warnings"])
    assert pool([str(fa), str(fc), str(fd), str(fb)])["warnings"][0] == (
        "the model's point differs between inputs, so the pooled `model` mixes them: "
        f"its band point at 0.02 ({fa}, {fb}); its median ({fc}); its median (written before "
        f"2026-12-01) ({fd}); run `train eval` on the older ones again to score them alike")


def test_pool_refuses_the_same_queries_twice_and_what_is_not_answers(tmp_path):
    fa = _world(tmp_path / "a.answers.npz", model=[110] * 4, ema=[130] * 4, sources=2,
                fingerprint="a")
    fa2 = _world(tmp_path / "a2.answers.npz", model=[120] * 4, ema=[130] * 4, sources=2,
                 fingerprint="a")
    with pytest.raises(InputError, match="hold queries of the same test split .of shards-a.: "
                                         "pooled, a query or a probe would count twice"):
        pool([str(fa), str(fa2)])
    bad = tmp_path / "x.answers.npz"
    bad.write_text("not an archive")
    with pytest.raises(InputError, match="not a NumPy archive of answers; `train eval RUN_DIR` "
                                         "writes one"):
        pool([str(bad)])
    (tmp_path / "step-7.json").write_text("{}")
    with pytest.raises(InputError, match="step-7.json: a report, not its answers; they are "
                                         "step-7.answers.npz beside it"):
        pool([str(tmp_path / "step-7.json")])
    np.savez(tmp_path / "y.npz", names=np.array(["model"]))
    with pytest.raises(InputError, match="not the answers of a `train eval` .no pred_ms"):
        pool([str(tmp_path / "y.npz")])
    with pytest.raises(InputError, match="not a run folder .no config.json."):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InputError, match="no answers of a whole-split evaluation .* run "
                                         "`train eval"):
        resolve(str(tmp_path))


def test_a_run_folder_means_its_newest_whole_split_answers(tmp_path):
    ev = tmp_path / "run" / "eval"
    ev.mkdir(parents=True)
    for name in ("step-800.answers.npz", "step-2400.answers.npz", "step-3000-q500.answers.npz",
                 "step-9999-copy.answers.npz"):  # not a name `train eval` writes: not read
        (ev / name).write_bytes(b"")
    assert [A.step_of(ev / n) for n in ("step-800.answers.npz", "step-3000-q500.answers.npz",
                                        "step-9999-copy.answers.npz")] == [(800, 0), (3000, 500),
                                                                           None]
    assert resolve(str(tmp_path / "run")) == ev / "step-2400.answers.npz"
    assert resolve(str(ev / "step-800.answers.npz")) == ev / "step-800.answers.npz"


def test_another_datasets_evaluation_is_kept_apart_and_named_when_pooled(tmp_path):
    """`train eval RUN --data OTHER` writes step-<S>-on-<F>.json beside the run's own
    report, never over it; a run folder means its own answers, and an other-data answers
    file named to pool is pooled with a warning (its test split may hold what the model saw)."""
    from train.eval.report import report_path
    assert report_path("r", 7).name == "step-7.json"
    assert report_path("r", 7, 500, "9e18716c").name == "step-7-q500-on-9e18716c.json"
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    own = _world(run / "eval" / "step-7.answers.npz", model=[110] * 4, ema=[130] * 4,
                 sources=2, fingerprint="a")
    other = _world(run / "eval" / "step-9-on-b.answers.npz", model=[110] * 4, ema=[130] * 4,
                   sources=2, fingerprint="b", matches=False)
    assert A.step_of(other) is None and resolve(str(run)) == own
    r = pool([str(other), str(_world(tmp_path / "c.answers.npz", model=[110] * 4,
                                      ema=[130] * 4, sources=2, fingerprint="c"))])
    assert r["warnings"][0] == (f"{other}: evaluated on shards-b, not the dataset its run "
                                "trained on; its test split may hold what the model saw")
    assert len(r["warnings"]) == 2  # and the few replies'


def test_pool_cli(tmp_path):
    fa = _world(tmp_path / "a.answers.npz", model=[110] * 6, ema=[130] * 6, sources=2,
                fingerprint="a")
    fb = _world(tmp_path / "b.answers.npz", model=[120] * 9, ema=[105] * 9, sources=3,
                fingerprint="b")
    res = CliRunner().invoke(main, ["pool", str(fa), str(fb), "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("train pool: 2 evaluations, 15 RTT queries (13 with a reply)\n"
                                 f"  {fa}: runs/a at step 7 on shards-a, 6 queries (5 with a "
                                 "reply), 2 sources; the model's point: its band point at "
                                 "0.02\n")
    assert "intervals resample whole (evaluation, source) pairs: 5" in res.output
    assert "  all (13 with a reply): no winner (the interval holds 0); vs context EMA (0.3)" \
        in res.output
    assert json.loads((tmp_path / "p.json").read_text())["sources"] == 5
    res = CliRunner().invoke(main, ["pool"])
    assert res.exit_code == 2 and "name the answers of at least one `train eval`" in res.output
    res = CliRunner().invoke(main, ["pool", str(tmp_path / "none.npz")])
    assert res.exit_code == 2 and "none.npz: no such file" in res.output


def test_an_out_already_there_is_replaced_only_with_overwrite(tmp_path):
    """A user trial: `train pool --out FILE` replaced an existing FILE without a word; like
    `train predict --out` and `prep`'s --out, it takes --overwrite to replace one."""
    fa = _world(tmp_path / "a.answers.npz", model=[110] * 6, ema=[130] * 6, sources=2,
                fingerprint="a")
    out = tmp_path / "p.json"
    out.write_text("an earlier pooling\n")
    res = CliRunner().invoke(main, ["pool", str(fa), "--out", str(out)])
    assert res.exit_code == 2 and res.stdout == ""  # refused before the pooling
    assert res.stderr.splitlines() == [
        f"error: --out {out}: already there; pass --overwrite to replace it, or use another "
        "--out"]
    assert out.read_text() == "an earlier pooling\n"
    res = CliRunner().invoke(main, ["pool", str(fa), "--out", str(out), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["sources"] == 2
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a.answers.npz", "p.json"]


def test_verdict_lines_keep_four_decimals_below_a_tenth(tmp_path):
    """Where the relative errors are ~0.01 (a context's replies to the destination), the
    verdict line says them to 4 decimals: 3 would print -0.000 [-0.001, -0.000]."""
    from train.eval.pool import format_pooled

    fa = _world(tmp_path / "a.answers.npz", model=[101] * 6, ema=[102] * 6, sources=2,
                fingerprint="a")
    fb = _world(tmp_path / "b.answers.npz", model=[301] * 9, ema=[102] * 9, sources=3,
                fingerprint="b")
    lines = format_pooled(pool([str(fa)])).splitlines()
    assert ("  all (5 with a reply): the model wins; vs context EMA (0.3): median rel 0.0100 "
            "vs 0.0200, -0.0100 [-0.0100, -0.0100]; ") in "\n".join(lines)
    text = format_pooled(pool([str(fa), str(fb)]))
    assert "median rel 2.010 vs 0.020, +1.990 [" in text  # the model's 2.01: 3 decimals
    # P(failed) against the lowest Brier of the baselines, below each scope's line: the EMA's
    # 0.2 has (5 x 0.04 + 0.64) / 6 = 0.14, the model's 0.1 (5 x 0.01 + 0.81) / 6; its
    # source 0 -0.03 a query, source 1 (the failed query) +0.11 / 3: the interval holds 0
    at = lines.index(next(x for x in lines if x.startswith("  all (5 with a reply)")))
    assert lines[at + 1] == ("    P(failed) (6 queries): no winner (the interval holds 0); vs "
                             "context EMA (0.3) (the lowest Brier of the baselines): Brier "
                             "0.1433 vs 0.1400, +0.0033 [-0.0300, +0.0367]")
