"""bench.fail_floor: the generator's true failure rates, and the posterior under its priors."""
import numpy as np
import pytest

from bench.fail_floor import StreamPrior, bayes_fail, world_fail_p
from prep.ingest import synth as S

A, B = S.FAIL_BETA
MEAN = S.FAIL_SCALE * A / (A + B)  # a live stream's mean rate: 0.9 x 0.6 / 4.6


@pytest.fixture(scope="module")
def prior():
    return StreamPrior()


def test_stream_prior_moments(prior):
    # no ping: the prior means, a root's and a user target's (12 % firewalled at 0.95)
    assert prior.predict(0, 0, False) == (pytest.approx(MEAN, abs=2e-6), 1.0)
    user = (1 - S.FIREWALLED[0]) * MEAN + S.FIREWALLED[0] * S.FIREWALLED[1]
    assert prior.predict(0, 0, True)[0] == pytest.approx(user, abs=2e-6)
    # one failed ping of a root's stream: E[p^2] / E[p] = s (a + 1) / (a + b + 1); its
    # likelihood E[p]
    p, lik = prior.predict(1, 1, False)
    assert p == pytest.approx(S.FAIL_SCALE * (A + 1) / (A + B + 1), abs=1e-5)
    assert lik == pytest.approx(MEAN, abs=2e-6)


def test_bayes_reads_kind_and_broken_ipv6(prior):
    # one context: v4 to root 0 (failed), v6 to user 1 (failed), v6 to root 2 (the query),
    # v6 to user 1 (replied), v6 to root 2 (the query again, after a reply)
    dst = np.array([0, 1, 2, 1, 2])
    family = np.array([4, 6, 6, 6, 6])
    failed = np.array([True, True, False, False, False])
    root = np.array([True, False, True, False, True])
    got = bayes_fail(np.array([0, 5]), dst, family, failed, root, prior)
    assert got[0] == pytest.approx(MEAN, abs=2e-6)  # v4, nothing before
    # v6 to a user target, nothing v6 before: broken with its prior 3 %
    user = prior.predict(0, 0, True)[0]
    assert got[1] == pytest.approx(S.V6_BROKEN + (1 - S.V6_BROKEN) * user, abs=1e-6)
    # the v6 ping to user 1 failed: broken against that stream failing (its E[p])
    w = S.V6_BROKEN / (S.V6_BROKEN + (1 - S.V6_BROKEN) * user)
    assert got[2] == pytest.approx(w + (1 - w) * MEAN, abs=1e-5)
    # a v6 reply: IPv6 works, the pair's own counts alone (user 1: 1 failed of 1)
    assert got[3] == pytest.approx(prior.predict(1, 1, True)[0], abs=1e-9)
    assert got[4] == pytest.approx(prior.predict(0, 1, False)[0], abs=1e-9)
    # without the kind: the even mixture of the two
    blind = bayes_fail(np.array([0, 5]), dst, family, failed, root, prior, kind=False)
    assert blind[0] == pytest.approx(0.5 * (MEAN + user), abs=1e-5)
    # without the probe's IPv6 state: each stream alone (user 1 a priori, root 2 after none)
    alone = bayes_fail(np.array([0, 5]), dst, family, failed, root, prior, broken=False)
    assert alone[1] == pytest.approx(user, abs=1e-9)
    assert alone[2] == pytest.approx(MEAN, abs=2e-6)
    assert alone[3:].tolist() == got[3:].tolist()


def test_world_rates_are_the_streams():
    cfg = S.SynthConfig(out=".", rows=20_000, probes=80, days=1, seed=3)
    rates, roots = world_fail_p(cfg)
    cols = S.generate(cfg)
    p = cols["fail_p"]
    assert len(roots) == len(S.ROOTS_V4) + len(S.ROOTS_V6) == 26
    # a broken IPv6 stream fails every ping; a firewalled one only goes to user targets
    assert (cols["rtt"][p == 1.0] == -1).all() and (p == 1.0).any()
    fire = p == S.FIREWALLED[1]
    assert fire.any() and (cols["msm_id"][fire] >= 10_000_000).all()
    assert (p <= S.FAIL_SCALE)[~fire & (p != 1.0)].all()
    # keyed by (source, destination, time): a few rows share one (a NAT's probes)
    assert 0.99 * len(p) <= len(rates) <= len(p)


def test_wrong_input_names_the_command_that_makes_it(tmp_path, capsys):
    from bench.fail_floor import main
    with pytest.raises(SystemExit) as e:
        main(["--data", str(tmp_path), "--answers", str(tmp_path / "a.npz")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--data {tmp_path}: no shards there (prep shards writes them)" in err
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["--data", str(tmp_path), "--answers", str(tmp_path / "a.npz")])
    assert "no such file (train eval RUN_DIR writes" in capsys.readouterr().err
