"""The destination store (ModelConfig.dst_store): the train split's replies by destination,
built by train.model.store and read by train.model.model.store_dists, on planted rows with
known quantiles."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prep.schema import vocab as V
from train.model import arch, model, store

B = V.BYTE_OFFSET
K = arch.STORE_K


def reply(b1, b2, dst_last=129):
    """One IPv4 measurement, 10.0.0.1 -> 193.0.14.<dst_last>, its reply's RTT code bytes
    b1 b2, then a one-byte time delta."""
    return [V.MEASUREMENT_START, V.SRC_IPV4, B + 10, B + 0, B + 0, B + 1, V.DST_IPV4, B + 193,
            B + 0, B + 14, B + dst_last, V.RTT_START, B + b1, B + b2, V.TIMESTAMP_DELTA1, B + 240]


FAILED = reply(0, 0)[:11] + [V.FAILED, V.TIMESTAMP_DELTA1, B + 240]
# a row: four replies to .129 (codes 0x6820, 0x6830, 0x6905, 0x6825), a failed ping to it,
# one reply to .130, two to .131
ROW = (reply(0x68, 0x20) + reply(0x68, 0x30) + FAILED + reply(0x69, 0x05)
       + reply(0x10, 0x10, dst_last=130) + reply(0x68, 0x25)
       + reply(0x30, 0x00, dst_last=131) + reply(0x30, 0x02, dst_last=131))
ROWS = 10  # .129 has 40 replies (usable), .131 20 and .130 10 (fewer than STORE_MIN)


def planted(rows=ROWS):
    tok = np.asarray([ROW] * rows, np.uint16)
    return tok, np.ones(tok.shape, np.uint8)


def dst_hash(last: int) -> int:
    """The model's hash of 193.0.14.<last>, read from a one-measurement row."""
    r = reply(0, 0, dst_last=last)
    _, full, _ = model.address_hashes(jnp.asarray([r]), jnp.ones((1, len(r)), jnp.int32), "dst")
    return int(full[0, -1])


def row_of(last: int, rows: int) -> int:
    return int(model.memory_row(jnp.asarray(dst_hash(last)), rows))


def test_a_row_holds_a_destinations_count_quantiles_and_check():
    """.129's 40 replies: 10 each of 0x6820, 0x6825, 0x6830, 0x6905, so its K quantiles
    (levels (k + 0.5) / K) are K / 4 of each, ascending; its count 40; its check the low 16
    bits of its hash. .130 and .131 have no rows: too few replies to be read (a row would
    only crowd out a destination that has enough)."""
    table, summary = store.build(*planted(), 1024)
    r = table[row_of(129, 1024)]
    q = K // 4
    assert r[:K].astype(int).tolist() == [0x6820] * q + [0x6825] * q + [0x6830] * q + [0x6905] * q
    assert r[K] == 40 and r[K + 1] == dst_hash(129) & 0xFFFF
    assert summary == store.StoreSummary(destinations=3, usable=1, replies=70, collided=0)
    assert np.count_nonzero(table[:, K]) == 1
    # the build reads in fixed batches: a partial last batch gives the same table
    np.testing.assert_array_equal(store.build(*planted(), 1024, batch=3)[0], table)


def rows_of(last: int, rows: int) -> tuple[int, int]:
    return tuple(int(r) for r in model.store_rows(dst_hash(last), rows))


def test_destinations_that_share_a_first_row_each_get_one_of_their_two():
    """Two destinations whose first rows are the same (found among 193.0.14.1-255 for a
    table of 64 rows): the one with more replies is placed first, then the other takes the
    shared row and moves it to its second (cuckoo hashing); the model reads each there."""
    firsts = {}
    for d in range(1, 256):
        firsts.setdefault(rows_of(d, 64)[0], []).append(d)
    a, b = next(v[:2] for v in firsts.values()
                if len(v) > 1 and rows_of(v[0], 64)[1] != rows_of(v[1], 64)[1]
                and rows_of(v[1], 64)[1] != rows_of(v[0], 64)[0])
    row = reply(0x40, 0x00, dst_last=a) * 3 + reply(0x50, 0x00, dst_last=b) * 2  # a more
    table, summary = store.build(np.asarray([row] * 20, np.uint16),
                                 np.ones((20, len(row)), np.uint8), 64)
    assert summary == store.StoreSummary(2, 2, 100, 0)
    assert table[rows_of(a, 64)[1], K] == 60 and table[rows_of(b, 64)[0], K] == 40
    tok, seg = jnp.asarray([row]), jnp.ones((1, len(row)), jnp.int32)
    (dist, on), _ = model.store_dists(jnp.asarray(table), tok, seg, widths=(1e-3, 1e-3))
    dist, on = np.asarray(dist)[0], np.asarray(on)[0]
    assert dist[11, 0x40] == pytest.approx(1.0) and dist[3 * 16 + 11, 0x50] == pytest.approx(1.0)
    assert on[11] and on[3 * 16 + 11]


def test_a_full_table_leaves_a_destination_without_a_row():
    """Three destinations with enough replies in a table of two rows: two are placed, one
    at each row; the third has none and is counted as collided."""
    table, summary = store.build(*planted(40), 2)  # 160, 40 and 80 replies
    assert summary.collided == 1 and summary.usable == 2
    held = {int(c) for c in table[:, K + 1]}
    checks = {d: dst_hash(d) & 0xFFFF for d in (129, 130, 131)}
    assert len(held) == 2 and held < set(checks.values())
    for r in (0, 1):
        d = next(d for d, c in checks.items() if c == table[r, K + 1])
        assert r in rows_of(d, 2) and table[r, K] == {129: 160, 130: 40, 131: 80}[d]


def test_store_dists_reads_the_quantiles_of_the_queried_destination():
    """Before the last .129 reply's first RTT byte: its quantiles' first bytes (three in four
    are 0x68, one in four 0x69); before its second byte (0x68 written): the second bytes of
    the quantiles with 0x68 (0x20, 0x25, 0x30, a third each). Off where the destination is not
    yet named, for .130 and .131 (too few replies), and where the check differs. A probe
    0x69 in place of the first byte asks for 0x05 alone."""
    table, _ = store.build(*planted(), 1024)
    tok, seg = jnp.asarray([ROW]), jnp.ones((1, len(ROW)), jnp.int32)
    sharp = (1e-3, 1e-3)  # widths that leave each quantile's byte one-hot
    (dist, on), _ = model.store_dists(jnp.asarray(table), tok, seg, widths=sharp)
    dist, on = np.asarray(dist)[0], np.asarray(on)[0]
    last = 5 * 16 - 2  # the fifth reply to .129 starts at 5 * 16 - 2 (the failed ping is 14)
    rs = last + 11
    starts = [11, 16 + 11, 32 + 14 + 11, rs]  # the RTT_STARTs of the replies to .129
    assert sorted(np.flatnonzero(on)) == sorted(starts + [s + 1 for s in starts])
    want1 = np.zeros(256)
    want1[0x68], want1[0x69] = 0.75, 0.25
    np.testing.assert_allclose(dist[rs], want1, atol=1e-6)
    want2 = np.zeros(256)
    want2[[0x20, 0x25, 0x30]] = 1 / 3
    np.testing.assert_allclose(dist[rs + 1], want2, atol=1e-6)
    probes = (jnp.asarray([[B + 0x69, B + 0x68]]), jnp.asarray([[rs, rs]]))
    _, (p_dist, p_on) = model.store_dists(jnp.asarray(table), tok, seg, probes, widths=sharp)
    assert np.asarray(p_on)[0].tolist() == [True, True]
    assert np.asarray(p_dist)[0, 0, 0x05] == pytest.approx(1.0)
    np.testing.assert_allclose(np.asarray(p_dist)[0, 1], want2, atol=1e-6)
    wrong = table.copy()
    wrong[row_of(129, 1024), K + 1] += 1  # another destination's row
    (_, on), _ = model.store_dists(jnp.asarray(wrong), tok, seg, widths=sharp)
    assert not np.asarray(on).any()


@pytest.mark.parametrize("bias, stored", [(30.0, True), (-30.0, False)])
def test_the_store_gate_mixes_the_store_into_the_distribution(bias, stored):
    """A gate held open gives the store's distribution where it is on; held shut, the
    model's own (the same as without a store, everywhere). Nothing of the loss's gradient
    reaches the table: it is data, not a parameter to learn."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(ROW), dst_store=1024,
                              context_copy=0.0, copy_aux=0.0, placed_store=0.0)
    off = dataclasses.replace(cfg, dst_store=0, fail_dst=False)
    table, _ = store.build(*planted(), 1024)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    params = {**params, "dst_store": jnp.asarray(table), "store_gate": params["store_gate"] * 0,
              "store_bias": jnp.float32(bias), "store_width": jnp.full(2, -40.0)}
    tok, seg = jnp.asarray([ROW]), jnp.ones((1, len(ROW)), jnp.int32)
    lp = np.asarray(jax.nn.log_softmax(model.forward(params, tok, seg, cfg)))[0]
    own = np.asarray(jax.nn.log_softmax(model.forward(
        {k: v for k, v in params.items() if k not in ("dst_store",) and not k.startswith("store_")},
        tok, seg, off)))[0]
    rs = 5 * 16 - 2 + 11
    if stored:
        assert np.exp(lp[rs, B + 0x68]) == pytest.approx(0.75, abs=1e-4)
        assert np.exp(lp[rs, B + 0x69]) == pytest.approx(0.25, abs=1e-4)
        np.testing.assert_allclose(lp[:11], own[:11], atol=1e-5)
    else:
        np.testing.assert_allclose(lp, own, atol=1e-5)
    batch = {"tokens": tok, "segment_ids": seg}
    g = jax.grad(lambda p: model.loss_sum(p, batch, cfg)[0])(params)
    assert not np.asarray(g["dst_store"]).any()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    if stored:
        assert abs(float(g["store_bias"])) > 0


def test_the_store_answers_only_where_the_context_holds_no_reply():
    """With the context copy on, the store is mixed in only where the context holds no
    earlier reply to the destination (there the copy answers): with both gates held open,
    the first .129 reply's first byte is the store's distribution, and the last one's is the
    copy's (its three earlier replies: 0x68 0.7, 0x69 0.3), untouched by the store."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(ROW), dst_store=1024,
                              placed_store=0.0)
    table, _ = store.build(*planted(), 1024)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    params = {**params, "dst_store": jnp.asarray(table), "store_gate": params["store_gate"] * 0,
              "store_bias": jnp.float32(30.0), "store_width": jnp.full(2, -40.0),
              "copy_gate": params["copy_gate"] * 0, "copy_bias": jnp.float32(30.0),
              "copy_width": jnp.full(2, -40.0)}
    tok, seg = jnp.asarray([ROW]), jnp.ones((1, len(ROW)), jnp.int32)
    p = np.exp(np.asarray(jax.nn.log_softmax(model.forward(params, tok, seg, cfg)))[0])
    first, later = 11, 5 * 16 - 2 + 11  # the RTT_STARTs of the first and the last .129 reply
    assert p[first, B + 0x68] == pytest.approx(0.75, abs=1e-4)
    assert p[first, B + 0x69] == pytest.approx(0.25, abs=1e-4)
    assert p[later, B + 0x68] == pytest.approx(0.7, abs=1e-4)
    assert p[later, B + 0x69] == pytest.approx(0.3, abs=1e-4)


def test_a_new_model_starts_with_an_empty_store():
    cfg = dataclasses.replace(arch.MODELS["small"], dst_store=256)
    params = model.init_params(cfg, 0)
    assert params["dst_store"].shape == (256, K + 2) and not params["dst_store"].any()
    assert not arch.decay_mask(cfg)["dst_store"]
    with pytest.raises(ValueError, match="dst_store must be 0 or a power of two"):
        dataclasses.replace(cfg, dst_store=1000)


@pytest.mark.parametrize("by_source", [False, True])
def test_a_run_fills_its_store_from_the_train_split_and_keeps_it(tmp_path, monkeypatch, capsys,
                                                                 by_source):
    """`train` with a store fills it from the train split before the first step (one line
    says what it holds), never learns it, and the run's checkpoint holds exactly what
    store.build makes of the train rows: `train eval` and `train predict` read it there. The
    pair store, which no train reply would find its reverse pair in here, is off for the
    run, in its config.json, and on resuming it."""
    from prep.tools import synthetic_shards as synthetic
    from train.fit.config import TrainConfig
    from train.fit.loop import train
    from train.predict import predictor

    L = 128
    tok = np.zeros((ROWS, L), np.uint16)
    seg = np.zeros((ROWS, L), np.uint8)
    tok[:, :len(ROW)], seg[:, :len(ROW)] = ROW, 1
    d = tmp_path / "shards"
    synthetic.write_shards(d, {"train": (tok, seg), "test": (tok[:2], seg[:2])})
    monkeypatch.setitem(arch.MODELS, "small", dataclasses.replace(
        arch.MODELS["small"], dst_store=1024, krig_store=256, store_by_source=by_source,
        store_without_fold=False, pair_forward=0, pair_recent=0,
        pair_fail=False))  # (ROW has no absolute time)
    run = tmp_path / "run"
    train(TrainConfig(model="small", data=str(d), run_dir=str(run), steps=3, batch_size=2,
                      lr=3e-3, warmup=1, log_every=1, eval_every=0, ckpt_every=0))
    err = capsys.readouterr().err
    assert ("destination store: 1 of 3 destinations (>= 32 replies each) from 70 train "
            "replies" + (", quantiles over 3 (destination, source) medians\n" if by_source
                         else "\n")) in err
    # probes pinging a target that never pings back: no reverse pair, the pair store off
    assert ("pair store: 3 of 3 address pairs (>= 4 replies each) from 70 train replies; 0 "
            "train replies have their reverse pair there (none: its reverse read answers "
            "nothing on this data), 70 their own pair\npair store: off for this run (no "
            "train reply has its reverse pair, so nothing would teach its gate)") in err
    want, _ = store.build(tok, seg, 1024, by_source=by_source)
    krig, noise, summary = store.build_krig(tok, seg, 256, want)
    assert summary.line() in err and (summary.pairs, summary.placed, summary.sources) == (1, 1, 1)
    loaded = predictor.load(str(run))
    np.testing.assert_array_equal(np.asarray(loaded.params["dst_store"]), want)
    np.testing.assert_array_equal(np.asarray(loaded.params["krig_store"]), krig)
    assert np.asarray(loaded.params["krig_noise"]).tolist() == [np.float32(noise)]
    assert not any(k.startswith("pair_") for k in loaded.params)
    assert json.loads((run / "config.json").read_text())["model"]["pair_store"] == 0
    # P(failed)'s start (context_fail_anchor): the rule fit on the train rows' results, as
    # the log line says; 3 steps of Adam at 3e-3 move each constant less than 0.01
    from train.model import failprior
    counts, fails = model.result_fail_counts(tok, seg)
    assert (len(fails), fails.sum()) == (8 * ROWS, ROWS)  # ROW's 8 results, one failed
    prior = failprior.fit_counts(counts, fails, fails.mean(), live_share=False)
    assert (f"P(failed) starts at the rule that fits the train rows' {len(fails):,} results "
            f"best: their rate {fails.mean():.3f} over {prior.context:g} pseudo-pings") in err
    np.testing.assert_allclose(np.asarray(loaded.params["fanchor"]), failprior.anchor_start(
        prior, fails.mean(), arch.MODELS["small"].context_fail), atol=0.01)
    # and its priors by destination (fail_dst), beside the destination store's rows
    table, line = store.fail_offsets(tok, seg, want)
    assert line in err and "at 1 of 3 destinations (those with a store row)" in line
    np.testing.assert_array_equal(np.asarray(loaded.params["fail_dst"]), table)
    # and a resume keeps it off (its checkpoint has no pair store to restore), under a
    # `small` that has since gained a read the run began without (config.json decides)
    monkeypatch.setitem(arch.MODELS, "small", dataclasses.replace(
        arch.MODELS["small"], pair_forward=8))
    train(TrainConfig(model="small", data=str(d), run_dir=str(run), steps=4, batch_size=2,
                      lr=3e-3, warmup=1, log_every=1, eval_every=0, ckpt_every=0,
                      resume=True))
    assert "resumed" in capsys.readouterr().err
    assert not any(k.startswith("pair_") for k in predictor.load(str(run)).params)


