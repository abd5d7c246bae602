"""The training objective: target roles on the device, role weights, the grammar embedding,
and the LR schedule of a resumed run."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import write_dataset

from prep.schema import vocab as V
from prep.schema.manifest import load_manifest
from prep.tokens import rowdecode
from train.cli import main
from train.fit import step as step_lib
from train.fit.config import TrainConfig
from train.fit.loop import train
from train.fit.reader import read_split
from train.model import arch, model

B = V.BYTE_OFFSET
# one IPv4 measurement, blocks in the order src, dst, result, timestamp (delta 1 byte)
ROW = [V.MEASUREMENT_START, V.SRC_IPV4, B + 10, B + 0, B + 0, B + 1, V.DST_IPV4, B + 193,
       B + 0, B + 14, B + 129, V.RTT_START, B + 0x68, B + 0x20, V.TIMESTAMP_DELTA1, B + 240]
# marker 1, src 2, dst 3, timestamp 4, result 5, rtt 6
ROLES = [1, 1, 2, 2, 2, 2, 1, 3, 3, 3, 3, 5, 6, 6, 1, 4]
INDEX = [16, 16, 0, 1, 2, 3, 16, 0, 1, 2, 3, 16, 0, 1, 16, 0]


def test_grammar_of_a_written_measurement():
    tok = jnp.asarray([ROW + [0, 0]])
    seg = jnp.asarray([[1] * len(ROW) + [0, 0]])
    role, index, _ = model.grammar(tok, seg)
    assert np.asarray(role)[0].tolist() == ROLES + [0, 0]
    assert np.asarray(index)[0, :len(ROW)].tolist() == INDEX
    assert np.asarray(model.target_roles(tok, seg))[0].tolist() == ROLES[1:] + [0, 0, 0]
    assert arch.N_INDEX == 17


def test_device_roles_equal_rowdecode_on_real_rows(builtin_shards):
    tok, seg = read_split(builtin_shards, load_manifest(builtin_shards), "test")
    assert len(tok) >= 5
    host = rowdecode.token_roles(tok, seg)
    dev = np.asarray(jax.jit(model.token_roles)(tok, seg))  # as the jitted loss runs it
    np.testing.assert_array_equal(dev, host)


def test_role_weights_parse():
    assert step_lib.role_weights("") is None
    assert V.ROLES[:7] == ("padding", "marker", "src", "dst", "timestamp", "result", "rtt")
    w = step_lib.role_weights("rtt=10, result=4,src=0")
    assert w[:7] == (1.0, 1.0, 0.0, 1.0, 1.0, 4.0, 10.0)
    for bad, msg in [("rtt", "not ROLE=WEIGHT"), ("latency=2", "not ROLE=WEIGHT"),
                     ("rtt=x", "'x' .* is not a number"), ("rtt=-1", "finite and >= 0"),
                     ("marker=0,src=0,dst=0,timestamp=0,result=0,rtt=0", "every weight is 0")]:
        with pytest.raises(ValueError, match=msg):
            step_lib.role_weights(bad)


def test_weighted_objective_is_the_weighted_mean():
    cfg = dataclasses.replace(arch.MODELS["tiny"], seq_len=len(ROW))
    params = model.init_params(cfg, 0)
    batch = {"tokens": jnp.asarray([ROW]), "segment_ids": jnp.ones((1, len(ROW)), jnp.int32)}
    # jitted, as the train step runs them (eagerly, each compiles its layer scan and every
    # other operation on its own)
    ce, _, _, mask = jax.jit(lambda p, t, s: model.token_losses(p, t, s, cfg))(
        params, batch["tokens"], batch["segment_ids"])
    ce = np.asarray(ce)[0, :-1]  # 15 counted targets: ROW[1:]
    total, count, plain = jax.jit(lambda p, b: model.loss_sum(p, b, cfg))(params, batch)
    assert int(count) == 15 and np.isclose(float(plain), ce.mean(), rtol=1e-6)
    w = step_lib.role_weights("rtt=10,src=0")
    total_w, count_w, obj = jax.jit(lambda p, b: model.loss_sum(p, b, cfg, role_weights=w))(
        params, batch)
    tw = np.array([w[r] for r in ROLES[1:]])
    assert float(total_w) == float(total) and int(count_w) == 15
    assert np.isclose(float(obj), (tw * ce).sum() / tw.sum(), rtol=1e-6)
    assert tw.sum() == 4 * 0 + 2 * 10 + 9  # src bytes off, two RTT bytes x10, nine others


# ROW again to the same destination (another RTT), then to another one: the second's result
# and RTT come before its destination here, the third's after
ROW2 = (ROW
        + [V.MEASUREMENT_START, V.RTT_START, B + 0x69, B + 0x05, V.SRC_IPV4, B + 10, B + 0,
           B + 0, B + 1, V.DST_IPV4, B + 193, B + 0, B + 14, B + 129]
        + [V.MEASUREMENT_START, V.SRC_IPV4, B + 10, B + 0, B + 0, B + 1, V.DST_IPV4, B + 193,
           B + 0, B + 14, B + 130, V.RTT_START, B + 0x40, B + 0x01])


def test_same_destination_marks_the_earlier_measurements_to_it():
    """From the last byte of a measurement's destination on, its tokens match every token of
    the earlier measurements of their segment with that destination, and nothing else."""
    n1, n2 = len(ROW), len(ROW2) - len(ROW) - 14  # the first two measurements' lengths
    row = ROW2 + ROW2[:n1] + ROW2[:n1]  # segment 2: ROW twice
    seg = [1] * len(ROW2) + [2] * (2 * n1)
    m, _ = model.same_destination(jnp.asarray([row]), jnp.asarray([seg]))
    m = np.asarray(m)[0, 0]
    second = slice(n1, n1 + n2)
    want = np.zeros_like(m)
    # measurement 2 names 193.0.14.129 at its last token (its destination is last)
    want[n1 + n2 - 1, :n1] = True
    # measurement 3 (193.0.14.130) matches nothing; segment 2's second ROW matches its first
    s2 = len(ROW2)
    want[s2 + n1 + 10:s2 + 2 * n1, s2:s2 + n1] = True  # from its last dst byte (index 10) on
    np.testing.assert_array_equal(m, want)
    assert not m[second][:n2 - 1].any()  # before its destination is whole: no match


@pytest.mark.parametrize("extra", [{}, {"match_dst": 4.0, "byte_features": 7}],
                         ids=["grammar", "grammar+match_dst+byte_features"])
def test_grammar_embedding_probes_equal_writing_the_token(extra):
    """A probe (train.predict.predictor's second RTT byte) gets the role and index the token would
    get written into the row, and the same destination match: the same logits."""
    row = ROW2 if extra else ROW
    cfg = dataclasses.replace(arch.MODELS["tiny"], seq_len=len(row), grammar_embed=True, **extra)
    params = jax.tree.map(lambda x: 20 * x, model.init_params(cfg, 1))  # far from uniform
    assert {"role_embed", "index_embed"} <= set(params)
    tok = jnp.asarray([row])
    seg = jnp.ones_like(tok)
    # jitted, as the predictor runs it: one compile each (eagerly, every call compiles its
    # layer scan anew, 20 s of this test on 2 cores)
    fwd = jax.jit(lambda p, t, s: model.forward(p, t, s, cfg))
    probed = jax.jit(lambda p, t, s, pr: model.forward(p, t, s, cfg, probes=pr))
    places = [(12, B + 0x33), (11, B + 0x70), (5, V.DST_IPV4), (9, B + 7)]
    if extra:  # the third measurement's RTT (its destination before it), a destination byte
        places += [(len(row) - 2, B + 0x11), (len(row) - 3, B + 0x41), (len(row) - 5, B + 129)]
    prevs, probes = (jnp.asarray([[x[k] for x in places]]) for k in (0, 1))
    _, lp = probed(params, tok, seg, (probes, prevs))
    for k, (prev, probe) in enumerate(places):
        written = np.array(row)
        written[prev + 1] = probe
        full = fwd(params, jnp.asarray([written]), seg)
        np.testing.assert_allclose(np.asarray(lp)[0, k], np.asarray(full)[0, prev + 1],
                                   rtol=2e-5, atol=5e-5)


def test_a_model_with_a_score_bias_resolves_to_xla_unless_told():
    """match_dst's bias on head 0: auto on a CPU is XLA (on a GPU the dense kernel, which
    takes the bias: tests/test_cudnn_lowering.py); an explicit cudnn is the split path (head
    0 apart), checked like any other: on this CPU, it says why not."""
    from prep.base.errors import InputError
    from train.model import attention

    assert attention.resolve("auto", bias=True) == "xla"
    with pytest.raises(InputError, match="--attention cudnn: no NVIDIA GPU"):
        attention.resolve("cudnn", bias=True)


def test_byte_waves_are_a_reparameterization_of_the_byte_rows():
    """byte_features changes only the byte rows of the embedding and the byte columns of the
    head, by the learned mix of fixed waves; the first wave rises over 0..255."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=16, byte_features=3)
    p = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    w = model.byte_waves(3)
    assert w.shape == (256, 6) and np.all(np.diff(w[:, 0]) < 0)  # cos(2 pi v / 512) falls
    embed, head = model.tables(p, cfg)
    lo, hi = V.BYTE_OFFSET, V.BYTE_OFFSET + 256
    np.testing.assert_array_equal(np.asarray(embed)[:lo], np.asarray(p["embed"])[:lo])
    np.testing.assert_array_equal(np.asarray(head)[:, hi:], np.asarray(p["head"])[:, hi:])
    np.testing.assert_allclose(np.asarray(embed)[lo:hi] - np.asarray(p["embed"])[lo:hi],
                               w @ np.asarray(p["wave_in"]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(head)[:, lo:hi] - np.asarray(p["head"])[:, lo:hi],
                               np.asarray(p["wave_out"]) @ w.T, atol=1e-6)
    assert arch.n_params(cfg) == arch.n_params(dataclasses.replace(cfg, byte_features=0)) + (
        2 * 6 * 64)


def _lr_at(run, step):
    return next(r["lr"] for r in map(json.loads, (Path(run) / "metrics.jsonl").open())
                if r.get("step") == step and "lr" in r)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("objective") / "shards", rows_per_shard=64)


