"""The destination store (ModelConfig.dst_store): the train split's replies by destination,
built by train.model.store and read by train.model.model.store_dists, on planted rows with
known quantiles."""

import dataclasses

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
    bits of its hash. .130 and .131 have their rows too, but too few replies to be read."""
    table, summary = store.build(*planted(), 1024)
    r = table[row_of(129, 1024)]
    q = K // 4
    assert r[:K].astype(int).tolist() == [0x6820] * q + [0x6825] * q + [0x6830] * q + [0x6905] * q
    assert r[K] == 40 and r[K + 1] == dst_hash(129) & 0xFFFF
    assert table[row_of(130, 1024), K] == 10 and table[row_of(131, 1024), K] == 20
    assert (table[row_of(131, 1024), :K] == [0x3000] * (K // 2) + [0x3002] * (K // 2)).all()
    assert summary == store.StoreSummary(destinations=3, usable=1, replies=70, collided=0)
    assert np.count_nonzero(table[:, K]) == 3
    # the build reads in fixed batches: a partial last batch gives the same table
    np.testing.assert_array_equal(store.build(*planted(), 1024, batch=3)[0], table)


def test_a_shared_row_goes_to_the_destination_with_the_most_replies():
    """Three destinations in a table of two rows: two of them share one. The one with more
    replies keeps it; the other has no row (and is counted as collided if it had enough)."""
    rows = {d: row_of(d, 2) for d in (129, 130, 131)}
    table, summary = store.build(*planted(40), 2)  # 160, 40 and 80 replies
    n = {129: 160, 130: 40, 131: 80}
    for r in (0, 1):
        mine = [d for d in rows if rows[d] == r]
        if mine:
            top = max(mine, key=n.get)
            assert table[r, K] == n[top] and table[r, K + 1] == dst_hash(top) & 0xFFFF
    shared = [d for d in rows if list(rows.values()).count(rows[d]) > 1]
    lost = [d for d in shared if d != max((e for e in shared if rows[e] == rows[d]), key=n.get)]
    assert summary.collided == len(lost) >= 1 and summary.usable == 3 - len(lost)


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
                              context_copy=0.0, copy_aux=0.0)
    off = dataclasses.replace(cfg, dst_store=0)
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
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(ROW), dst_store=1024)
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


def test_a_run_fills_its_store_from_the_train_split_and_keeps_it(tmp_path, monkeypatch, capsys):
    """`train` with a store fills it from the train split before the first step (one line
    says what it holds), never learns it, and the run's checkpoint holds exactly what
    store.build makes of the train rows: `train eval` and `train predict` read it there."""
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
    monkeypatch.setitem(arch.MODELS, "small", dataclasses.replace(arch.MODELS["small"],
                                                                  dst_store=1024))
    run = tmp_path / "run"
    train(TrainConfig(model="small", data=str(d), run_dir=str(run), steps=3, batch_size=2,
                      lr=3e-3, warmup=1, log_every=1, eval_every=0, ckpt_every=0))
    assert ("destination store: 1 of 3 destinations (>= 32 replies each) from 70 train "
            "replies") in capsys.readouterr().err
    want, _ = store.build(tok, seg, 1024)
    got = np.asarray(predictor.load(str(run)).params["dst_store"])
    np.testing.assert_array_equal(got, want)