# --- the pair store: the train split's replies by ordered address pair, read at a
# measurement's reverse pair ------------------------------------------------------------

def ping(src_last, dst_last, b1, b2, net=10):
    """One IPv4 measurement <net>.0.0.<src_last> -> <net>.0.0.<dst_last> (two nodes of a
    latency matrix; 10: addresses hosts share, as a NAT's), its reply's RTT code bytes b1 b2,
    then a one-byte time delta."""
    return [V.MEASUREMENT_START, V.SRC_IPV4, B + net, B + 0, B + 0, B + src_last, V.DST_IPV4,
            B + net, B + 0, B + 0, B + dst_last, V.RTT_START, B + b1, B + b2,
            V.TIMESTAMP_DELTA1, B + 240]


# node 1 pings node 2 (codes 0x5010, 0x5020, 0x5110, 0x5030) and node 3 (0x7000); 10 rows:
# 40 replies of (1, 2), 10 of (1, 3)
PAIR_ROW = (ping(1, 2, 0x50, 0x10) + ping(1, 2, 0x50, 0x20) + ping(1, 2, 0x51, 0x10)
            + ping(1, 3, 0x70, 0x00) + ping(1, 2, 0x50, 0x30))
# a held-out node 2's context: it pings node 1 (whose pings to it are stored), node 3 (no
# stored pair), and node 1 again
ASK = ping(2, 1, 0x52, 0x00) + ping(2, 3, 0x52, 0x00) + ping(2, 1, 0x50, 0x20)


def test_the_pair_store_reads_the_replies_of_the_reverse_pair():
    """Node 2's pings to node 1 read the quantiles of node 1's 40 pings to node 2 (first
    byte 0x50 three in four, 0x51 one in four; after 0x50: 0x10, 0x20, 0x30 a third each);
    its ping to node 3 reads nothing (no ping of 3 to 2 stored), nor would node 1's own pings
    to node 2 (their reverse is not stored). A store by destination holds none of this:
    node 1's row there is empty."""
    table, summary = store.build(np.asarray([PAIR_ROW] * 10, np.uint16),
                                 np.ones((10, len(PAIR_ROW)), np.uint8), 1024, key="pair")
    assert summary == store.StoreSummary(2, 1, 50, 0, "pair", answered=0, own=40)
    tok, seg = jnp.asarray([ASK + PAIR_ROW]), jnp.ones((1, len(ASK + PAIR_ROW)), jnp.int32)
    sharp = (1e-3, 1e-3)
    keys = model.pair_keys(tok, seg)
    (dist, on), _ = model.store_dists(jnp.asarray(table), tok, seg, widths=sharp, keys=keys)
    dist, on = np.asarray(dist)[0], np.asarray(on)[0]
    first, again = 11, 32 + 11  # the RTT_STARTs of node 2's pings to node 1
    # (the first one's second byte is off: no stored quantile has its first byte, 0x52)
    assert sorted(np.flatnonzero(on)) == [first, again, again + 1]
    want1 = np.zeros(256)
    want1[0x50], want1[0x51] = 0.75, 0.25
    np.testing.assert_allclose(dist[first], want1, atol=1e-6)
    want2 = np.zeros(256)
    want2[[0x10, 0x20, 0x30]] = 1 / 3
    np.testing.assert_allclose(dist[again + 1], want2, atol=1e-6)
    by_dst, _ = store.build(np.asarray([PAIR_ROW] * 10, np.uint16),
                            np.ones((10, len(PAIR_ROW)), np.uint8), 1024)
    (_, on_dst), _ = model.store_dists(jnp.asarray(by_dst), tok, seg, widths=sharp)
    assert not np.asarray(on_dst)[0, :48].any()  # node 1 as a destination: no replies


def test_the_pair_store_counts_the_train_replies_it_answers():
    """Where node 2 pings node 1 as well (40 replies each way), each direction's replies find
    the other's row: 80 answered; node 1's 10 pings to node 3 find none."""
    both = PAIR_ROW + ping(2, 1, 0x52, 0x00) * 4
    _, summary = store.build(np.asarray([both] * 10, np.uint16),
                             np.ones((10, len(both)), np.uint8), 1024, key="pair")
    assert summary == store.StoreSummary(3, 2, 90, 0, "pair", answered=80, own=80)
    assert summary.line() == ("pair store: 2 of 3 address pairs (>= 32 replies each) from 90 "
                              "train replies; 80 train replies have their reverse pair there, "
                              "80 their own pair")


def test_the_pair_store_reads_the_real_sources_of_anonymized_rows():
    """Training reads rows with anonymized sources: with the real sources' hashes
    (``src_hash``) the keys are the real rows'; without them, no key is."""
    tok, seg = jnp.asarray([ASK]), jnp.ones((1, len(ASK)), jnp.int32)
    anon = model.anonymize_sources(tok, seg, jnp.int32(7))
    assert not np.array_equal(np.asarray(anon), np.asarray(tok))
    real = model.pair_keys(tok, seg)
    src_hash = model.field_hashes(tok, seg, "src")[0]
    kept = model.pair_keys(anon, seg, src_hash=src_hash)
    lost = model.pair_keys(anon, seg)
    on = np.asarray(real[1])
    assert on.sum() == 3 * 6  # from each destination's last byte (10) to its measurement's end (15)
    np.testing.assert_array_equal(np.asarray(kept[0])[on], np.asarray(real[0])[on])
    assert not (np.asarray(lost[0])[on] == np.asarray(real[0])[on]).any()


def _gate_held_open(row, name, latest=None, **cfg_kw):
    """small with the pair store of PAIR_ROW x 10 alone (no destination store, no copy), the
    gate ``name`` held open and its spreads sharp, run on ``row``: (cfg, params, tokens,
    segment ids, the probabilities, those before the stores). ``latest``: the quantiles of
    the own pair's table (ModelConfig.pair_recent_own's pair_latest), the store's where
    None (PAIR_ROW's pings are all in the latest). Without the anchor (P(failed) from the
    context's counts before a result, tested apart), so the split before a result is the
    layers' and the stores'."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(row), dst_store=0,
                              pair_store=1024, context_copy=0.0, context_fail_anchor=False,
                              fail_dst=False,
                              **cfg_kw)
    table, _ = store.build(np.asarray([PAIR_ROW] * 10, np.uint16),
                           np.ones((10, len(PAIR_ROW)), np.uint8), 1024, key="pair",
                           failures=cfg.pair_fail)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    params = {**params, "pair_store": jnp.asarray(table), f"{name}_bias": jnp.float32(30.0),
              f"{name}_width": jnp.full(2, -40.0)}
    if "pair_latest" in params:
        own = table[:, :K + 2].copy()
        if latest is not None:
            own[:, :K] = np.where(own[:, K:K + 1] > 0, latest, 0)
        params["pair_latest"] = jnp.asarray(own)
    tok, seg = jnp.asarray([row]), jnp.ones((1, len(row)), jnp.int32)
    logits, own = model.forward(params, tok, seg, cfg, own=True)
    return (cfg, params, tok, seg,
            *(np.exp(np.asarray(jax.nn.log_softmax(x)))[0] for x in (logits, own)))


def test_the_pair_gate_mixes_the_reverse_pair_in():
    """The pair store's gate held open: node 2's first ping to node 1 is answered by node
    1's pings to node 2, through forward as through the loss; its ping to node 3 keeps the
    model's own distribution. The table gets no gradient; the gate's bias does."""
    cfg, params, tok, seg, p, p_own = _gate_held_open(ASK, "pair")
    assert p[11, B + 0x50] == pytest.approx(0.75, abs=1e-4)
    assert p[11, B + 0x51] == pytest.approx(0.25, abs=1e-4)
    np.testing.assert_allclose(p[16 + 11], p_own[16 + 11], atol=1e-6)  # node 3: nothing stored
    batch = {"tokens": tok, "segment_ids": seg}
    g = jax.grad(lambda q: model.loss_sum(q, batch, cfg)[2])(
        {**params, "pair_bias": jnp.float32(0.0)})
    assert not np.asarray(g["pair_store"]).any()
    assert abs(float(g["pair_bias"])) > 0


def test_a_fold_of_the_sources_is_whole_contexts_by_their_address():
    """ModelConfig.gate_fold's fold: a context is in it or not as a whole, by its source
    address (the same source in two rows decides alike), never on padding; of 64 planted
    sources 10.0.0.1-64, 17 fall in a fold of 4."""
    def ctx(src):  # two replies from 10.0.0.<src>
        r = reply(0x68, 0x20)
        r[5] = B + src
        return r + r
    n = len(ctx(1))
    srcs = np.arange(1, 65).reshape(16, 4)
    tok = np.asarray([sum((ctx(s) for s in row), []) + [0] * 8 for row in srcs])
    seg = np.asarray([[i + 1 for i in range(4) for _ in range(n)] + [0] * 8] * 16)
    fold = np.asarray(model.source_fold(jnp.asarray(tok), jnp.asarray(seg), 4))
    assert not fold[:, -8:].any()
    per_ctx = fold[:, :4 * n].reshape(16, 4, n)
    assert (per_ctx == per_ctx[..., :1]).all()  # whole contexts
    chosen = per_ctx[..., 0]
    assert chosen.sum() == 17
    # what the fold keeps from the model: the positions that predict its RTT bytes (after
    # RTT_START and after the first byte: 11, 12, 27, 28 of a context), nothing else
    at = np.asarray(model.fold_targets(jnp.asarray(tok), jnp.asarray(seg), 4))
    assert at.sum() == 4 * 17
    np.testing.assert_array_equal(np.flatnonzero(at[:, :4 * n].reshape(64, n).any(0)),
                                  [11, 12, 27, 28])
    assert not (at & ~fold).any()
    again = np.asarray(model.source_fold(jnp.asarray(tok[::-1].copy()), jnp.asarray(seg), 4))
    np.testing.assert_array_equal(again[:, :4 * n].reshape(16, 4, n)[..., 0], chosen[::-1])
    with pytest.raises(ValueError, match="gate_fold must be 0"):
        dataclasses.replace(arch.MODELS["small"], gate_fold=1)


def test_the_fold_trains_the_store_gate_and_nothing_else():
    """With ``fold`` (ModelConfig.gate_fold), the logits are the same, but the gradient
    is routed: the fold's tokens reach the stores' gates (and their spreads: the store's
    and the placed store's) alone, the other tokens everything but the gates."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(ROW), dst_store=1024,
                              pair_store=0, pair_forward=0, pair_fail=False)
    table, _ = store.build(*planted(), 1024)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    params = {**params, "dst_store": jnp.asarray(table)}
    tok, seg = jnp.asarray([ROW, ROW]), jnp.ones((2, len(ROW)), jnp.int32)
    batch = {"tokens": tok, "segment_ids": seg}
    np.testing.assert_array_equal(
        model.forward(params, tok, seg, cfg),
        model.forward(params, tok, seg, cfg, fold=jnp.asarray([[True], [False]]) & (seg > 0)))

    def grads(fold):
        b = batch if fold is None else {**batch, "fold": jnp.broadcast_to(fold, seg.shape)}
        g = jax.grad(lambda p: model.loss_sum(p, b, cfg)[2])(params)
        return {k: sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(v))
                for k, v in g.items() if k != "dst_store"}

    gate = {f"{s}_{p}" for s in ("store", "placed") for p in ("gate", "bias", "width")}
    every, fold, rest = grads(None), grads(jnp.asarray(True)), grads(jnp.asarray(False))
    assert all(v > 0 for k, v in every.items() if k in gate)
    assert {k for k, v in fold.items() if v > 0} == gate
    assert all(fold[f"{s}_{p}"] > 0 for s in ("store", "placed") for p in ("gate", "bias"))
    assert all(rest[f"{s}_{p}"] == 0 for s in ("store", "placed") for p in ("gate", "bias"))
    assert all(rest[k] > 0 for k in ("embed", "copy_gate", "store_width", "placed_width"))


# --- the pair store read at a measurement's own pair (ModelConfig.pair_forward) -----------