def test_resume_with_more_steps_keeps_the_schedule(shards, tmp_path):
    # small()'s settings (tests/helpers.py): the re-spanned run below is the 20-step
    # schedule whose step the session compiled already
    base = dict(data=str(shards), steps=10, batch_size=4, lr=3e-3, warmup=3,
                log_every=1, eval_every=0, ckpt_every=0)
    run = tmp_path / "run"
    train(TrainConfig(run_dir=str(run), **base))
    cfg = json.loads((run / "config.json").read_text())["train"]
    assert cfg["schedule_steps"] == 10
    args = ["--data", str(shards), "--run-dir", str(run), "--resume", "--steps", "14",
            "--log-every", "1", "--eval-every", "0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "steps after 10 run at the schedule's final rate 0.0003" in r.stderr
    # the metric is the rate of the step's update: step s logs schedule(s - 1)
    assert _lr_at(run, 10) > 3e-4 and all(
        np.isclose(_lr_at(run, s), 3e-4, rtol=1e-5) for s in (12, 13, 14))
    # re-spanning on purpose raises the rate again, and says so
    r = CliRunner().invoke(main, args[:6] + ["20", "--schedule-steps", "20", *args[7:]])
    assert r.exit_code == 0, r.output
    assert "re-spanned to 20 steps" in r.stderr
    assert _lr_at(run, 16) > 6e-4  # 8.4e-4: above twice the final rate again


def test_dst_memory_rows_from_the_completing_byte_to_the_measurement_end():
    """A measurement's tokens read its destination's memory row from the byte that completes
    the destination on (here, ROW2's second measurement names it last, at its final token);
    one destination, one row; another destination, another row; padding reads nothing.
    Probes standing where a row token stands read what that token reads."""
    tok = jnp.asarray([ROW2 + [0, 0]])
    seg = jnp.asarray([[1] * len(ROW2) + [0, 0]])
    n1, n2 = len(ROW), len(ROW2) - len(ROW) - 14
    row, on, _, _ = model.dst_memory_rows(tok, seg, 1024)
    row, on = np.asarray(row)[0], np.asarray(on)[0]
    want = np.zeros(len(ROW2) + 2, bool)
    want[10:n1] = True  # ROW: 193.0.14.129 is whole at its 4th byte (index 10)
    want[n1 + n2 - 1] = True  # the second names it at its last token
    want[n1 + n2 + 10:len(ROW2)] = True  # the third (193.0.14.130): src, dst, then the result
    np.testing.assert_array_equal(on, want)
    assert row[10] == row[n1 + n2 - 1] != row[n1 + n2 + 10]
    assert len(set(row[10:n1].tolist())) == 1 and 0 <= row.min() and row.max() < 1024
    # probes: each token of the row again, as if written right after its predecessor
    prev = np.arange(len(ROW2) - 1)
    p_tok = jnp.asarray(np.asarray(ROW2)[1:][None])
    _, _, p_row, p_on = model.dst_memory_rows(tok, seg, 1024, (p_tok, jnp.asarray(prev[None])))
    np.testing.assert_array_equal(np.asarray(p_on)[0], want[1:len(ROW2)])
    np.testing.assert_array_equal(np.asarray(p_row)[0][want[1:len(ROW2)]],
                                  row[1:len(ROW2)][want[1:len(ROW2)]])


def test_dst_memory_changes_only_tokens_after_a_whole_destination():
    """With the memory on, the logits before any destination is whole equal those of the
    same parameters without it; after it, they differ (the row is added)."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(ROW2), dst_memory=256)
    off = dataclasses.replace(cfg, dst_memory=0)
    # the memory's rows; the prior's rows of 16, its map to the vocabulary, its gate
    assert arch.n_params(cfg) == arch.n_params(off) + 256 * 64 + 256 * 16 + 16 * 267 + 64
    params = model.init_params(cfg, 0)
    tok, seg = jnp.asarray([ROW2]), jnp.ones((1, len(ROW2)), jnp.int32)
    new = ("dst_memory", "prior_table", "prior_out", "prior_gate")
    without = np.asarray(jax.jit(lambda p: model.forward(p, tok, seg, off))(
        {k: v for k, v in params.items() if k not in new}))[0]
    for c in (cfg, dataclasses.replace(cfg, dst_prior_scale=0.0)):
        got = np.asarray(jax.jit(lambda p: model.forward(p, tok, seg, c))(
            {k: v for k, v in params.items() if c.dst_prior_scale or k in ("dst_memory",)
             or k not in new}))[0]
        np.testing.assert_allclose(got[:10], without[:10], rtol=1e-5, atol=1e-5)
        assert np.abs(got[10] - without[10]).max() > 1e-3
    with pytest.raises(ValueError, match="power of two"):
        dataclasses.replace(cfg, dst_memory=1000)


def test_the_destination_prior_can_leave_the_results_split_alone():
    """dst_prior_result=False: the destination prior moves no FAILED or RTT_START logit
    (the same with its rows zeroed), so P(failed) is the layers' alone; it still moves
    the other tokens' after a whole destination. With True (the default) it moves them."""
    # (without small's anchor, which sets P(failed) before a result from the counts: the
    # logits here are the layers' and the prior's)
    on = dataclasses.replace(arch.MODELS["small"], seq_len=len(ROW2), dst_memory=256,
                             dst_prior_result=True, context_fail_anchor=False, fail_dst=False)
    off = dataclasses.replace(on, dst_prior_result=False)
    assert arch.MODELS["tiny"].dst_prior_result and not arch.MODELS["small"].dst_prior_result
    params = model.init_params(on, 0)
    params["prior_table"] = jnp.asarray(params["prior_table"]) * 50.0  # a prior that says much
    zero = {**params, "prior_table": jnp.zeros_like(params["prior_table"])}
    tok, seg = jnp.asarray([ROW2]), jnp.ones((1, len(ROW2)), jnp.int32)
    res = [V.FAILED, V.RTT_START]
    for cfg, moves in ((off, False), (on, True)):
        a, b = (np.asarray(jax.jit(lambda p: model.forward(p, tok, seg, cfg))(q))[0]
                for q in (params, zero))
        assert (np.abs(a[:, res] - b[:, res]).max() > 1e-3) == moves
        rest = np.ones(a.shape[1], bool)
        rest[res] = False
        assert np.abs(a[10:, rest] - b[10:, rest]).max() > 1e-3


def test_anonymize_sources_keeps_each_address_within_its_context():
    """Only source bytes move; one address stays one address within a segment (ROW2's three
    measurements share 10.0.0.1), another segment or another step gets another address, and
    the same step gives the same bytes."""
    row = ROW2 + ROW
    seg_ids = [1] * len(ROW2) + [2] * len(ROW)
    tok, seg = jnp.asarray([row, row]), jnp.asarray([seg_ids, seg_ids])
    a = np.asarray(model.anonymize_sources(tok, seg, jnp.int32(7)))
    role = np.asarray(model.token_roles(tok, seg))
    np.testing.assert_array_equal(a[role != 2], np.asarray(tok)[role != 2])
    src = [a[0][role[0] == 2][4 * k:4 * k + 4].tolist() for k in range(4)]  # 4 measurements
    assert src[0] == src[1] == src[2] != [B + 10, B, B, B + 1] and src[3] != src[0]
    assert a[1][role[1] == 2][:4].tolist() != src[0]  # another row: another context
    again = np.asarray(model.anonymize_sources(tok, seg, jnp.int32(7)))
    later = np.asarray(model.anonymize_sources(tok, seg, jnp.int32(8)))
    np.testing.assert_array_equal(a, again)
    assert (later != a).any()
    assert ((a >= B) & (a < B + 256))[role == 2].all()


def _reply(b1, b2, dst_last=129):
    """ROW with its RTT bytes (and the last destination byte) replaced."""
    r = list(ROW)
    r[10], r[12], r[13] = B + dst_last, B + b1, B + b2
    return r


# three replies to 193.0.14.129, a failed ping to it, a reply to 193.0.14.130, the query
FAILED_ROW = ROW[:11] + [V.FAILED, V.TIMESTAMP_DELTA1, B + 240]
COPY_ROW = (_reply(0x68, 0x20) + _reply(0x68, 0x30) + FAILED_ROW + _reply(0x69, 0x05)
            + _reply(0x10, 0x10, dst_last=130) + _reply(0x68, 0x25))
Q = len(COPY_ROW) - len(ROW)  # the query's first token
A = 0.3  # the alpha of the test


def test_context_copy_weighs_the_earlier_replies_as_an_ema():
    """Before the query's first RTT byte: the first bytes of the three earlier replies to
    its destination, weighted 0.49, 0.21, 0.3 (an EMA of 0.3, oldest first); the failed
    ping and the other destination's reply count for nothing. Before its second byte (0x68
    written): the second bytes of the two replies whose first byte is 0x68 (0.7, 0.3). A
    probe 0x69 in place of the first byte asks for 0x05 alone."""
    tok, seg = jnp.asarray([COPY_ROW]), jnp.asarray([[1] * len(COPY_ROW)])
    m, p_m = model.same_destination(tok, seg)
    (dist, on), _ = model.context_copy(tok, seg, m, A)
    dist, on = np.asarray(dist)[0], np.asarray(on)[0]
    rs, b1 = Q + 11, Q + 12  # the query's RTT_START and its first RTT byte
    assert sorted(np.flatnonzero(on)) == [len(ROW) + 11, len(ROW) + 12, 2 * len(ROW) + 14 + 11,
                                          rs, b1]
    want1 = np.zeros(256)
    want1[0x68], want1[0x69] = 0.49 + 0.21, 0.3
    np.testing.assert_allclose(dist[rs], want1, atol=1e-6)
    want2 = np.zeros(256)
    want2[0x20], want2[0x30] = 0.7, 0.3
    np.testing.assert_allclose(dist[b1], want2, atol=1e-6)
    # the second reply reads the first alone; the fourth's first byte (0x69) has no match
    assert dist[len(ROW) + 11, 0x68] == pytest.approx(1.0)
    probes = (jnp.asarray([[B + 0x69, B + 0x68]]), jnp.asarray([[rs, rs]]))
    m, p_m = model.same_destination(tok, seg, probes)
    _, (p_dist, p_on) = model.context_copy(tok, seg, m, A, probes, p_m)
    assert np.asarray(p_on)[0].tolist() == [True, True]
    assert np.asarray(p_dist)[0, 0, 0x05] == pytest.approx(1.0)
    np.testing.assert_allclose(np.asarray(p_dist)[0, 1], want2, atol=1e-6)


@pytest.mark.parametrize("bias, copied", [(30.0, True), (-30.0, False)])
def test_context_copy_gate_mixes_the_copy_into_the_distribution(bias, copied):
    """A gate held open gives the copy's distribution where it is on; held shut, the model's
    own (the same as with the copy off, everywhere)."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(COPY_ROW), context_copy=A)
    off = dataclasses.replace(cfg, context_copy=0.0)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    params = {**params, "copy_gate": params["copy_gate"] * 0, "copy_bias": jnp.float32(bias),
              "copy_width": jnp.full(2, -40.0)}  # copied bytes one-hot
    tok, seg = jnp.asarray([COPY_ROW]), jnp.asarray([[1] * len(COPY_ROW)])
    lp = np.asarray(jax.nn.log_softmax(model.forward(params, tok, seg, cfg)))[0]
    own = np.asarray(jax.nn.log_softmax(model.forward(
        {k: v for k, v in params.items() if not k.startswith("copy_")}, tok, seg, off)))[0]
    rs = Q + 11
    if copied:
        assert np.exp(lp[rs, B + 0x68]) == pytest.approx(0.7, abs=1e-4)
        assert np.exp(lp[rs, B + 0x69]) == pytest.approx(0.3, abs=1e-4)
        np.testing.assert_allclose(lp[:len(ROW) + 11], own[:len(ROW) + 11], atol=1e-5)
    else:
        np.testing.assert_allclose(lp, own, atol=1e-5)


def test_a_copied_byte_spreads_as_a_laplace_kernel():
    """A reply's byte b becomes weights exp(-|v - b| / width) over the 256 values, summing
    to 1; the copy of the planted row with widths 1 and 4 is the one-hot copy so spread."""
    k = np.asarray(model._byte_kernel(jnp.asarray([100, 0]), 2.0))
    assert k.sum(-1) == pytest.approx([1.0, 1.0])
    assert k[0, 100] / k[0, 102] == pytest.approx(np.e) and k[0, 99] == pytest.approx(k[0, 101])
    assert k[1].argmax() == 0 and k[1, 0] / k[1, 2] == pytest.approx(np.e)
    tok, seg = jnp.asarray([COPY_ROW]), jnp.asarray([[1] * len(COPY_ROW)])
    m, _ = model.same_destination(tok, seg)
    (sharp, _), _ = model.context_copy(tok, seg, m, A)
    (smooth, _), _ = model.context_copy(tok, seg, m, A, widths=(1.0, 4.0))
    rs, b1 = Q + 11, Q + 12
    for pos, w in ((rs, 1.0), (b1, 4.0)):
        kern = np.asarray(model._byte_kernel(jnp.arange(256), w))  # [b, v]
        np.testing.assert_allclose(np.asarray(smooth)[0, pos], np.asarray(sharp)[0, pos] @ kern,
                                   atol=1e-6)


def test_context_copy_gradients_are_finite():
    """The spread copy's far bytes underflow to 0: their log is clamped, so the gradient
    (the widths' among them) stays finite, and the widths and the gate receive one."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(COPY_ROW), context_copy=A)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    batch = {"tokens": jnp.asarray([COPY_ROW]), "segment_ids": jnp.asarray([[1] * len(COPY_ROW)])}
    g = jax.grad(lambda p: model.loss_sum(p, batch, cfg)[0])(params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))
    assert np.abs(np.asarray(g["copy_width"])).min() > 0 and abs(float(g["copy_bias"])) > 0


def test_copy_aux_adds_the_own_distributions_loss():
    """copy_aux w: the objective is the mixed loss plus w times the loss of the model's own
    distribution before the copy (the same targets, the same role weights); the sums it
    reports stay the mixed ones."""
    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=len(COPY_ROW), context_copy=A)
    aux = dataclasses.replace(cfg, copy_aux=0.5)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    batch = {"tokens": jnp.asarray([COPY_ROW]), "segment_ids": jnp.asarray([[1] * len(COPY_ROW)])}
    w = (1.0,) * 5 + (10.0, 10.0)
    t0, n0, obj0 = model.loss_sum(params, batch, cfg, role_weights=w)
    t1, n1, obj1 = model.loss_sum(params, batch, aux, role_weights=w)
    assert (float(t1), float(n1)) == pytest.approx((float(t0), float(n0)), rel=1e-6)
    logits, own = model.forward(params, batch["tokens"], batch["segment_ids"], cfg, own=True)
    targets, mask = model.targets_and_mask(batch["tokens"], batch["segment_ids"])
    roles = np.asarray(model.target_roles(batch["tokens"], batch["segment_ids"]))[0]
    wt = np.zeros(model.N_ROLES)
    wt[:len(w)] = w
    ce = lambda lg: np.asarray(optax_ce(lg, targets))[0]
    m = np.asarray(mask)[0]
    want = ((wt[roles] * (ce(logits) + 0.5 * ce(own)))[m].sum() / wt[roles][m].sum())
    assert float(obj1) == pytest.approx(want, rel=1e-5)
    assert not np.allclose(np.asarray(logits), np.asarray(own))  # the copy is on somewhere


def optax_ce(logits, targets):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
