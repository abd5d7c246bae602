"""bench/learning.py's curve point keeps each stratum's interval and the paired verdict (a lent
GPU's per-query errors do not come back, so the point is all a report has); bench/recipe_gpu.py
refuses a variant world without a name of its own; bench/run.py says its parts."""

import pytest

from bench import learning, recipe_gpu

STRATA = ("pair_in_context", "node_known", "cold")


def _scores(base: float) -> dict:
    return {"median_rel": base, "median_rel_ci": [base - 0.01, base + 0.01],
            "by_stratum": {s: {"median_rel": base + k, "median_rel_ci": [base + k - 0.02,
                                                                         base + k + 0.02]}
                           for k, s in enumerate(STRATA)}}


def _report() -> dict:
    names = ("model", "model_no_context") + learning.BASELINES
    verdict = {scope: {"n": 10, "n_rtt": 8, "baseline": "dst_median", "baseline_covered": 1.0,
                       "winner": "model",
                       "median_rel": {"model": 0.3, "baseline": 0.32, "diff": -0.02,
                                      "diff_ci": [-0.03, -0.01]},
                       "mae_ms": {"model": 9.0, "baseline": 10.0, "diff": -1.0,
                                  "diff_ci": [-1.5, -0.5]},
                       "brier": {"model": 0.1, "baseline": 0.2, "diff": -0.1,
                                 "diff_ci": [-0.2, 0.0]},
                       "failures": {"baseline": "global_median", "winner": "neither",
                                    "brier": {"model": 0.1, "baseline": 0.15, "diff": -0.05,
                                              "diff_ci": [-0.1, 0.01]}}}
               for scope in ("all", *STRATA)}
    verdict["node_known"] = {"n": 0, "n_rtt": 0, "baseline": None}  # no query in the scope
    return {"step": 40, "loss": {"loss": 1.5, "by_role": {"rtt": {"loss": 2.0}}},
            "rtt": {n: _scores(0.1 * k) for k, n in enumerate(names)}, "verdict": verdict,
            "sources": 7, "sources_by_stratum": {"pair_in_context": 5, "node_known": 0,
                                                 "cold": 3}}


def test_curve_point_keeps_stratum_intervals_and_verdict():
    p = learning.curve_point(_report(), 1234)
    assert (p["step"], p["tokens"], p["loss"], p["loss_by_role"]) == (40, 1234, 1.5, {"rtt": 2.0})
    assert p["model_no_context"]["all"] == 0.1
    assert p["model_no_context"]["ci"] == pytest.approx([0.09, 0.11])
    assert p["model_no_context"]["cold"] == pytest.approx(2.1)
    assert p["model_no_context"]["stratum_ci"]["cold"] == pytest.approx([2.08, 2.12])
    assert p["verdict"]["cold"] == {"n_rtt": 8, "baseline": "dst_median", "winner": "model",
                                    "median_rel": {"diff": -0.02, "diff_ci": [-0.03, -0.01]},
                                    "mae_ms": {"diff": -1.0, "diff_ci": [-1.5, -0.5]},
                                    "failures": {"baseline": "global_median",
                                                 "winner": "neither", "diff": -0.05,
                                                 "diff_ci": [-0.1, 0.01]}}
    assert p["verdict"]["node_known"] == {"n_rtt": 0, "baseline": None, "winner": None}
    assert p["sources"] == {"all": 7, "pair_in_context": 5, "node_known": 0, "cold": 3}


@pytest.mark.parametrize("argv, says", [
    (["--synth-args", "--access-ms 5"], "give --tag too"),
    (["--tag", "a/b", "--synth-args", "--access-ms 5"], "letters, digits"),
    (["--budget-s", "-1"], "--budget-s -1: must be above 0"),
    (["--steps", "0"], "--steps 0: must be above 0"),
])
def test_recipe_gpu_refuses_bad_arguments_at_parse(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        recipe_gpu.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_bench_run_names_its_parts(capsys):
    from bench import run

    assert run.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "parts: beam compile etl eval import memory" in out and "example:" in out
    assert run.main(["etl", "nope"]) == 2
    assert capsys.readouterr().err.startswith("bench.run: no part nope; the parts: beam ")


@pytest.mark.parametrize("argv, says", [
    ([], "give --data (a shards folder to train on) or --score RUN_DIR"),
    (["--score", "{tmp}"], "no config.json there (a run folder `train` wrote)"),
])
def test_learning_needs_data_or_a_run_to_score(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        learning.main([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_plot_draws_one_panel_per_stratum_with_queries(tmp_path):
    from PIL import Image

    curve = {"points": [learning.curve_point(_report(), t) for t in (1000, 2000)],
             "n_by_stratum": {"pair_in_context": 5, "node_known": 0, "cold": 3},
             "config": {"train": {"model": "small", "data": "shards-256"}}, "device": "cpu"}
    learning.plot(curve, tmp_path / "c.png")
    # all, pair_in_context and cold: 3 panels of 3.3 inches at 150 dpi (node_known has none)
    assert Image.open(tmp_path / "c.png").size == (round(3 * 3.3 * 150), round(3.4 * 150))


def test_recipe_gpu_pools_each_world_s_last_scored_checkpoint(tmp_path, capsys):
    """After the worlds' runs: `train pool` of each run's newest answers (its last point)."""
    import json

    from tests.test_eval_pool import _world

    runs = []
    for w, model in ((0, 110), (1, 120)):
        ev = tmp_path / f"run{w}" / "eval"
        ev.mkdir(parents=True)
        for step, m in ((10, 200), (20, model)):  # the step-10 answers are far off: not read
            _world(ev / f"step-{step}-q6.answers.npz", model=[m] * 6, ema=[130] * 6, sources=2,
                   fingerprint=f"w{w}")
        runs.append(tmp_path / f"run{w}")
    recipe_gpu._pooled(runs, tmp_path / "pooled.json")
    r = json.loads((tmp_path / "pooled.json").read_text())
    assert [i["answers"] for i in r["inputs"]] == [
        str(tmp_path / f"run{w}" / "eval" / "step-20-q6.answers.npz") for w in (0, 1)]
    assert r["rtt"]["model"]["median_rel"] == pytest.approx(0.15)  # 0.1 x5, 0.2 x5
    err = capsys.readouterr().err
    assert "[recipe-gpu] 2 worlds pooled, verdict: the model minus the strongest baseline" in err
    assert f"[recipe-gpu] wrote {tmp_path / 'pooled.json'}" in err