def _contexts(srcs, variants):
    """One context per (source, variant): two replies from 10.0.0.<src> to 193.0.14.129,
    the second's time delta byte the variant (so each context's tokens are its own)."""
    out = []
    for src in srcs:
        for v in variants:
            r1, r2 = reply(0x68, 0x20), reply(0x68, 0x30)
            r1[5] = r2[5] = B + src
            r2[-1] = B + v
            out.append(r1 + r2)
    return out


def test_a_fold_of_the_contexts_is_whole_contexts_by_their_tokens():
    """pair_forward's fold: a context is in it or not as a whole, by its tokens (the same
    context in another row and place decides alike), never on padding, and a probe's
    contexts fall in it one by one: of 4 sources x 16 contexts, 12 fall in a fold of 4,
    and each source has contexts in it and out of it."""
    ctxs = _contexts([1, 2, 3, 4], range(16))
    n = len(ctxs[0])
    tok = np.asarray([sum(ctxs[4 * i:4 * i + 4], []) + [0] * 8 for i in range(16)])
    seg = np.asarray([[i + 1 for i in range(4) for _ in range(n)] + [0] * 8] * 16)
    fold = np.asarray(model.context_fold(jnp.asarray(tok), jnp.asarray(seg), 4))
    assert not fold[:, -8:].any()
    per_ctx = fold[:, :4 * n].reshape(16, 4, n)
    assert (per_ctx == per_ctx[..., :1]).all()  # whole contexts
    chosen = per_ctx[..., 0].reshape(64)  # context c: source c // 16 + 1, variant c % 16
    assert chosen.sum() == 12
    by_source = chosen.reshape(4, 16)
    assert by_source.any(1).all() and not by_source.all(1).any()
    # the same contexts, the rows and the contexts within them in reverse order
    flipped = np.asarray([sum(ctxs[4 * i:4 * i + 4][::-1], []) + [0] * 8
                          for i in range(16)][::-1])
    again = np.asarray(model.context_fold(jnp.asarray(flipped), jnp.asarray(seg), 4))
    np.testing.assert_array_equal(again[:, :4 * n].reshape(16, 4, n)[..., 0][::-1, ::-1].reshape(64),
                                  chosen)
    # where its read is trained: the positions that predict the fold's RTT bytes
    at = np.asarray(model.pair_fold_targets(jnp.asarray(tok), jnp.asarray(seg), 4))
    assert at.sum() == 6 * 12 and not (at & ~fold).any()  # 2 results, 4 RTT bytes a context
    with pytest.raises(ValueError, match="pair_forward must be 0"):
        dataclasses.replace(arch.MODELS["small"], pair_forward=1)
    with pytest.raises(ValueError, match="pair_forward reads the pair store"):
        dataclasses.replace(arch.MODELS["small"], pair_store=0)


def test_the_pair_store_leaves_out_the_contexts_of_its_fold():
    """Built with ``pair_fold``, the pair store holds the replies of the contexts outside
    that fold only: of 64 contexts of 2 replies each, 12 are in a fold of 4 (the test
    above), so 104 replies of the pair (10.0.0.<s>, 193.0.14.129) for 4 sources remain."""
    ctxs = _contexts([1, 2, 3, 4], range(16))
    n = len(ctxs[0])
    tok = np.asarray([sum(ctxs[4 * i:4 * i + 4], []) for i in range(16)], np.uint16)
    seg = np.asarray([[i + 1 for i in range(4) for _ in range(n)]] * 16, np.uint8)
    _, whole = store.build(tok, seg, 1024, key="pair")
    _, kept = store.build(tok, seg, 1024, key="pair", pair_fold=4)
    assert (whole.replies, kept.replies) == (128, 128 - 2 * 12)
    fold = np.asarray(model.context_fold(jnp.asarray(tok), jnp.asarray(seg), 4))
    out = (~fold[:, :4 * n].reshape(16, 4, n)[..., 0]).reshape(4, 16).sum(1)  # by source
    assert kept.usable == int((2 * out >= arch.STORE_MIN).sum())
    with pytest.raises(ValueError, match="pair_fold is for the pair store"):
        store.build(tok, seg, 1024, pair_fold=4)


# node 1's context: a ping to node 3, then one to node 2, whose 40 replies from node 1 are
# stored (PAIR_ROW); node 2 never pings node 1, so the reverse read has nothing for it
OWN = ping(1, 3, 0x70, 0x00) + ping(1, 2, 0x52, 0x00)


def test_the_pair_store_read_at_the_own_pair():
    """The forward read's gate held open: node 1's ping to node 2 reads the quantiles of
    node 1's 40 stored pings to node 2 (first byte 0x50 three in four, 0x51 one in four);
    its ping to node 3 (10 replies, too few) reads nothing. With ``pair_fold`` (training)
    it reads only there, and its gate learns from there alone."""
    cfg, params, tok, seg, p, p_own = _gate_held_open(OWN, "fwd", pair_forward=8)
    at = 16 + 11  # the RTT_START of the ping to node 2
    assert p[at, B + 0x50] == pytest.approx(0.75, abs=1e-4)
    assert p[at, B + 0x51] == pytest.approx(0.25, abs=1e-4)
    np.testing.assert_allclose(p[11], p_own[11], atol=1e-6)  # node 3: too few stored
    # keys: the own pair's, from the real sources where the rows are anonymized
    anon = model.anonymize_sources(tok, seg, jnp.int32(3))
    src_hash = model.field_hashes(tok, seg, "src")[0]
    real = model.pair_keys(tok, seg, reverse=False)
    kept = model.pair_keys(anon, seg, src_hash=src_hash, reverse=False)
    on = np.asarray(real[1])
    np.testing.assert_array_equal(np.asarray(kept[0])[on], np.asarray(real[0])[on])
    # training: read only on the pair fold's positions, and its gate learns there alone
    none = jnp.zeros(tok.shape, bool)
    off = model.forward(params, tok, seg, cfg, pair_fold=none)
    np.testing.assert_allclose(np.exp(np.asarray(jax.nn.log_softmax(off)))[0], p_own, atol=1e-5)
    fold = jnp.zeros(tok.shape, bool).at[0, at:at + 2].set(True)
    batch = {"tokens": tok, "segment_ids": seg}
    open_ = {**params, "fwd_bias": jnp.float32(0.0)}
    grad = lambda b: jax.grad(lambda q: model.loss_sum(q, b, cfg)[2])(open_)
    g_in, g_out = grad({**batch, "pair_fold": fold}), grad({**batch, "pair_fold": none})
    assert abs(float(g_in["fwd_bias"])) > 0 and float(g_out["fwd_bias"]) == 0
    assert not np.asarray(g_in["pair_store"]).any()
    assert np.abs(np.asarray(g_out["embed"])).sum() > 0


def test_with_pair_recent_own_the_own_pair_reads_the_latest_table():
    """ModelConfig.pair_recent_own (small's): the read at the own pair takes its quantiles
    from pair_latest (planted: every stored pair's 64 at 0x6000), the read at the reverse
    pair from the pair store (node 1's pings to node 2: 0x50 three in four, 0x51 one in
    four); without it both read the pair store."""
    planted = np.full(K, 0x6000, np.float32)
    at = 16 + 11  # OWN's RTT_START of the ping to node 2
    _, _, _, _, p, _ = _gate_held_open(OWN, "fwd", latest=planted)
    assert p[at, B + 0x60] == pytest.approx(1.0, abs=1e-4)
    _, params, _, _, p, _ = _gate_held_open(OWN, "fwd", latest=planted, pair_recent_own=False)
    assert "pair_latest" not in params
    assert p[at, B + 0x50] == pytest.approx(0.75, abs=1e-4)
    _, _, _, _, p, _ = _gate_held_open(ASK, "pair", latest=planted)  # the reverse pair
    assert p[11, B + 0x50] == pytest.approx(0.75, abs=1e-4)
    assert p[11, B + 0x51] == pytest.approx(0.25, abs=1e-4)
    assert arch.MODELS["small"].pair_recent_own
    for kw in ({"pair_recent": 0}, {"pair_forward": 0, "pair_fail": False}):  # unread
        cfg = dataclasses.replace(arch.MODELS["small"], **kw)
        assert cfg.pair_recent_own and not cfg.own_latest
        assert "pair_latest" not in arch.param_specs(cfg)


def test_a_run_keeps_the_own_pair_read_where_no_reverse_pair_is(tmp_path, monkeypatch, capsys):
    """Probes pinging a target that never pings back: the pair store's reverse read is off
    for the run, its read at the own pair stays (config.json says both), the store is built
    without the pair fold's contexts (and with the gate fold's probes, whose pairs a test
    query may ask for), and a resume continues so."""
    from prep.tools import synthetic_shards as synthetic
    from train.fit.config import TrainConfig
    from train.fit.loop import train
    from train.predict import predictor

    ctxs = _contexts([1, 2, 3, 4], range(40))  # 80 replies a source
    n = len(ctxs[0])
    tok = np.asarray([sum(ctxs[4 * i:4 * i + 4], []) for i in range(40)], np.uint16)
    seg = np.asarray([[i + 1 for i in range(4) for _ in range(n)]] * 40, np.uint8)
    d = tmp_path / "shards"
    synthetic.write_shards(d, {"train": (tok, seg), "test": (tok[:2], seg[:2])})
    # (pair_recent and pair_fail_recent 0: these rows' delta timestamps have no absolute one
    # before them, which the decoder that times the pings refuses; the tests below time them)
    monkeypatch.setitem(arch.MODELS, "small", dataclasses.replace(
        arch.MODELS["small"], dst_store=1024, pair_store=1024, pair_forward=8, pair_recent=0,
        pair_fail_recent=0))
    run = tmp_path / "run"
    cfg = dict(model="small", data=str(d), run_dir=str(run), steps=2, batch_size=2, lr=3e-3,
               warmup=1, log_every=1, eval_every=0, ckpt_every=0)
    train(TrainConfig(**cfg))
    err = capsys.readouterr().err
    want, summary = store.build(tok, seg, 1024, key="pair", pair_fold=8, min_count=4,
                                failures=True)
    assert (summary.usable, summary.answered, summary.own) == (4, 0, summary.replies)
    assert ("pair store: built without 1 context in 8 (by context) instead, on which its "
            "read at a measurement's own pair learns") in err
    assert summary.line() + ("\npair store: its read at the reverse pair is off for this run "
                             "(no train reply has its reverse pair, so nothing would teach "
                             "its gate); it is read at a measurement's own pair") in err
    model_saved = json.loads((run / "config.json").read_text())["model"]
    assert (model_saved["pair_store"], model_saved["pair_reverse"],
            model_saved["pair_forward"]) == (1024, False, 8)
    loaded = predictor.load(str(run))
    np.testing.assert_array_equal(np.asarray(loaded.params["pair_store"]), want)
    assert {"fwd_gate", "fwd_bias", "fwd_width"} <= set(loaded.params)
    train(TrainConfig(**{**cfg, "steps": 3}, resume=True))
    assert "resumed" in capsys.readouterr().err
    assert not predictor.load(str(run)).mcfg.pair_reverse


def timed(src_last, dst_last, b1, b2, when=None, net=10):
    """``ping``, its time block ("abs", Unix seconds: 8 bytes; "d1", seconds: 1 byte) or
    none (a measurement that lost its timestamp)."""
    head = ping(src_last, dst_last, b1, b2, net)[:14]
    if when is None:
        return head
    kind, t = when
    if kind == "abs":
        return head + [V.TIMESTAMP_ABS] + [B + b for b in int(t).to_bytes(8, "big")]
    return head + [V.TIMESTAMP_DELTA1, B + t]


# row 0: a context of node 1's pings to node 2 at 1,000 s (0x5010), 1,010 s (0x5020) and
# one that lost its timestamp (0x5110: its context's latest, 1,010 s), then a context with
# no timestamps (two of 0x6000); row 1: a context at 2,000 s (0x5030) and 2,005 s (0x5040),
# and a ping to node 3 at 2,005 s (0x7000)
TIMED_ROWS = [
    [timed(1, 2, 0x50, 0x10, ("abs", 1000)) + timed(1, 2, 0x50, 0x20, ("d1", 10))
     + timed(1, 2, 0x51, 0x10),
     timed(1, 2, 0x60, 0x00) + timed(1, 2, 0x60, 0x00)],
    [timed(1, 2, 0x50, 0x30, ("abs", 2000)) + timed(1, 2, 0x50, 0x40, ("d1", 5))
     + timed(1, 3, 0x70, 0x00)]]


def _timed_rows(rows=None):
    """Packed rows of ``rows`` (TIMED_ROWS): a list of contexts (token lists) per row."""
    rows = TIMED_ROWS if rows is None else rows
    width = max(sum(map(len, r)) for r in rows)
    tok = np.zeros((len(rows), width), np.uint16)
    seg = np.zeros((len(rows), width), np.uint8)
    for i, row in enumerate(rows):
        at = 0
        for k, ctx in enumerate(row):
            tok[i, at:at + len(ctx)], seg[i, at:at + len(ctx)] = ctx, k + 1
            at += len(ctx)
    return tok, seg


def test_each_reply_is_timed_by_its_timestamp_or_its_contexts_latest():
    """reply_times: at each RTT_START (and FAILED), the ping's own time; the one that lost its
    timestamp takes its context's latest (1,010 s), a context without timestamps -1, and
    every other position -1."""
    tok, seg = _timed_rows()
    t, refused = store.reply_times(tok, seg)
    at = {(int(r), int(c)): int(t[r, c]) for r, c in zip(*np.nonzero(t >= 0))}
    assert refused == 0
    assert at == {(0, 11): 1000, (0, 34): 1010, (0, 50): 1010,
                  (1, 11): 2000, (1, 34): 2005, (1, 50): 2005}
    assert (tok[t >= 0] == V.RTT_START).all()
    rtt = np.flatnonzero(tok[0] == V.RTT_START)
    assert rtt.tolist() == [11, 34, 50, 64, 78] and (t[0, [64, 78]] == -1).all()
    # a row the decoder refuses (a delta timestamp first) in front: its replies untimed,
    # counted, and the others' times as before, a row further on
    bad = np.asarray([(reply(0x68, 0x20) * 8)[:tok.shape[1]]], np.uint16)
    t2, refused = store.reply_times(np.concatenate([bad, tok]),
                                    np.concatenate([np.ones_like(bad, np.uint8), seg]))
    assert refused == 1 and (t2[0] == -1).all()
    np.testing.assert_array_equal(t2[1:], t)
    # a failed ping is timed at its FAILED: 3,000 s, then 240 s later
    row = np.asarray([timed(1, 2, 0x50, 0x10, ("abs", 3000)) + failed(1, 2)], np.uint16)
    t3, refused = store.reply_times(row, np.ones_like(row, np.uint8))
    assert refused == 0 and {int(row[0, c]): int(t3[0, c]) for c in np.flatnonzero(
        t3[0] >= 0)} == {V.RTT_START: 3000, V.FAILED: 3240}
    _, summary = store.build(np.concatenate([bad, tok]),
                             np.concatenate([np.ones_like(bad, np.uint8), seg]), 1024,
                             key="pair", min_count=1, recent=3)
    assert summary.untimed_rows == 1 and (
        "quantiles over each pair's latest 3 replies (1 row that `prep shards` would not "
        "write: their replies untimed)") in summary.line()


def test_the_pair_store_holds_each_pairs_latest_replies():
    """``recent`` 3: node 1's 7 replies to node 2, in time order the two untimed (-1), then
    1,000 s, 1,010 s twice (row order), 2,000 s and 2,005 s, keep their latest three
    (0x5110, 0x5030, 0x5040) as quantiles; the count is all 7. ``recent`` 0: all 7."""
    tok, seg = _timed_rows()
    pair = lambda s, d: int(model.pair_key(jnp.int32(_node_hash(s)), jnp.int32(_node_hash(d))))
    for recent, codes in ((3, [0x5030, 0x5040, 0x5110]),
                          (0, [0x5010, 0x5020, 0x5030, 0x5040, 0x5110, 0x6000, 0x6000])):
        table, summary = store.build(tok, seg, 1024, key="pair", min_count=1, recent=recent)
        r, ok = (np.asarray(x) for x in model._store_row(jnp.asarray(table),
                                                         jnp.int32(pair(1, 2)), 1))
        assert ok and r[K] == 7
        n = len(codes)
        want = [codes[min(int((k + 0.5) / K * n), n - 1)] for k in range(K)]
        assert r[:K].astype(int).tolist() == want
        assert (summary.usable, summary.replies, summary.recent) == (2, 8, recent)
    assert summary.line().endswith("8 train replies; 0 train replies have their reverse pair "
                                   "there (none: its reverse read answers nothing on this "
                                   "data), 8 their own pair")
    table, summary = store.build(tok, seg, 1024, key="pair", min_count=1, recent=3)
    assert ", quantiles over each pair's latest 3 replies;" in summary.line()
    with pytest.raises(ValueError, match="recent is a count of a pair's latest replies"):
        store.build(tok, seg, 1024, recent=3)
    with pytest.raises(ValueError, match="pair_recent must be 0"):
        dataclasses.replace(arch.MODELS["small"], pair_recent=-1)
    assert arch.MODELS["small"].pair_recent == 8


def test_a_run_builds_its_pair_store_from_each_pairs_latest_replies(tmp_path):
    """The run's stores (train.fit.loop) pass ModelConfig.pair_recent (with pair_recent_own,
    to a second table: small's), pair_fail_recent and
    pair_shared (small's False: row 0's pings from 10.0.0.1 are not stored, row 1's, made
    203.0.0.1's, are) to the build."""
    from prep.tools import synthetic_shards as synthetic
    from train.fit import loop

    tok, seg = _timed_rows()
    tok[1] = np.where(tok[1] == B + 10, B + G, tok[1])
    d = tmp_path / "shards"
    manifest = synthetic.write_shards(d, {"train": (tok, seg), "test": (tok[:1], seg[:1])})
    mcfg = dataclasses.replace(arch.MODELS["small"], dst_store=1024, pair_store=1024,
                               pair_forward=2, pair_min=1, pair_recent=1, gate_fold=0,
                               store_without_fold=False, placed_store=0.0)
    build = functools.partial(store.build, tok, seg, 1024, key="pair", pair_fold=2,
                              min_count=1, failures=True, fail_recent=16, without_shared=True)
    latest, summary = build(recent=1)
    every, every_summary = build()
    assert (summary.usable, summary.left_out, summary.recent, summary.fail_recent) == (
        2, 1, 1, 16)
    assert not np.array_equal(latest[:, :K], every[:, :K])  # node 1 to 2: 1 of its 2 (out of the fold)
    # small's pair_recent_own: the store over all replies, its latest in a second table
    _, tables, lines = loop._store_tables(mcfg, d, manifest)
    np.testing.assert_array_equal(tables["pair_store"], every)
    np.testing.assert_array_equal(tables["pair_latest"], latest[:, :K + 2])
    assert every_summary.line() in lines
    assert ("pair store: read at a measurement's own pair over each pair's latest 1 reply "
            "(a second table), at the reverse pair over all of them") in lines
    # without it: one table, over the latest
    _, tables, lines = loop._store_tables(
        dataclasses.replace(mcfg, pair_recent_own=False), d, manifest)
    np.testing.assert_array_equal(tables["pair_store"], latest)
    assert "pair_latest" not in tables and summary.line() in lines


def _series(dst, codes, start):
    """One context of node 1's pings to ``dst``, the i-th with ``codes[i]`` at ``start`` +
    10 i seconds."""
    first, *rest = codes
    return (timed(1, dst, first >> 8, first & 255, ("abs", start))
            + sum((timed(1, dst, c >> 8, c & 255, ("d1", 10)) for c in rest), []))


# (1, 2) drifts: 10 replies of 0x5010 (16,384 us) from 1,000 s, then 10 of 0x5020 (32,768
# us) from 2,000 s, written in the other order (row order is not time order); (1, 4): 4
# replies, too few to tell. (1, 3) scatters: 15 of 0x5010, 3 of 0x5040 (65,536 us), then
# 2 of 0x5010
DRIFT = [[_series(2, [0x5020] * 10, 2000), _series(2, [0x5010] * 10, 1000),
          _series(4, [0x5010] * 4, 1000)]]
SCATTER = [[_series(3, [0x5010] * 15 + [0x5040] * 3 + [0x5010] * 2, 1000)]]


def test_the_recency_check_holds_back_each_pairs_latest_tenth():
    """recency_check with 3: (1, 2)'s latest tenth (two of 0x5020) against the median of
    its 18 earlier replies (0x5010: 0.5 relative error) and of their latest 3 (0x5020: 0);
    (1, 3)'s two of 0x5010 against its earlier median (0x5010: 0) and its latest 3's
    (0x5040: 3.0). A NAT's address (10.0.0.1) left out, no pair tells."""
    drift = store.recency_check(*_timed_rows(DRIFT), 3)
    assert drift == store.RecencyCheck(3, 1, 2, 0.5, 0.0) and drift.latest_better
    assert drift.line() == ("pair store: the median of a pair's latest 3 train replies "
                            "predicts the latest tenth of its replies at 0.000 median relative "
                            "error, of all its earlier ones at 0.500 (1 pair, 2 replies): "
                            "quantiles over its latest 3")
    scatter = store.recency_check(*_timed_rows(SCATTER), 3)
    assert scatter == store.RecencyCheck(3, 1, 2, 0.0, 3.0) and not scatter.latest_better
    assert scatter.line().endswith("at 3.000 median relative error, of all its earlier ones at "
                                   "0.000 (1 pair, 2 replies): quantiles over all of them for "
                                   "this run (pair_recent 0)")
    none = store.recency_check(*_timed_rows(SCATTER), 3, without_shared=True)
    assert (none.pairs, none.latest_better) == (0, True)
    assert "no pair has more than 3 train replies before its latest tenth" in none.line()
    with pytest.raises(ValueError, match="compares a pair's latest replies"):
        store.recency_check(*_timed_rows(SCATTER), 0)


@pytest.mark.parametrize("rows, recent", [(DRIFT, 3), (SCATTER, 0)])
def test_a_run_checks_a_pairs_latest_replies_before_it_stores_them(tmp_path, rows, recent):
    """small's pair_recent_check (train.fit.loop): on drifting RTTs the run keeps
    pair_recent and its own pair's table of the latest; on scattered ones it takes all
    replies for both reads (pair_recent 0 in the config it returns) and says so."""
    from prep.tools import synthetic_shards as synthetic
    from train.fit import loop

    tok, seg = _timed_rows(rows)
    d = tmp_path / "shards"
    manifest = synthetic.write_shards(d, {"train": (tok, seg), "test": (tok, seg)})
    mcfg = dataclasses.replace(arch.MODELS["small"], dst_store=1024, pair_store=1024,
                               pair_forward=3, pair_min=1, pair_recent=3, gate_fold=0,
                               store_without_fold=False, placed_store=0.0, pair_shared=True)
    assert mcfg.pair_recent_check
    got, tables, lines = loop._store_tables(mcfg, d, manifest)
    assert got.pair_recent == recent and ("pair_latest" in tables) == bool(recent)
    check = store.recency_check(tok, seg, 3, pair_fold=3)  # (the fold keeps all)
    assert (check.pairs, check.replies) == (1, 2) and check.line() in lines
    got, _, lines = loop._store_tables(dataclasses.replace(mcfg, pair_recent_check=False), d,
                                       manifest)
    assert got.pair_recent == 3 and check.line() not in lines


def failed(src_last, dst_last, net=10):
    """``ping`` without a reply: FAILED, then a one-byte time delta."""
    return ping(src_last, dst_last, 0, 0, net)[:11] + [V.FAILED, V.TIMESTAMP_DELTA1, B + 240]


# node 1 pings node 2 (3 replies, 1 failure) and node 4 (5 failures, never a reply); x 10
FAIL_ROW = (ping(1, 2, 0x50, 0x10) + failed(1, 2) + ping(1, 2, 0x50, 0x20) + failed(1, 4) * 5
            + ping(1, 2, 0x51, 0x10))
FAIL_ROWS = np.asarray([FAIL_ROW] * 10, np.uint16), np.ones((10, len(FAIL_ROW)), np.uint8)


def _pair(s, d, net=10):
    return jnp.int32(int(model.pair_key(jnp.int32(_node_hash(s, net)),
                                        jnp.int32(_node_hash(d, net)))))


def test_the_pair_store_counts_each_pairs_failed_pings():
    """``failures``: one more column, a pair's failed pings; a pair that never answers (1
    -> 4: 50 failures) takes a row for them (no replies: its quantiles are never read), and
    fail_share is (failed + 1/2) / (pings + 1) where a row holds min_count pings."""
    table, summary = store.build(*FAIL_ROWS, 1024, key="pair", min_count=4, failures=True)
    assert table.shape == (1024, K + 3)
    for (s, d), (replies, fails) in {(1, 2): (30, 10), (1, 4): (0, 50)}.items():
        r, ok = (np.asarray(x) for x in model._store_row(jnp.asarray(table), _pair(s, d), 0))
        assert ok and (r[K], r[K + 2]) == (replies, fails)
        assert r[K + 1] == int(model.store_check(_pair(s, d)))
    assert not model._store_row(jnp.asarray(table), _pair(1, 4), 4)[1]  # no quantiles read
    share, ok = model.fail_share(jnp.asarray(table), jnp.stack([_pair(1, 2), _pair(1, 4),
                                                                 _pair(1, 3)]), 4)
    np.testing.assert_allclose(np.asarray(share)[:2], [10.5 / 41, 50.5 / 51], rtol=1e-6)
    assert np.asarray(ok).tolist() == [True, True, False]
    assert (summary.usable, summary.replies, summary.fails, summary.failing) == (1, 30, 60, 2)
    assert summary.line() == (
        "pair store: 1 of 1 address pairs (>= 4 replies each) from 30 train replies; 2 pairs' "
        "failure rates (>= 4 pings each, 60 failed); 0 train replies have their reverse pair "
        "there (none: its reverse read answers nothing on this data), 30 their own pair")
    plain, _ = store.build(*FAIL_ROWS, 1024, key="pair", min_count=4)
    assert plain.shape == (1024, K + 2) and int((plain[:, K] > 0).sum()) == 1
    with pytest.raises(ValueError, match="failures are counted in the pair store"):
        store.build(*FAIL_ROWS, 1024, failures=True)
    with pytest.raises(ValueError, match="pair_fail's gate learns on pair_forward's fold"):
        dataclasses.replace(arch.MODELS["small"], pair_forward=0)
    assert arch.MODELS["small"].pair_fail and not arch.MODELS["tiny"].pair_fail


# node 1's pings to node 2 (addresses of one host each: 203.0.0.x) in time order: replies at
# 1,000 and 1,490 s with failures at 1,240 and 1,480 s between them (row 1); replies at
# 5,000, 5,245 and 5,250 s, a failure at 5,240 s (row 0: the rows are not in time order)
G = 203
FAIL_TIMED = [[timed(1, 2, 0x50, 0x30, ("abs", 5000), G) + failed(1, 2, G)
               + timed(1, 2, 0x50, 0x40, ("d1", 5), G) + timed(1, 2, 0x50, 0x50, ("d1", 5), G)],
              [timed(1, 2, 0x50, 0x10, ("abs", 1000), G) + failed(1, 2, G) + failed(1, 2, G)
               + timed(1, 2, 0x50, 0x20, ("d1", 10), G)]]


@pytest.mark.parametrize("latest, failed_, share", [(4, 1, 1.5 / 5), (6, 2, 2.5 / 7),
                                                     (100, 3, 3.5 / 9), (0, 3, 3.5 / 9)])
def test_the_pair_store_counts_the_failures_of_each_pairs_latest_pings(latest, failed_, share):
    """``fail_recent``: the failures among the pair's latest 4 pings (5,000 to 5,250 s: 1),
    6 (from 1,480 s: 2), or all 8 (3); its replies all 5 either way, and fail_share over
    min(latest, pings) of them."""
    tok, seg = _timed_rows(FAIL_TIMED)
    table, summary = store.build(tok, seg, 1024, key="pair", min_count=1, failures=True,
                                 fail_recent=latest)
    pair = _pair(1, 2, G)
    r, ok = (np.asarray(x) for x in model._store_row(jnp.asarray(table), pair, 1))
    assert ok and (r[K], r[K + 2]) == (5, failed_)
    got, _ = model.fail_share(jnp.asarray(table), pair, 1, latest)
    np.testing.assert_allclose(float(got), share, rtol=1e-6)
    assert summary.fails == failed_ and summary.line().endswith(
        f"(>= 1 pings each, {failed_} failed"
        + (f" among each pair's latest {latest})" if latest else ")")
        + "; 0 train replies have their reverse pair there (none: its reverse read answers "
        "nothing on this data), 5 their own pair")
    if not latest:
        with pytest.raises(ValueError, match="fail_recent is a count of a pair's latest pings"):
            store.build(tok, seg, 1024, key="pair", fail_recent=4)
        with pytest.raises(ValueError, match="pair_fail_recent must be 0 .all pings. or more"):
            dataclasses.replace(arch.MODELS["small"], pair_fail_recent=-1)
        assert arch.MODELS["small"].pair_fail_recent == 16


def test_a_shared_source_addresss_failures_are_not_read():
    """The same pings from 10.0.0.1 (an address hosts behind NATs share): the pair's
    failures are several probes', so its row says -1 for them and fail_share reads nothing;
    its replies' quantiles stay, and the log line says how many pairs were so left out."""
    tok, seg = _timed_rows(FAIL_TIMED)
    nat = np.where(tok == B + G, B + 10, tok).astype(np.uint16)  # (no other byte is 203)
    assert (nat != tok).sum() == 2 * 8  # (each ping's two addresses)
    table, summary = store.build(nat, seg, 1024, key="pair", min_count=1, failures=True,
                                 fail_recent=4)
    r, ok = (np.asarray(x) for x in model._store_row(jnp.asarray(table), _pair(1, 2), 1))
    assert ok and (r[K], r[K + 2]) == (5, -1)
    assert not bool(model.fail_share(jnp.asarray(table), _pair(1, 2), 1, 4)[1])
    # a row of failures alone (no replies) reads -1 too: its share is still finite, or a
    # gradient through the unread side of a where is NaN (a run stopped so at step 545)
    row = np.zeros((1, K + 3), np.float32)
    row[0, K + 1], row[0, K + 2] = model.store_check(_pair(1, 2)), -1
    share, ok = model.fail_share(jnp.asarray(np.repeat(row, 2, 0)), _pair(1, 2), 0, 4)
    assert np.isfinite(float(share)) and not bool(ok)
    assert (summary.usable, summary.failing, summary.fails, summary.shared) == (1, 0, 0, 1)
    assert ("(>= 1 pings each, 0 failed among each pair's latest 4), not those of 1 pairs whose "
            "source address hosts share (NAT: several probes' failures)") in summary.line()
    # shared_fails (ModelConfig.pair_shared_fail): counted and read as any other pair's
    table, summary = store.build(nat, seg, 1024, key="pair", min_count=1, failures=True,
                                 fail_recent=4, shared_fails=True)
    r, ok = (np.asarray(x) for x in model._store_row(jnp.asarray(table), _pair(1, 2), 1))
    assert ok and (r[K], r[K + 2]) == (5, 1)  # (FAIL_TIMED's latest 4 pings: 1 failed)
    assert bool(model.fail_share(jnp.asarray(table), _pair(1, 2), 1, 4)[1])
    assert (summary.failing, summary.fails, summary.shared) == (1, 1, 0)
    for bad in ({"failures": False, "fail_recent": 0}, {"without_shared": True}):
        with pytest.raises(ValueError, match="shared_fails reads the failures of the pairs"):
            store.build(nat, seg, 1024, key="pair", min_count=1, **({"failures": True,
                        "fail_recent": 4, "shared_fails": True} | bad))


def test_without_shared_a_shared_source_addresss_pairs_are_not_stored():
    """``without_shared`` (ModelConfig.pair_shared False, small's): the pings from 10.0.0.1
    (row 1's, an address hosts behind NATs share) leave no row at all, neither its replies'
    quantiles nor its failures; 203.0.0.1's (row 0: replies 0x5030, 0x5040, 0x5050 and a
    failure) are stored as ever, and the log line names the one pair left out."""
    tok, seg = _timed_rows(FAIL_TIMED)
    tok[1] = np.where(tok[1] == B + G, B + 10, tok[1])  # row 1's pings: 10.0.0.1 -> 10.0.0.2
    with_nat, _ = store.build(tok, seg, 1024, key="pair", min_count=1, failures=True)
    table, summary = store.build(tok, seg, 1024, key="pair", min_count=1, failures=True,
                                 without_shared=True)
    read = lambda t, pair: (np.asarray(x) for x in model._store_row(jnp.asarray(t), pair, 1))
    r, ok = read(table, _pair(1, 2, G))
    assert ok and (r[K], r[K + 2]) == (3, 1)
    third = ((np.arange(K) + 0.5) / K * 3).astype(int)  # quantile k's reply of the three
    assert r[:K].astype(int).tolist() == [[0x5030, 0x5040, 0x5050][j] for j in third]
    assert not bool(list(read(table, _pair(1, 2)))[1])  # not stored
    r, ok = read(with_nat, _pair(1, 2))  # stored, its failures not read (the rule before)
    assert ok and (r[K], r[K + 2]) == (2, -1)
    assert (summary.usable, summary.failing, summary.fails, summary.shared,
            summary.left_out) == (1, 1, 1, 0, 1)
    assert summary.line().startswith(
        "pair store: 1 of 1 address pairs (>= 1 replies each) from 3 train replies, not the 1 "
        "pairs whose source address hosts share (NAT: several probes' pings, none of them a "
        "node's); 1 pairs' failure rates")
    with pytest.raises(ValueError, match="without_shared is for the pair store, not key 'dst'"):
        store.build(tok, seg, 1024, without_shared=True)
    assert not arch.MODELS["small"].pair_shared and arch.MODELS["tiny"].pair_shared


# node 1 pings node 2 (a reply), node 4 (no reply) and node 3 (not stored)
FAIL_ASK = ping(1, 2, 0x50, 0x10) + failed(1, 4) + ping(1, 3, 0x70, 0x00)


def test_the_failure_gate_moves_p_failed_to_the_pairs_share():
    """The failure gate held open: before each result whose pair is stored (the last
    destination byte, 10 and 16 + 10), P(FAILED) / (P(FAILED) + P(RTT_START)) is the pair's
    share, their sum and every other token's probability the model's own; node 3's (30 +
    10) and every other position keep the model's. In training it reads only on the
    forward read's fold, and its gate learns from there alone."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(FAIL_ASK), dst_store=0,
                              pair_store=1024, context_copy=0.0, pair_fail_recent=0,
                              context_fail_anchor=False, fail_dst=False)
    table, _ = store.build(*FAIL_ROWS, 1024, key="pair", min_count=cfg.pair_min, failures=True)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    params = {**params, "pair_store": jnp.asarray(table), "fail_bias": jnp.float32(30.0)}
    tok, seg = jnp.asarray([FAIL_ASK]), jnp.ones((1, len(FAIL_ASK)), jnp.int32)
    before = np.asarray(model.before_result(tok, seg))[0]
    assert np.flatnonzero(before).tolist() == [*range(11), *range(16, 27), *range(30, 41)]
    logits, own = model.forward(params, tok, seg, cfg, own=True)
    p, p_own = (np.exp(np.asarray(jax.nn.log_softmax(x), np.float64))[0] for x in (logits, own))
    F, R = V.FAILED, V.RTT_START
    for at, share in ((10, 10.5 / 41), (16 + 10, 50.5 / 51)):
        assert p[at, F] / (p[at, F] + p[at, R]) == pytest.approx(share, rel=1e-4)
        assert p[at, F] + p[at, R] == pytest.approx(p_own[at, F] + p_own[at, R], rel=1e-5)
        rest = np.ones(p.shape[1], bool)
        rest[[F, R]] = False
        np.testing.assert_allclose(p[at, rest], p_own[at, rest], rtol=1e-5, atol=1e-9)
    others = np.ones(len(FAIL_ASK), bool)
    others[[10, 26, 11, 12]] = False  # (11, 12: the forward read's RTT bytes of 1 -> 2)
    np.testing.assert_allclose(p[others][:, [F, R]], p_own[others][:, [F, R]], atol=1e-6)
    batch = {"tokens": tok, "segment_ids": seg}
    open_ = {**params, "fail_bias": jnp.float32(0.0)}
    grad = lambda fold: jax.grad(lambda q: model.loss_sum(q, {**batch, "pair_fold": fold},
                                                          cfg)[2])(open_)
    none = jnp.zeros(tok.shape, bool)
    g_in, g_out = grad(none.at[0, 26].set(True)), grad(none)
    assert abs(float(g_in["fail_bias"])) > 0 and float(g_out["fail_bias"]) == 0
    assert not np.asarray(g_in["pair_store"]).any()
    # the fold's targets: its RTT bytes and its results (node 1's pings of FAIL_ASK: 3
    # results, 4 RTT bytes) where the context falls in it
    # (this context's hash falls in a fold of 179, not of 2)
    for k, want in ((179, [10, 11, 12, 26, 40, 41, 42]), (2, [])):
        assert np.flatnonzero(np.asarray(model.pair_fold_targets(tok, seg, k))[0]).tolist() == want


# node 1 pings node 2: a reply, two failures, a reply; node 4: a failure; node 2 again
CTX_FAILS = (ping(1, 2, 0x50, 0x10) + failed(1, 2) * 2 + ping(1, 2, 0x50, 0x20) + failed(1, 4)
             + ping(1, 2, 0x51, 0x10))


def _ctx_fails_config():
    """small on CTX_FAILS without stores, the context copy or any reading of the context's
    failures: what the tests of those readings turn on one at a time."""
    return dataclasses.replace(arch.MODELS["small"], seq_len=len(CTX_FAILS), dst_store=0,
                               pair_store=0, pair_forward=0, pair_fail=False,
                               placed_store=0.0, context_copy=0.0, context_fail=0.0,
                               context_fail_anchor=False, fail_dst=False)


def test_the_contexts_failures_to_the_destination_update_p_failed():
    """ModelConfig.context_fail: before each result, the row's earlier results to the
    measurement's destination (node 2: 0, 1, 2, 3, -, 4 of them, 0, 1, 2, 2, -, 2 failed;
    node 4: none) update the model's P(FAILED) / (P(FAILED) + P(RTT_START)) = m as a beta
    prior of s = 4 exp(gate) pseudo-pings: (failed + s m) / (pings + s); their sum and every
    other token's probability are the model's, and every position with no earlier result
    to the destination, or after its result header, is the model's. The gate's bias learns."""
    base = _ctx_fails_config()
    cfg = dataclasses.replace(base, context_fail=4.0)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok = jnp.asarray([CTX_FAILS])
    seg = jnp.ones(tok.shape, jnp.int32)
    F, R = V.FAILED, V.RTT_START
    heads = [i for i, t in enumerate(CTX_FAILS) if t in (F, R)]
    assert heads == [11, 27, 41, 55, 71, 85]
    counts = [(0, 0), (0, 1), (1, 2), (2, 3), (0, 0), (2, 4)]  # (failed, pings) before each
    got = np.stack([np.asarray(x)[0] for x in model.context_fails(
        tok, seg, model.same_destination(tok, seg)[0])])
    assert [tuple(got[:, h - 1]) for h in heads] == counts
    for bias, s in ((0.0, 4.0), (np.log(2.0), 8.0)):
        p, p_own = (np.exp(np.asarray(jax.nn.log_softmax(
            model.forward({**params, "cfail_bias": jnp.float32(bias)}, tok, seg, c)),
            np.float64))[0] for c in (cfg, base))
        for h, (f, n) in zip(heads, counts):
            at = h - 1
            m = p_own[at, F] / (p_own[at, F] + p_own[at, R])
            q = (f + s * m) / (n + s)
            assert p[at, F] / (p[at, F] + p[at, R]) == pytest.approx(q, rel=1e-4)
            assert p[at, F] + p[at, R] == pytest.approx(p_own[at, F] + p_own[at, R], rel=1e-5)
        # the tokens before a result whose destination the context has pinged move that
        # split alone (node 2's from its last destination byte: the match needs all of it)
        moved = np.asarray(model.before_result(tok, seg))[0] & (got[1] > 0)
        assert np.flatnonzero(moved).tolist() == [26, 40, 54, 84]
        np.testing.assert_allclose(p[~moved], p_own[~moved], rtol=1e-5, atol=1e-9)
        rest = np.ones(p.shape[1], bool)
        rest[[F, R]] = False
        np.testing.assert_allclose(p[moved][:, rest], p_own[moved][:, rest], rtol=1e-5,
                                   atol=1e-9)
    g = jax.grad(lambda q: model.loss_sum(q, {"tokens": tok, "segment_ids": seg}, cfg)[2])(params)
    assert abs(float(g["cfail_bias"])) > 0 and np.abs(np.asarray(g["cfail_gate"])).sum() > 0
    assert arch.MODELS["small"].context_fail == 4.0 and not arch.MODELS["tiny"].context_fail
    with pytest.raises(ValueError, match="context_fail must be 0"):
        dataclasses.replace(base, context_fail=-1.0)


def test_a_pair_dead_or_live_by_its_failures_in_the_context():
    """ModelConfig.context_dead: the beta update of context_fail mixed with a dead pair's
    rate q = sigmoid(cdead_rate + 3) by the posterior P(dead), its prior sigmoid(gate - 2),
    the beta-binomial's likelihood by hand (Gamma functions) against q's: on CTX_FAILS,
    P(failed)'s split before node 2's results, from the model without the piece (m) and
    the counts; the sum of the two and the positions without a count as before. The
    three parameters learn."""
    from math import exp, lgamma, log
    base = _ctx_fails_config()
    cfg = dataclasses.replace(base, context_fail=4.0, context_dead=True)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok, F, R = jnp.asarray([CTX_FAILS]), V.FAILED, V.RTT_START
    seg = jnp.ones(tok.shape, jnp.int32)
    p, p_own = (np.exp(np.asarray(jax.nn.log_softmax(model.forward(params, tok, seg, c)),
                                  np.float64))[0] for c in (cfg, base))
    q, prior = 1 / (1 + exp(-3.0)), -2.0
    for at, (f, n) in zip((26, 40, 54, 84), ((0, 1), (1, 2), (2, 3), (2, 4))):
        m = p_own[at, F] / (p_own[at, F] + p_own[at, R])
        a, b = 4 * m, 4 * (1 - m)
        live = (lgamma(f + a) + lgamma(n - f + b) - lgamma(n + 4) - lgamma(a) - lgamma(b)
                + lgamma(4))
        w = 1 / (1 + exp(live - f * log(q) - (n - f) * log(1 - q) - prior))
        want = w * q + (1 - w) * (f + a) / (n + 4)
        assert p[at, F] / (p[at, F] + p[at, R]) == pytest.approx(want, rel=1e-4)
        assert p[at, F] + p[at, R] == pytest.approx(p_own[at, F] + p_own[at, R], rel=1e-5)
    assert p[54, F] / (p[54, F] + p[54, R]) > (2 + 4 * p_own[54, F] / (
        p_own[54, F] + p_own[54, R])) / 7  # 2 of 3 failed: nearer dead than the beta says
    moved = np.zeros(p.shape[0], bool)
    moved[[26, 40, 54, 84]] = True
    np.testing.assert_allclose(p[~moved], p_own[~moved], rtol=1e-5, atol=1e-9)
    g = jax.grad(lambda q: model.loss_sum(q, {"tokens": tok, "segment_ids": seg}, cfg)[2])(params)
    for name in ("cdead_bias", "cdead_rate", "cfail_bias"):
        assert abs(float(g[name])) > 0, name
    assert np.abs(np.asarray(g["cdead_gate"])).sum() > 0
    with pytest.raises(ValueError, match="context_dead weighs context_fail"):
        dataclasses.replace(base, context_dead=True)


def test_the_counts_update_can_read_the_models_split_as_a_constant():
    """ModelConfig.context_fail_detach: the same P(failed) (every logit equal), but where
    the counts update the split, no gradient reaches the layers through it: the loss of
    node 2's reply after 2 failures of 3 (its header at 55) reaches them through the sum
    P(FAILED) + P(RTT_START) alone; the gate's bias learns either way."""
    base = dataclasses.replace(_ctx_fails_config(), context_fail=4.0)
    det = dataclasses.replace(base, context_fail_detach=True)
    params = jax.tree.map(jnp.asarray, model.init_params(base, 0))
    tok, seg = jnp.asarray([CTX_FAILS]), jnp.ones((1, len(CTX_FAILS)), jnp.int32)
    a, b = (np.asarray(model.forward(params, tok, seg, c)) for c in (base, det))
    np.testing.assert_array_equal(a, b)
    want = CTX_FAILS[55]

    def nll(p, c):  # the result token's loss at 54 (a reply, after 2 failures of 3)
        return -jax.nn.log_softmax(model.forward(p, tok, seg, c))[0, 54, want]
    g_on, g_off = (jax.grad(nll)(params, c) for c in (base, det))
    assert want == V.RTT_START
    assert abs(float(g_on["cfail_bias"])) > 0 and abs(float(g_off["cfail_bias"])) > 0
    # with detach the layers learn from S = P(FAILED) + P(RTT_START) alone there (the
    # update keeps S): their gradient is that of -log S of the model without the piece
    plain = dataclasses.replace(base, context_fail=0.0)

    def nll_sum(p):
        lp = jax.nn.log_softmax(model.forward(p, tok, seg, plain))[0, 54]
        return -jnp.logaddexp(lp[V.FAILED], lp[V.RTT_START])
    g_sum = jax.grad(nll_sum)(params)
    for name in ("w_in", "w_out", "wqkv"):
        np.testing.assert_allclose(np.asarray(g_off["layers"][name]),
                                   np.asarray(g_sum["layers"][name]), rtol=1e-4, atol=1e-7)
        assert np.abs(np.asarray(g_on["layers"][name]) - np.asarray(g_sum["layers"][name])
                      ).max() > 1e-6


def test_the_anchor_starts_at_the_context_baselines_rule():
    """ModelConfig.context_fail_anchor: before each result of CTX_FAILS, P(FAILED) /
    (P(FAILED) + P(RTT_START)) is, at the start, train.eval's FailPrior rule on the row's
    counts (fail_shares with the pair's 4 pseudo-pings of a live 0.1, dead 0.05 at 0.97, the
    context's 16 of 0.12; the first result, with no earlier one, the rate itself): the same
    numbers from the model's counts and from the baselines' own. The sum of the two, every
    other token's probability and the positions after a result header are the model's;
    the residual's logit moves it by its bias; the rule's six constants and the gate learn."""
    from train.eval import context_baselines as cb
    base = _ctx_fails_config()
    cfg = dataclasses.replace(base, context_fail=4.0, context_fail_anchor=True)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok, F, R = jnp.asarray([CTX_FAILS]), V.FAILED, V.RTT_START
    seg = jnp.ones(tok.shape, jnp.int32)
    heads = [11, 27, 41, 55, 71, 85]
    # the context's (failed, pings) before each result, to any destination
    c = np.stack([np.asarray(x)[0] for x in model.segment_fails(tok, seg)])
    assert [tuple(c[:, h - 1]) for h in heads] == [(0, 0), (0, 1), (1, 2), (2, 3), (2, 4),
                                                   (3, 5)]
    dst, fail = np.array([2, 2, 2, 2, 4, 2]), np.array([0, 1, 1, 0, 1, 0], bool)
    counts = cb.fail_counts(cb.context_starts(np.zeros(6)), dst, fail)
    prior = cb.FailPrior(pair=4.0, context=16.0, dead=0.05, dead_rate=0.97, live=0.1)
    want = cb.fail_shares(counts, 0.12, prior)
    assert want[0] == pytest.approx(0.12) and want[4] == pytest.approx((2 + 16 * 0.12) / 20)
    for bias in (0.0, 0.7):
        logits = model.forward({**params, "fanchor_bias": jnp.float32(bias)}, tok, seg, cfg)
        p, p_own = (np.exp(np.asarray(jax.nn.log_softmax(x), np.float64))[0]
                    for x in (logits, model.forward(params, tok, seg, base)))
        got = np.array([p[h - 1, F] / (p[h - 1, F] + p[h - 1, R]) for h in heads])
        shifted = 1 / (1 + (1 / want - 1) * np.exp(-bias))
        np.testing.assert_allclose(got, shifted, rtol=1e-4)
        for h in heads:
            assert p[h - 1, F] + p[h - 1, R] == pytest.approx(
                p_own[h - 1, F] + p_own[h - 1, R], rel=1e-5)
        moved = np.asarray(model.before_result(tok, seg))[0]
        np.testing.assert_allclose(p[~moved], p_own[~moved], rtol=1e-5, atol=1e-9)
        rest = np.ones(p.shape[1], bool)
        rest[[F, R]] = False
        np.testing.assert_allclose(p[:, rest], p_own[:, rest], rtol=1e-5, atol=1e-9)
    g = jax.grad(lambda q: model.loss_sum(q, {"tokens": tok, "segment_ids": seg}, cfg)[2])(params)
    assert (np.abs(np.asarray(g["fanchor"])) > 0).all()
    assert abs(float(g["fanchor_bias"])) > 0 and np.abs(np.asarray(g["fanchor_gate"])).sum() > 0
    with pytest.raises(ValueError, match="context_fail_anchor reads context_fail"):
        dataclasses.replace(base, context_fail_anchor=True)


def test_a_fixed_anchor_keeps_the_rule_where_the_pair_has_no_ping():
    """ModelConfig.fail_anchor_fixed: the rule's six constants are data (no gradient; not
    counted as learned) and the residual's logit moves P(failed) only where the pair has an
    earlier ping in the context: with a bias of 0.7, CTX_FAILS' first result (no ping
    before it) and the one to node 4 (none to it) keep the rule's P(failed), the other four
    are moved by the bias as the anchor moves them."""
    from train.eval import context_baselines as cb
    base = _ctx_fails_config()
    cfg = dataclasses.replace(base, context_fail=4.0, context_fail_anchor=True,
                              fail_anchor_fixed=True)
    free = dataclasses.replace(cfg, fail_anchor_fixed=False)
    assert arch.n_params(free) - arch.n_params(cfg) == 6
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok, F, R = jnp.asarray([CTX_FAILS]), V.FAILED, V.RTT_START
    seg = jnp.ones(tok.shape, jnp.int32)
    heads = [11, 27, 41, 55, 71, 85]
    dst, fail = np.array([2, 2, 2, 2, 4, 2]), np.array([0, 1, 1, 0, 1, 0], bool)
    counts = cb.fail_counts(cb.context_starts(np.zeros(6)), dst, fail)
    prior = cb.FailPrior(pair=4.0, context=16.0, dead=0.05, dead_rate=0.97, live=0.1)
    want = cb.fail_shares(counts, 0.12, prior)
    shifted = 1 / (1 + (1 / want - 1) * np.exp(-0.7))
    logits = model.forward({**params, "fanchor_bias": jnp.float32(0.7)}, tok, seg, cfg)
    p = np.exp(np.asarray(jax.nn.log_softmax(logits), np.float64))[0]
    got = np.array([p[h - 1, F] / (p[h - 1, F] + p[h - 1, R]) for h in heads])
    np.testing.assert_allclose(got, np.where(counts[1] > 0, shifted, want), rtol=1e-4)
    assert counts[1].tolist() == [0, 1, 2, 3, 0, 4]
    g = jax.grad(lambda q: model.loss_sum(q, {"tokens": tok, "segment_ids": seg}, cfg)[2])(params)
    assert (np.asarray(g["fanchor"]) == 0).all() and abs(float(g["fanchor_bias"])) > 0
    with pytest.raises(ValueError, match="fail_anchor_fixed keeps context_fail_anchor"):
        dataclasses.replace(base, fail_anchor_fixed=True)


def ping6(src_last, dst_last, b1, b2):
    """``ping`` over IPv6: 2001::<src_last> -> 2001::<dst_last>."""
    addr = lambda last: [B + 0x20, B + 0x01] + [B] * 13 + [B + last]
    return ([V.MEASUREMENT_START, V.SRC_IPV6, *addr(src_last), V.DST_IPV6, *addr(dst_last),
             V.RTT_START, B + b1, B + b2, V.TIMESTAMP_DELTA1, B + 240])


def failed6(src_last, dst_last):
    """``ping6`` without a reply."""
    return ping6(src_last, dst_last, 0, 0)[:35] + [V.FAILED, V.TIMESTAMP_DELTA1, B + 240]


# a dual-stack probe: IPv4 fails, IPv6 fails twice, IPv4 fails, IPv6 replies, fails, IPv4 replies
BROKEN_ROW = (failed(1, 2) + failed6(1, 5) + failed6(1, 6) + failed(1, 2) + ping6(1, 7, 0x50, 0)
              + failed6(1, 5) + ping(1, 2, 0x50, 0x10))
BROKEN_DST = np.array([2, 5, 6, 2, 7, 5, 2])
BROKEN_FAIL = np.array([1, 1, 1, 1, 0, 1, 0], bool)
BROKEN_FAMILY = np.array([4, 6, 6, 4, 6, 6, 4])


def test_the_anchor_weighs_a_broken_family():
    """ModelConfig.fail_broken: where every earlier ping of the measurement's address family
    in the row failed (before BROKEN_ROW's results: 0, 0, 1, 1, 2 of them, then none after
    IPv6's reply, and 2 of IPv4), the model's P(FAILED) / (P(FAILED) + P(RTT_START)) at the
    start is the context baselines' rule with the broken family (broken_shares over
    family_chain of the rule's own answers) for planted priors, IPv4's and IPv6's; with
    priors of 0 it is the rule. The priors are data (no gradient)."""
    from train.eval import context_baselines as cb
    row = BROKEN_ROW
    base = dataclasses.replace(_ctx_fails_config(), seq_len=len(row), context_fail=4.0,
                               context_fail_anchor=True)
    cfg = dataclasses.replace(base, fail_broken=True)
    assert arch.n_params(cfg) == arch.n_params(base)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok, F, R = jnp.asarray([row]), V.FAILED, V.RTT_START
    seg = jnp.ones(tok.shape, jnp.int32)
    heads = [i for i, t in enumerate(row) if t in (F, R)]
    assert len(heads) == 7
    starts = cb.context_starts(np.zeros(7))
    prior = cb.FailPrior(pair=4.0, context=16.0, dead=0.05, dead_rate=0.97, live=0.1)
    rule = cb.fail_shares(cb.fail_counts(starts, BROKEN_DST, BROKEN_FAIL), 0.12, prior)
    n, loglik = cb.family_chain(starts, BROKEN_FAMILY, BROKEN_FAIL, rule)
    assert n.tolist() == [0, 0, 1, 1, 2, 0, 2]
    fam, n_m, ll_m = (np.asarray(x)[0, [h - 1 for h in heads]] for x in model.family_chain(
        tok, seg, jnp.log(jnp.full(tok.shape, 0.5))))
    assert fam.tolist() == BROKEN_FAMILY.tolist() and n_m.tolist() == n.tolist()
    np.testing.assert_allclose(ll_m, n * np.log(0.5), rtol=1e-6)

    def split(p):
        lp = np.exp(np.asarray(jax.nn.log_softmax(model.forward(p, tok, seg, cfg)),
                               np.float64))[0]
        return np.array([lp[h - 1, F] / (lp[h - 1, F] + lp[h - 1, R]) for h in heads])
    np.testing.assert_allclose(split(params), rule, rtol=1e-4)  # priors of 0: the rule
    planted = (0.1, 0.05)
    want = cb.broken_shares(rule, BROKEN_FAMILY, n, loglik, planted)
    assert np.abs(want - rule)[[2, 3, 4, 6]].min() > 0.005
    assert (want == rule)[[0, 1, 5]].all()
    with_prior = {**params, "fbroken": jnp.asarray(planted, jnp.float32)}
    np.testing.assert_allclose(split(with_prior), want, rtol=1e-4)
    g = jax.grad(lambda q: model.loss_sum(q, {"tokens": tok, "segment_ids": seg}, cfg)[2])(
        with_prior)
    assert not np.asarray(g["fbroken"]).any() and abs(float(g["fanchor_bias"])) > 0
    with pytest.raises(ValueError, match="fail_broken weighs context_fail_anchor"):
        dataclasses.replace(_ctx_fails_config(), fail_broken=True)


def test_a_run_fits_the_broken_familys_priors_on_its_train_rows():
    """result_family_chain: BROKEN_ROW's results (twice, the second row a segment of its
    first four measurements and one of its last three) with the anchor's P(failed) under
    the constants a run starts from, the family chain of it and the outcome, as the context
    baselines compute them; the run's fit (train.fit.loop._broken_start) is fit_broken on
    them, and its line says the priors and how many results they were fit on."""
    from train.eval import context_baselines as cb
    from train.fit import loop
    from train.model import failprior
    row = np.asarray(BROKEN_ROW, np.uint16)
    cut = len(failed(1, 2) * 2 + failed6(1, 5) * 2)
    seg2 = np.where(np.arange(len(row)) < cut, 1, 2).astype(np.uint8)
    tok, seg = np.stack([row, row]), np.stack([np.ones(len(row), np.uint8), seg2])
    fanchor = np.zeros(6, np.float32)
    p, fam, n, ll, y = model.result_family_chain(tok, seg, fanchor, 4.0, batch=1)
    ctx = np.array([0] * 7 + [1] * 4 + [2] * 3)
    dst, fail, family = (np.concatenate([x, x]) for x in (BROKEN_DST, BROKEN_FAIL,
                                                          BROKEN_FAMILY))
    starts = cb.context_starts(ctx)
    prior = cb.FailPrior(pair=4.0, context=16.0, dead=0.05, dead_rate=0.97, live=0.1)
    rule = cb.fail_shares(cb.fail_counts(starts, dst, fail), 0.12, prior)
    want_n, want_ll = cb.family_chain(starts, family, fail, rule)
    assert want_n.tolist() == [0, 0, 1, 1, 2, 0, 2, 0, 0, 1, 1, 0, 0, 0]
    assert fam.tolist() == family.tolist() and n.tolist() == want_n.tolist()
    assert y.tolist() == fail.tolist()
    np.testing.assert_allclose(p, rule, rtol=1e-5)
    np.testing.assert_allclose(ll, want_ll, rtol=1e-5)
    cfg = dataclasses.replace(_ctx_fails_config(), seq_len=len(row), context_fail=4.0,
                              context_fail_anchor=True, fail_broken=True)
    got, line = loop._broken_start(tok, seg, cfg, fanchor)
    fit = failprior.fit_broken(rule, family, want_n, want_ll, fail)
    assert tuple(got.tolist()) == pytest.approx(fit)
    assert line == (f"P(failed): a broken address family at the probe, prior {fit[0]:g} for "
                    f"IPv4 and {fit[1]:g} for IPv6, fit on the 3 and 3 results whose context's "
                    f"earlier pings of their family had all failed")


def test_the_anchor_reads_the_destinations_priors():
    """ModelConfig.fail_dst: where the destination store has the destination's row, the
    rule's rate, P(dead) and live rate are moved by the offsets in fail_dst's table beside
    it: at the start the model's P(FAILED) / (P(FAILED) + P(RTT_START)) before each result of
    CTX_FAILS is fail_shares with each query's destination's offsets (node 2: planted; node
    4: no store row, none), the context baselines' rule with fail_offsets. Their sum and every
    other token are the model's; the table is data (no gradient)."""
    from train.eval import context_baselines as cb
    K = arch.STORE_K
    base = dataclasses.replace(_ctx_fails_config(), dst_store=1024)
    cfg = dataclasses.replace(base, context_fail=4.0, context_fail_anchor=True, fail_dst=True)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok, F, R = jnp.asarray([CTX_FAILS]), V.FAILED, V.RTT_START
    seg = jnp.ones(tok.shape, jnp.int32)
    heads = [11, 27, 41, 55, 71, 85]
    h, on = (np.asarray(x)[0] for x in model.dst_hashes(tok, seg)[:2])
    assert on[[x - 1 for x in heads]].all()
    h2 = int(h[heads[0] - 1])
    assert int(h[heads[4] - 1]) != h2  # node 4's
    row = int(np.asarray(model.store_rows(h2, 1024)[0]))
    store = np.zeros((1024, K + 2), np.float32)
    store[row, :K] = 0x5010  # an RTT code; the read needs STORE_MIN replies and the check
    store[row, K], store[row, K + 1] = arch.STORE_MIN, model.store_check(np.int32(h2))
    table = np.zeros((1024, 3), np.float32)
    planted = np.array([0.4, -0.5, 0.3], np.float32)
    table[row] = planted
    params = {**params, "dst_store": jnp.asarray(store), "fail_dst": jnp.asarray(table)}
    off = np.asarray(model.dst_fail_offsets(params, tok, seg))[0]
    np.testing.assert_array_equal(off[[x - 1 for x in heads]],
                                  [planted] * 4 + [[0, 0, 0]] + [planted])
    dst, fail = np.array([2, 2, 2, 2, 4, 2]), np.array([0, 1, 1, 0, 1, 0], bool)
    counts = cb.fail_counts(cb.context_starts(np.zeros(6)), dst, fail)
    prior = cb.FailPrior(pair=4.0, context=16.0, dead=0.05, dead_rate=0.97, live=0.1)
    want = cb.fail_shares(counts, 0.12, prior, off[[x - 1 for x in heads]].T)
    plain = cb.fail_shares(counts, 0.12, prior)
    assert np.abs(want - plain)[[0, 1, 2, 3, 5]].min() > 0.01 and want[4] == plain[4]
    logits = model.forward(params, tok, seg, cfg)
    p, p_own = (np.exp(np.asarray(jax.nn.log_softmax(x), np.float64))[0]
                for x in (logits, model.forward(params, tok, seg, base)))
    got = np.array([p[x - 1, F] / (p[x - 1, F] + p[x - 1, R]) for x in heads])
    np.testing.assert_allclose(got, want, rtol=1e-4)
    rest = np.ones(p.shape[1], bool)
    rest[[F, R]] = False
    np.testing.assert_allclose(p[:, rest], p_own[:, rest], rtol=1e-5, atol=1e-9)
    g = jax.grad(lambda q: model.loss_sum(q, {"tokens": tok, "segment_ids": seg}, cfg)[2])(params)
    assert not np.asarray(g["fail_dst"]).any() and (np.abs(np.asarray(g["fanchor"])) > 0).all()
    with pytest.raises(ValueError, match="fail_dst moves context_fail_anchor's rule"):
        dataclasses.replace(cfg, dst_store=0)


def test_a_run_fits_where_p_failed_starts_on_its_train_rows():
    """result_fail_counts: every result of the rows with the counts the anchor reads before
    it, in row order, a segment's counts its own (CTX_FAILS, then its first two pings as a
    second segment; three rows in batches of two, the last padded): the pair's (failed,
    pings) and the segment's; not a result whose destination comes after it (the pair
    unknown there, as it is not in a query). anchor_start: the constants that make anchor_rule the
    FailPrior's rule (fail_shares) on those counts, for a planted prior and rate."""
    from train.model import failprior
    n = len(CTX_FAILS)
    # and a failure to node 2 whose result comes before its destination: not a result to fit
    m = failed(1, 2)
    late = m[:6] + [V.FAILED] + m[6:11] + m[12:]
    row = CTX_FAILS + CTX_FAILS[:28] + late
    tok = np.array([row, row, row], np.int32)
    seg = np.array([[1] * n + [2] * (28 + len(late))] * 3, np.int32)
    counts, fails = model.result_fail_counts(tok, seg, batch=2)
    one = [[0, 0, 1, 2, 0, 2, 0, 0], [0, 1, 2, 3, 0, 4, 0, 1],
           [0, 0, 1, 2, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5, 0, 1]]
    np.testing.assert_array_equal(counts, np.tile(one, 3))
    assert fails.tolist() == [False, True, True, False, True, False, False, True] * 3
    prior = failprior.FailPrior(pair=8.0, context=4.0, dead=0.1, dead_rate=0.95, live=0.2)
    c = failprior.anchor_start(prior, 0.3, 4.0)
    got = np.asarray(model.anchor_rule(jnp.asarray(c), *jnp.asarray(counts, jnp.float32), 4.0))
    np.testing.assert_allclose(got, failprior.fail_shares(counts, 0.3, prior), rtol=1e-5)
    # no earlier ping: the rate; one reply: below the live rate
    assert got[0] == pytest.approx(0.3, rel=1e-6) and got[1] < 0.2
    # FAIL_ANCHOR's own rule is anchor_start's zero
    start = failprior.FailPrior(pair=4.0, context=16.0, dead=0.05, dead_rate=0.97, live=0.1)
    np.testing.assert_allclose(failprior.anchor_start(start, 0.12, 4.0), 0.0, atol=1e-6)


# --- the placed store (ModelConfig.placed_store): the store moved by the probe's factor ----

def _code(us: float) -> int:
    from prep.tokens.reference import rtt_code
    e, m = rtt_code(us / 1000.0)
    return (e << 11) | m


def test_value_code_is_the_tokenizers_code():
    """Every canonical code's value comes back as that code; twice it, as the tokenizer's
    code of twice the value; any value within half a mantissa step of its code's."""
    codes = np.array([_code(v) for v in (1.0, 7.0, 1023.0, 2047.0, 2048.0, 4095.0, 4096.0,
                                         123_456.0, 9.9e6, 3.3e9, 2**42)])
    got = np.asarray(model._value_code(model._code_value(jnp.asarray(codes))))
    assert got.tolist() == codes.tolist()
    twice = np.asarray(model._value_code(2 * model._code_value(jnp.asarray(codes))))
    assert twice.tolist() == [_code(2 * (c & 0x7FF) * 2.0 ** (c >> 11)) for c in codes]
    us = np.exp(np.random.default_rng(0).uniform(0, 29, 2000)).astype(np.float32)  # < 2047 x 2^31
    back = np.asarray(model._code_value(model._value_code(jnp.asarray(us))))
    assert (np.abs(back - us) <= np.maximum(us * 2.0 ** -11, 0.5) * 1.0001).all()
    assert int(model._value_code(jnp.float32(2.0 ** 50))) == (31 << 11) | 2047  # saturates


def _octave(b1: int, b2: int, k: int) -> tuple[int, int]:
    """The code bytes of 2^k times code (b1, b2)'s value (planted codes: exponent + k)."""
    c = (b1 << 8 | b2) + (k << 11)
    return c >> 8, c & 255


def test_probe_shift_is_the_contexts_mean_log_ratio_to_the_store():
    """.129's store median is 0x6830. A reply to it at twice that (an octave up), one to .130
    (too few replies in the store: not counted), a failed ping to .129 (no reply: not
    counted), one at half (an octave down): the shift, over n + 1, is 0 until the first
    reply's last token, 1/2 from there, back to 0 after the half one; a new segment starts
    from 0 again; a probe reads its anchor's."""
    table, _ = store.build(*planted(), 1024)
    assert table[row_of(129, 1024), K // 2] == 0x6830
    up, down = reply(*_octave(0x68, 0x30, 1)), reply(*_octave(0x68, 0x30, -1))
    row = up + reply(0x10, 0x10, dst_last=130) + FAILED + down + reply(0x68, 0x20)
    seg = [1] * (16 + 16) + [2] * (14 + 16 + 16)  # the failed ping opens a second segment
    tok, seg = jnp.asarray([row + row]), jnp.asarray([seg + [s + 2 for s in seg]])
    probes = (jnp.asarray([[B + 0x68, B + 0x68]]), jnp.asarray([[16 + 11, 46 + 14 + 11]]))
    shift, p_shift = model.probe_shift(jnp.asarray(table), tok, seg, 1.0, probes)
    shift = np.asarray(shift)[0]
    want = np.r_[np.zeros(15), np.full(17, 0.5),  # segment 1: the up reply counts at its end
                 np.zeros(14 + 15), np.full(16, -0.5),  # segment 2: failed, then down
                 (-1 + np.log2(0x20 / 0x30)) / 3]  # the last reply's own last token: 3 counted
    np.testing.assert_allclose(shift, np.r_[want, want], atol=1e-6)
    np.testing.assert_allclose(np.asarray(p_shift)[0], [0.5, -0.5], atol=1e-6)
    # nothing in the store: no measurement counts, no shift
    none, _ = model.probe_shift(jnp.zeros_like(jnp.asarray(table)), tok, seg, 1.0)
    assert not np.asarray(none).any()


def test_byte_counts_are_the_one_hots_summed():
    """model._byte_counts, the stores' histogram of a position's quantiles' bytes: exactly
    the one-hot of [..., K, 256] summed over K, with and without a mask."""
    rng = np.random.default_rng(5)
    b = rng.integers(0, 256, (2, 3, 64)).astype(np.int32)
    b[0, 0] = 7  # one position's quantiles all one byte
    where = rng.random((2, 3, 64)) < 0.3
    got = np.asarray(model._byte_counts(jnp.asarray(b)))
    want = np.eye(256, dtype=np.float32)[b].sum(-2)
    np.testing.assert_array_equal(got, want)
    assert got[0, 0, 7] == 64 and got[0, 0].sum() == 64 and got.shape == (2, 3, 256)
    masked = np.asarray(model._byte_counts(jnp.asarray(b), jnp.asarray(where)))
    np.testing.assert_array_equal(masked, (np.eye(256, dtype=np.float32)[b]
                                           * where[..., None]).sum(-2))
    assert masked.sum() == where.sum()


def test_store_dists_moves_the_quantiles_by_the_shift():
    """With a shift of one octave at the last .129 reply's RTT, its quantiles' values are
    doubled before they become bytes: the first byte's mass moves to the doubled codes'."""
    table, _ = store.build(*planted(), 1024)
    tok, seg = jnp.asarray([ROW]), jnp.ones((1, len(ROW)), jnp.int32)
    rs = 5 * 16 - 2 + 11
    shift = jnp.zeros(tok.shape).at[0, rs].set(1.0)
    (dist, on), _ = model.store_dists(jnp.asarray(table), tok, seg, widths=(1e-3, 1e-3),
                                      shift=(shift, None))
    want = np.zeros(256)
    for c, w in ((0x6820, 0.25), (0x6825, 0.25), (0x6830, 0.25), (0x6905, 0.25)):
        want[_code(2 * (c & 0x7FF) * 2.0 ** (c >> 11)) >> 8] += w
    np.testing.assert_allclose(np.asarray(dist)[0, rs], want, atol=1e-6)
    (plain, _), _ = model.store_dists(jnp.asarray(table), tok, seg, widths=(1e-3, 1e-3))
    np.testing.assert_allclose(np.asarray(dist)[0, 11], np.asarray(plain)[0, 11])  # no shift


# --- the kriging store: destinations' covariance over the train split's sources ----------
# sources 1-3 ping destinations 20 and 21 at half, once and twice each one's middle code
# (0x6830, 0x7010): residuals -1, 0, +1 octave at both; each pair 3 times at its code and
# once at twice it (the pair's median: its code; a reply's noise 1/4 octave^2)
def _krig_rows():
    row = []
    for s, k in ((1, -1), (2, 0), (3, 1)):
        for d, (b1, b2) in ((20, (0x68, 0x30)), (21, (0x70, 0x10))):
            c = _octave(b1, b2, k)
            row += ping(s, d, *c) * 3 + ping(s, d, *_octave(*c, 1))
    tok = np.asarray([row] * 3, np.uint16)  # 36 replies a destination: a store row each
    return tok, np.ones(tok.shape, np.uint8)


def _node_hash(last: int, net: int = 10) -> int:
    r = ping(1, last, 0, 0, net)
    _, full, _ = model.address_hashes(jnp.asarray([r]), jnp.ones((1, len(r)), jnp.int32), "dst")
    return int(full[0, -1])


def test_the_kriging_store_holds_the_destinations_covariances():
    tok, seg = _krig_rows()
    dst_table, _ = store.build(tok, seg, 1024)
    table, noise, summary = store.build_krig(tok, seg, 1024, dst_table)
    assert noise == pytest.approx(0.25)
    assert summary == store.KrigSummary(pairs=3, placed=3, sources=3, noise=noise)
    h20, h21, h22 = (_node_hash(n) for n in (20, 21, 22))
    a, b = np.asarray([(h20, h20), (h21, h21), (h20, h21), (h21, h20), (h20, h22)], np.int32).T
    keys = jnp.asarray(model.cov_key(a, b))
    got = np.asarray(model._cov_lookup(jnp.asarray(table), keys))
    # variances over 3 sources; the covariance (1 + 0 + 1) over 3 + KRIG_SHRINK; none for 22
    np.testing.assert_allclose(got, [2 / 3, 2 / 3, 2 / 8, 2 / 8, 0.0], atol=1e-6)


def test_kriged_shift_is_the_gaussian_mean_given_the_contexts_replies():
    """A new source 9 pings 20 at twice its middle (+1 octave), then 21 (its shift: the
    covariance over 20's variance plus the noise), then 22 (no store row: no shift, not
    read), then 21 again after its first reply to 21 at 4 times the middle (+2): both read."""
    tok, seg = _krig_rows()
    dst_table, _ = store.build(tok, seg, 1024)
    table, noise, _ = store.build_krig(tok, seg, 1024, dst_table)
    ask = (ping(9, 20, *_octave(0x68, 0x30, 1)) + ping(9, 21, *_octave(0x70, 0x10, 2))
           + ping(9, 22, 0x50, 0x00) + ping(9, 21, 0x70, 0x10))
    q_tok, q_seg = jnp.asarray([ask]), jnp.ones((1, len(ask)), jnp.int32)
    probes = (jnp.asarray([[B + 0x70]]), jnp.asarray([[48 + 11]]))
    shift, p_shift = model.kriged_shift(jnp.asarray(dst_table), jnp.asarray(table),
                                        jnp.float32(noise), q_tok, q_seg, probes)
    v, c = 2 / 3, 2 / 8
    w = np.linalg.solve([[v + noise, c], [c, v + noise]], [1.0, 2.0])
    want = np.r_[np.zeros(16), np.full(16, c / (v + noise)), np.zeros(16),
                 np.full(16, c * w[0] + v * w[1])]
    np.testing.assert_allclose(np.asarray(shift)[0], want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p_shift)[0], want[[48 + 11]], atol=1e-5)
    # a second segment from the third ping on reads nothing of the first's replies
    seg2 = jnp.asarray([[1] * 32 + [2] * 32])
    split, _ = model.kriged_shift(jnp.asarray(dst_table), jnp.asarray(table),
                                  jnp.float32(noise), q_tok, seg2)
    np.testing.assert_allclose(np.asarray(split)[0], np.r_[want[:32], np.zeros(32)], atol=1e-5)


def test_pairs_in_runs_lists_every_ordered_pair_within_each_run():
    one, other = store.pairs_in_runs(np.array([3, 3, 5, 7, 7, 7]))
    assert list(zip(one.tolist(), other.tolist())) == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 2), (3, 3), (3, 4), (3, 5),
        (4, 3), (4, 4), (4, 5), (5, 3), (5, 4), (5, 5)]
    assert [len(x) for x in store.pairs_in_runs(np.zeros(0, np.int64))] == [0, 0]


def test_a_store_by_source_weighs_each_source_once():
    """Destination 20: source 1 replies 30 times at 0x5000, sources 2 and 3 once each at
    0x6000 and 0x7000 (32 replies: a row to read). By replies its quantiles are 30/32 at
    0x5000; by source, a third each; its count is 32 replies either way. Source 4's 32
    replies to 21 (0x4200 x 8, 0x4100 x 16, 0x4000 x 8) give one median, the lower middle,
    0x4100."""
    row = (ping(1, 20, 0x50, 0x00) * 30 + ping(2, 20, 0x60, 0x00) + ping(3, 20, 0x70, 0x00)
           + (ping(4, 21, 0x42, 0x00) + ping(4, 21, 0x41, 0x00) * 2
              + ping(4, 21, 0x40, 0x00)) * 8)
    tok = np.asarray([row], np.uint16)
    seg = np.ones(tok.shape, np.uint8)
    by_reply, s1 = store.build(tok, seg, 1024)
    by_source, s2 = store.build(tok, seg, 1024, by_source=True)
    r20, r21 = (int(model.store_rows(jnp.asarray(_node_hash(d)), 1024)[0]) for d in (20, 21))
    assert (by_reply[r20, :K] == 0x5000).sum() == 60  # levels (k + 0.5) / K below 30 / 32
    third = [int(np.ceil(K / 3 * i - 0.5)) for i in (1, 2)]  # the levels' thirds: 21, 43
    want = [0x5000] * third[0] + [0x6000] * (third[1] - third[0]) + [0x7000] * (K - third[1])
    assert by_source[r20, :K].astype(int).tolist() == want
    assert by_source[r20, K] == by_reply[r20, K] == 32
    assert (by_source[r20, K + 1] == by_reply[r20, K + 1]) and by_source[r20, K + 1] != 0
    assert (by_source[r21, :K] == 0x4100).all() and by_source[r21, K] == 32
    assert s1 == store.StoreSummary(destinations=2, usable=2, replies=64, collided=0)
    assert s2 == dataclasses.replace(s1, sources=4)
    assert s2.line().endswith("from 64 train replies, quantiles over 4 (destination, source) "
                              "medians")
    with pytest.raises(ValueError, match="destination store"):
        store.build(tok, seg, 1024, key="pair", by_source=True)


def test_stores_built_without_the_fold_are_the_stores_of_the_other_contexts():
    """ModelConfig.store_without_fold: with ``fold``, build (by reply and by source) and
    build_krig leave out the replies of that gate fold's contexts, and give exactly the
    tables of the rows with those contexts blanked out. 64 sources 10.0.0.1-64, one context
    of two replies each to 10.0.0.20 (source s at code 0x6800 + s) and one to 10.0.0.21: 17
    of them fall in a fold of 4, so 47 sources' 94 replies to 20 stay."""
    def ctx(s):
        return ping(s, 20, 0x68, s) * 2 + ping(s, 21, 0x70, s)
    n = len(ctx(1))
    tok = np.asarray([sum((ctx(s) for s in range(r * 4 + 1, r * 4 + 5)), []) for r in range(16)],
                     np.uint16)
    seg = np.asarray([[i + 1 for i in range(4) for _ in range(n)]] * 16, np.uint8)
    fold = np.asarray(model.source_fold(jnp.asarray(tok), jnp.asarray(seg), 4))
    out = fold[:, ::n].reshape(-1)  # per source 1..64: its context in the fold
    assert out.sum() == 17
    blank_tok, blank_seg = np.where(fold, 0, tok).astype(np.uint16), np.where(fold, 0, seg)
    r20 = int(model.store_rows(jnp.asarray(_node_hash(20)), 1024)[0])
    for by_source in (False, True):
        got, summary = store.build(tok, seg, 1024, by_source=by_source, fold=4)
        want, want_summary = store.build(blank_tok, blank_seg, 1024, by_source=by_source)
        np.testing.assert_array_equal(got, want)
        assert summary == want_summary and summary.replies == 47 * 3
        kept = {0x6800 + s for s in np.flatnonzero(~out) + 1}
        assert got[r20, K] == 94 and set(got[r20, :K].astype(int).tolist()) <= kept
    dst_table, _ = store.build(tok, seg, 1024, by_source=True, fold=4)
    got = store.build_krig(tok, seg, 1024, dst_table, fold=4)
    want = store.build_krig(blank_tok, blank_seg, 1024, dst_table)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1:] == want[1:]
    whole = store.build(tok, seg, 1024, by_source=True)[0]
    assert whole[r20, K] == 128
    with pytest.raises(ValueError, match="set gate_fold"):
        dataclasses.replace(arch.MODELS["small"], gate_fold=0, store_without_fold=True)


def test_a_run_of_small_builds_its_stores_without_the_gate_fold(tmp_path, monkeypatch, capsys):
    """`small` (store_without_fold): the run says so, and its checkpoint holds the stores of
    the train rows without the gate fold's contexts (1 in 8 by source), not the whole split's."""
    from prep.tools import synthetic_shards as synthetic
    from train.fit.config import TrainConfig
    from train.fit.loop import train
    from train.predict import predictor

    def ctx(s):
        return ping(s, 20, 0x68, s) * 2 + ping(s, 21, 0x70, s)
    n = len(ctx(1))
    tok = np.zeros((16, 256), np.uint16)
    seg = np.zeros((16, 256), np.uint8)
    for r in range(16):
        tok[r, :4 * n] = sum((ctx(s) for s in range(r * 4 + 1, r * 4 + 5)), [])
        seg[r, :4 * n] = [i + 1 for i in range(4) for _ in range(n)]
    d = tmp_path / "shards"
    synthetic.write_shards(d, {"train": (tok, seg), "test": (tok[:2], seg[:2])})
    small = arch.MODELS["small"]
    assert small.store_without_fold and small.gate_fold == 8
    monkeypatch.setitem(arch.MODELS, "small", dataclasses.replace(  # (no absolute times)
        small, dst_store=1024, krig_store=256, pair_recent=0))
    train(TrainConfig(model="small", data=str(d), run_dir=str(tmp_path / "run"), steps=2,
                      batch_size=2, lr=3e-3, warmup=1, log_every=1, eval_every=0, ckpt_every=0))
    err = capsys.readouterr().err
    assert ("stores: built without the gate fold's contexts (1 in 8, by source), on which the "
            "gates learn\n") in err
    want, summary = store.build(tok, seg, 1024, by_source=True, fold=8)
    assert summary.line() in err
    whole, _ = store.build(tok, seg, 1024, by_source=True)
    loaded = predictor.load(str(tmp_path / "run"))
    np.testing.assert_array_equal(np.asarray(loaded.params["dst_store"]), want)
    assert not np.array_equal(want, whole)
    krig, _, _ = store.build_krig(tok, seg, 256, want, fold=8)
    np.testing.assert_array_equal(np.asarray(loaded.params["krig_store"]), krig)



@pytest.mark.parametrize("split, shared", [("time", True), ("probe", False),
                                           ("time+probe", False), (None, False)])
def test_a_run_stores_nat_pairs_only_where_its_test_probes_are_train_probes(
        tmp_path, monkeypatch, split, shared):
    """small's pair_shared_by_split (train.fit.loop): on a data set split by time its test
    probes are its train probes, and the pairs of a NAT address (TIMED_ROWS': 10.0.0.1 ->
    10.0.0.2, its 2 replies outside the forward read's fold) are stored as any other
    (pair_shared True in the config it returns; the line says why); split by probe,
    time+probe, or a manifest without a split (prep's default: by probe), they are not.
    The rows are decoded once for the recency check and both tables."""
    from prep.tools import synthetic_shards as synthetic
    from train.fit import loop

    tok, seg = _timed_rows()
    d = tmp_path / "shards"
    manifest = synthetic.write_shards(d, {"train": (tok, seg), "test": (tok[:1], seg[:1])})
    if split is not None:
        manifest["config"]["split"] = split
    mcfg = dataclasses.replace(arch.MODELS["small"], dst_store=1024, pair_store=1024,
                               pair_forward=2, pair_min=1, pair_recent=1, gate_fold=0,
                               store_without_fold=False, placed_store=0.0)
    assert mcfg.pair_shared_by_split and not mcfg.pair_shared
    decoded = []
    monkeypatch.setattr(store, "timed", lambda *a: decoded.append(1) or TIMED(*a))
    got, tables, lines = loop._store_tables(mcfg, d, manifest)
    assert got.pair_shared == shared and len(decoded) == 1
    assert ("pair store: a NAT address's pairs stored too, their failures read (pair_shared "
            "for this run: the data set is split by time alone, so its test probes are its "
            "train probes, whose own history such a pair holds)" in lines) == shared
    assert got.pair_shared_fail == shared
    r, ok = (np.asarray(x) for x in model._store_row(jnp.asarray(tables["pair_store"]),
                                                     _pair(1, 2), 1))
    assert bool(ok) == shared and (not shared or (r[K], r[K + 2]) == (2, 0))  # failures read
    want, _ = store.build(tok, seg, 1024, key="pair", pair_fold=2, min_count=1, failures=True,
                          fail_recent=16, without_shared=not shared, shared_fails=shared)
    np.testing.assert_array_equal(tables["pair_store"], want)
    got, _, _ = loop._store_tables(dataclasses.replace(mcfg, pair_shared_by_split=False), d,
                                   manifest)
    assert not got.pair_shared  # as set
    assert "pair_shared" in arch.SET_BY_DATA and not arch.MODELS["tiny"].pair_shared_by_split


TIMED = store.timed
