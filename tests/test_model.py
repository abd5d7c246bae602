"""The model over packed rows: each context in a packed row behaves exactly as if alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prep.schema import rows, vocab
from train.model import arch, attention, model
from train.model.arch import MODELS

pytestmark = pytest.mark.no_kernel_warmup  # the model alone

CFG = dataclasses.replace(MODELS["tiny"], seq_len=32)
LENGTHS = (10, 12, 7)  # three contexts, then 3 tokens of padding


def packed_row(seed=0):
    rng = np.random.default_rng(seed)
    tokens = np.zeros(CFG.seq_len, np.int32)
    segs = np.zeros(CFG.seq_len, np.int32)
    s = 0
    for k, n in enumerate(LENGTHS):
        tokens[s:s + n] = rng.integers(0, CFG.vocab_size, n)
        segs[s:s + n] = k + 1
        s += n
    return tokens, segs


def alone_rows(tokens, segs):
    """Each context at the start of a row of its own, padded to the same length."""
    out = []
    for k in range(1, segs.max() + 1):
        ctx = tokens[segs == k]
        t = np.zeros_like(tokens)
        s = np.zeros_like(segs)
        t[:len(ctx)], s[:len(ctx)] = ctx, 1
        out.append((t, s))
    return out


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, model.init_params(CFG, 0))


def test_positions_and_targets_match_row_format():
    segs = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    toks = np.arange(16).reshape(2, 8)
    pos = model.positions(jnp.asarray(segs))
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(pos, rows.positions(segs))
    tgt, mask = model.targets_and_mask(jnp.asarray(toks), jnp.asarray(segs))
    np.testing.assert_array_equal(mask, [[1, 1, 0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(mask, rows.loss_mask(segs))
    np.testing.assert_array_equal(tgt[0, :7], toks[0, 1:])


def test_segment_mask_is_causal_and_block_diagonal():
    m = np.asarray(attention.segment_mask(jnp.array([[1, 1, 2, 2, 0]])))[0, 0]
    expect = np.array([[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [0, 0, 1, 0, 0],
                       [0, 0, 1, 1, 0],
                       [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(m, expect)


def test_segment_layout_for_cudnn():
    segs = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.uint8)
    seqlen, offsets = attention.segment_layout(segs, max_segments=4)
    np.testing.assert_array_equal(seqlen, [[3, 2, 1, -1], [8, -1, -1, -1]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
    assert seqlen.dtype == offsets.dtype == jnp.int32


def test_packed_logits_equal_each_context_alone(params):
    tokens, segs = packed_row()
    fwd = jax.jit(lambda p, t, s: model.forward(p, t[None], s[None], CFG)[0])
    packed = fwd(params, tokens, segs)
    for k, (t, s) in enumerate(alone_rows(tokens, segs), start=1):
        alone = fwd(params, t, s)
        n = LENGTHS[k - 1]
        np.testing.assert_allclose(packed[segs == k], alone[:n], rtol=1e-5, atol=1e-5)


def test_packed_gradients_equal_sum_over_contexts_alone(params):
    tokens, segs = packed_row(seed=1)
    # (gradient of the loss sum, the number of targets counted): one compile for both
    grad = jax.jit(jax.grad(lambda p, b: model.loss_sum(p, b, CFG)[:2], has_aux=True))
    g_packed, n_targets = grad(params, {"tokens": tokens[None], "segment_ids": segs[None]})
    alone = alone_rows(tokens, segs)
    g_alone = [grad(params, {"tokens": t[None], "segment_ids": s[None]})[0] for t, s in alone]
    # summed on the host (on the device, each leaf's addition compiled on its own)
    g_sum = jax.tree.map(lambda *g: sum(np.asarray(x) for x in g), *g_alone)
    for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_sum)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert int(n_targets) == sum(n - 1 for n in LENGTHS)  # none predicts the next context


def test_lookup_gradient_counts_each_row_its_uses():
    """model.lookup: the rows of ``table[ids]``; its gradient is the one-hot matmul, so a row
    used n times gets n times the cotangent, accumulated in float32 (the gather's own
    gradient, a bf16 scatter-add, gave 256 for the 300 on JAX 0.10's CPU)."""
    table = jnp.arange(12.0, dtype=jnp.bfloat16).reshape(4, 3)
    ids = jnp.asarray([[2, 0, 2, 2]] + [[3, 3, 3, 3]] * 75)  # row 2 thrice, 0 once, 3 300 times
    np.testing.assert_array_equal(model.lookup(table, ids[:1]), table[ids[:1]])
    grad = jax.grad(lambda t: model.lookup(t, ids).astype(jnp.float32).sum())(table)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.float32(grad), [[1] * 3, [0] * 3, [3] * 3, [300] * 3])


def test_base_gradient_has_no_scatter():
    """The embedding's gradient is a matmul: no scatter in base's compiled backward (an H200
    spent 30 ms of a 127 ms step in it, docs/learning.md 6.5); the logits are unchanged."""
    cfg = dataclasses.replace(MODELS["base"], n_layers=2, seq_len=64)
    p = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64)), jnp.int32)
    seg = jnp.ones((2, 64), jnp.int32)
    ac = attention.AttentionConfig("xla", 8, jnp.bfloat16)
    fwd = lambda p: model.forward(p, tok, seg, cfg, ac)
    text = jax.jit(jax.grad(lambda p: fwd(p).astype(jnp.float32).sum())).lower(p).as_text()
    assert "scatter" not in text and "dot_general" in text
    x = jnp.asarray(p["embed"]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(model.lookup(x, tok), x[tok])


def test_base_config_size():
    n = arch.n_params(MODELS["base"])
    assert n == 20 * (4 * 640 * 640 + 2 * 640 * 2560 + 2 * 640) + 2 * 267 * 640 + 640
    tiny = MODELS["tiny"]
    assert arch.n_params(tiny) == sum(x.size for x in jax.tree.leaves(model.init_params(tiny, 0)))
    # data (filled at a run's start, not learned) is not counted: fail_anchor_fixed's six
    # constants, the pair store's latest replies
    small = MODELS["small"]
    assert small.context_fail_anchor and not small.fail_anchor_fixed
    fixed = dataclasses.replace(small, fail_anchor_fixed=True)
    assert arch.n_params(fixed) == arch.n_params(small) - 6
    assert arch.n_params(dataclasses.replace(small, pair_recent_own=False)) == arch.n_params(small)


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_decay_mask_is_the_old_rule_leaf_by_leaf(name):
    """The model's own mask (from its parameter structure) decays exactly what the old
    rule did: every parameter whose tree path does not contain "norm"; and not the
    destination match's gain (small), a gain like the norms', nor the destination memory's
    and prior's rows (small), which keep what they learned between a destination's visits,
    nor the context copy's and the stores' gate biases and widths (small: scalars with a
    meaning of their own), nor P(failed)'s anchor's constants and bias (small), nor the
    stores themselves (data: P(failed)'s priors by destination too)."""
    cfg = MODELS[name]
    shapes = arch.map_params(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32),
                             arch.param_specs(cfg))
    old = jax.tree_util.tree_map_with_path(
        lambda path, _: not any(w in jax.tree_util.keystr(path)
                                for w in ("norm", "gain", "dst_memory", "prior_table",
                                          "copy_bias", "copy_width", "dst_store",
                                          "store_bias", "store_width", "pair_store",
                                          "pair_bias", "pair_width", "placed_bias",
                                          "placed_width", "krig_store", "krig_noise",
                                          "krig_bias", "krig_width", "fwd_bias", "fwd_width",
                                          "fail_bias", "cfail_bias", "pair_latest",
                                          "['fanchor']", "fanchor_bias", "fail_dst")),
        shapes)
    new = arch.decay_mask(cfg)
    assert jax.tree.structure(new) == jax.tree.structure(old)
    assert jax.tree.leaves(new) == jax.tree.leaves(old)
    gains = ["match_gain"] if name == "small" else []
    assert sorted(k for k, v in new["layers"].items() if not v) == ["attn_norm", *gains,
                                                                    "mlp_norm"]
    assert new["final_norm"] is False and new["embed"] is True and new["head"] is True


def test_init_draws_in_jax_tree_order():
    """Seeded parameters are what jax.tree.map over the specs drew before: a run re-made
    from its seed, or a resume, sees the same numbers."""
    rng = np.random.default_rng(3)
    old = jax.tree.map(lambda p: p.std * rng.standard_normal(p.shape, np.float32) if p.std
                       else np.ones(p.shape, np.float32),
                       arch.param_specs(CFG), is_leaf=lambda x: isinstance(x, arch.Param))
    new = model.init_params(CFG, 3)
    assert jax.tree.structure(new) == jax.tree.structure(old)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
        np.testing.assert_array_equal(a, b)


# what train.fit.step's old formula gave: 6 * (parameters - embedding) per token, 12 * L *
# n_heads * head_dim per key seen; and for the 8 rows of counting_rows(8, 1024, seed=0,
# max_segments=16, pad=2): 8,176 real tokens seeing 1,743,812 keys
FLOPS = {"tiny": (694_272, 1_536, 8_354_863_104), "base": (591_006_720, 153_600, 5_099_920_465_920)}


@pytest.mark.parametrize("name", ["tiny", "base"])
def test_flop_count_is_pinned(name):
    from prep.tools import synthetic_shards as synthetic

    cfg = MODELS[name]
    per_token, per_key, batch = FLOPS[name]
    assert model.train_flops(cfg, 1, 0) == per_token == 6 * model.matmul_params(cfg)
    assert model.train_flops(cfg, 0, 1) == per_key
    _, segs = synthetic.counting_rows(8, 1024, seed=0, max_segments=16, pad=2)
    counts = model.flop_counts(jnp.asarray(segs))
    assert (int(counts["tokens"]), float(counts["attn_ctx"])) == (8_176, 1_743_812.0)
    assert model.train_flops(cfg, float(counts["tokens"]), float(counts["attn_ctx"])) == batch


def _random_qkv(B=2, T=256, N=4, H=64, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(x, (B, T, N, H), dtype) for x in ks)
    segs = np.zeros((B, T), np.int32)
    segs[0, :100], segs[0, 100:180], segs[0, 180:250] = 1, 2, 3  # 6 tokens of padding
    segs[1, :] = 1
    return q, k, v, g, jnp.asarray(segs)


def _rows(case: str, B=2, T=256, max_segments=8) -> np.ndarray:
    """Segment ids of B rows: one segment, two (and padding), the most the tables hold,
    and rows of padding only beside a real one."""
    segs = np.zeros((B, T), np.int32)
    if case == "one":
        segs[:, :] = 1
    elif case == "two":
        segs[:, :150], segs[:, 150:250] = 1, 2  # 6 tokens of padding
    elif case == "max":
        segs[:, :] = np.repeat(np.arange(1, max_segments + 1), T // max_segments)
    elif case == "padding_only":
        segs[0, :100] = 1  # row 1 is all padding
    return segs


@pytest.mark.gpu
@pytest.mark.skipif(not attention.cudnn_available(),
                    reason="needs an NVIDIA Hopper+ GPU where the cuDNN packed attention compiles")
@pytest.mark.parametrize("case", ["one", "two", "max", "padding_only", "mixed"])
def test_cudnn_packed_equals_xla(case):
    q, k, v, g, segs = _random_qkv()
    if case != "mixed":
        segs = jnp.asarray(_rows(case))
    real = (segs > 0)[:, :, None, None]

    def run(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segs), q, k, v)
        return [x * real for x in (out, *vjp(g * real))]

    cudnn = jax.jit(lambda: run(lambda *a: attention.cudnn_attention(*a, max_segments=8)))()
    xla = jax.jit(lambda: run(attention.xla_attention))()
    for a, b in zip(cudnn, xla):  # JAX's own tolerances for its packed-layout test
        assert np.isfinite(np.float32(a)).all()
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(attention.why_not_dense() is not None,
                    reason="needs an NVIDIA GPU where cuDNN's dense attention compiles")
@pytest.mark.parametrize("case", ["two", "max", "padding_only", "mixed"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cudnn_dense_equals_xla(case, with_bias):
    """--attention dense: cuDNN's dense causal kernel, the segments as a mask (and a bias on
    head 0, as the match head's), against the XLA attention, outputs and gradients: each
    no farther from the float32 truth (the XLA attention on the same inputs in float32) than
    twice the XLA attention's own bf16 error. A fixed tolerance does not hold bf16 sums: on
    an H200 (2026-11-30) 2 of 131,072 values of dq, at one token, were 0.0156 from XLA's,
    over rtol=atol=1e-2; a wrong mask or bias is off by O(1) at many tokens."""
    q, k, v, g, segs = _random_qkv()
    if case != "mixed":
        segs = jnp.asarray(_rows(case))
    real = (segs > 0)[:, :, None, None]
    n, t = segs.shape
    # as the match head's: 4 where a key names the query's destination (bf16 holds it exactly)
    bias = (jnp.asarray(4.0 * (np.random.default_rng(2).random((n, 1, t, t)) < 0.1),
                        jnp.float32) if with_bias else None)

    def run(impl, dtype=jnp.bfloat16):
        q_, k_, v_, g_ = (x.astype(dtype) for x in (q, k, v, g))
        out, vjp = jax.vjp(lambda q, k, v: attention.attention(
            q, k, v, segs, implementation=impl, max_segments=8, bias=bias), q_, k_, v_)
        return [(x * real).astype(jnp.float32) for x in (out, *vjp(g_ * real))]

    dense, xla = (jax.jit(lambda impl=impl: run(impl))() for impl in ("dense", "xla"))
    truth = jax.jit(lambda: run("xla", jnp.float32))()
    outs = (map(np.asarray, x) for x in (dense, xla, truth))
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), *outs):
        assert np.isfinite(a).all(), name
        err, ref = np.abs(a - c), np.abs(b - c)
        assert err.max() <= 2 * ref.max() + 1e-3 and err.mean() <= 2 * ref.mean() + 1e-5, (
            f"{name}: max |dense - f32| {err.max():.3g} (XLA bf16: {ref.max():.3g}), mean "
            f"{err.mean():.3g} ({ref.mean():.3g}); worst at (b, t, n, h) "
            f"{[int(i) for i in np.unravel_index(err.argmax(), err.shape)]}")


@pytest.mark.gpu
@pytest.mark.skipif(not attention.cudnn_available(),
                    reason="needs an NVIDIA Hopper+ GPU where the cuDNN packed attention compiles")
def test_cudnn_model_logits_equal_xla(params):
    tokens, segs = packed_row()
    cfg = dataclasses.replace(CFG, seq_len=32)
    fwd = lambda impl: model.forward(params, jnp.asarray(tokens[None]), jnp.asarray(segs[None]),
                                     cfg, attention.AttentionConfig(impl, 8, jnp.bfloat16))
    real = segs > 0
    np.testing.assert_allclose(fwd("cudnn")[0][real], fwd("xla")[0][real], rtol=2e-2, atol=2e-2)


def test_probe_logits_equal_the_row_with_that_token_written(params):
    """A probe after position p with token x gives the logits the row gives at p + 1
    when x is written there: inside a segment, at its end, and past the row's content."""
    tokens, segs = packed_row(3)
    cases = [(4, 17), (9, 200), (15, 3), (28, 99), (28, 5)]  # (prev, token): seg 1 mid/end, seg 2, seg 3 end
    p_prev = jnp.array([[p for p, _ in cases]], jnp.int32)
    p_tok = jnp.array([[x for _, x in cases]], jnp.int32)
    # jitted, as the predictor runs it: one compile each (eagerly, every call compiles its
    # layer scan anew, 18 s of this test on 2 cores)
    fwd = jax.jit(lambda p, t, s: model.forward(p, t, s, CFG))
    probed = jax.jit(lambda p, t, s, pr: model.forward(p, t, s, CFG, probes=pr))
    row_logits, probe_logits = probed(params, tokens[None], segs[None], (p_tok, p_prev))
    np.testing.assert_array_equal(row_logits, fwd(params, tokens[None], segs[None]))
    for m, (p, x) in enumerate(cases):
        t, s = tokens.copy(), segs.copy()
        t[p + 1], s[p + 1] = x, segs[p]  # at 28 that overwrites padding: extend segment 3
        want = fwd(params, t[None], s[None])[0, p + 1]
        np.testing.assert_allclose(probe_logits[0, m], want, rtol=2e-5, atol=2e-5)


def test_copyable_source_bytes_are_those_whose_address_stands_earlier_in_the_context():
    """copyable_src counts a later measurement's source bytes only where an earlier
    measurement of the same segment has that whole source address: not a new address (a
    dual-stack probe's first IPv6 source), not one shown only in another segment."""
    V = vocab
    B = V.BYTE_OFFSET

    def m(src, dst=(9, 9, 9, 9)):
        return [V.MEASUREMENT_START, V.DST_IPV4, *[B + x for x in dst],
                V.SRC_IPV4, *[B + x for x in src], V.FAILED]

    a, b, c = (1, 2, 3, 4), (1, 2, 3, 5), (4, 3, 2, 1)  # b differs from a in one byte
    seg1 = m(a) + m(b) + m(b) + m(a)  # later: b new, b seen, a seen
    seg2 = m(c) + m(a) + m(c)  # later: a (seen only in segment 1), c seen
    row = seg1 + seg2
    tokens, segs = np.zeros(96, np.int32), np.zeros(96, np.int32)
    tokens[:len(row)] = row
    segs[:len(seg1)], segs[len(seg1):len(row)] = 1, 2
    cfg = dataclasses.replace(CFG, seq_len=96)
    p = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    out = jax.jit(lambda p, t, s: model.loss_by_role(p, t, s, cfg, copied_src=True))(
        p, tokens[None], segs[None])
    assert float(out[5][0]) == 5 * 4  # every later measurement's source bytes
    assert float(out[8][0]) == 3 * 4  # b seen, a seen (segment 1); c seen (segment 2)
    assert float(out[7][0]) <= float(out[4][0])  # right guesses among them, at most all


def test_measurement_index_and_the_copied_source_bytes():
    """measurement_index restarts per segment; copied_src counts exactly the source-byte
    targets of the measurements after each segment's first."""
    V = vocab
    B = V.BYTE_OFFSET
    m1 = [V.MEASUREMENT_START, V.SRC_IPV4, B + 1, B + 2, B + 3, B + 4, V.DST_IPV4, B + 9, B + 9, B + 9, B + 9, V.FAILED]
    m2 = [V.MEASUREMENT_START, V.DST_IPV4, B + 9, B + 9, B + 9, B + 8, V.SRC_IPV4, B + 1, B + 2, B + 3, B + 4, V.FAILED]
    tokens = np.zeros(64, np.int32)
    segs = np.zeros(64, np.int32)
    row = m1 + m2 + m1 + m2 + m2  # segment 1: m1 m2; segment 2: m1 m2 m2
    tokens[:len(row)] = row
    segs[:24], segs[24:60] = 1, 2
    idx = np.asarray(model.measurement_index(jnp.asarray(tokens[None]), jnp.asarray(segs[None])))[0]
    np.testing.assert_array_equal(idx, np.repeat([0, 1, 0, 1, 2, -1], [12, 12, 12, 12, 12, 4]))
    cfg = dataclasses.replace(CFG, seq_len=64)
    p = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    out = jax.jit(lambda p, t, s: model.loss_by_role(p, t, s, cfg, copied_src=True))(
        p, tokens[None], segs[None])  # jitted, as `train eval` runs it: one compile
    assert len(out) == 9
    assert float(out[5][0]) == 3 * 4  # three later measurements, four source bytes each
    # all three repeat the source of their segment's first measurement
    assert float(out[8][0]) == 3 * 4
    src = vocab.ROLES.index("src")
    assert float(out[2][src]) == 5 * 4  # every source byte follows a token of its segment


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_unrolled_layers_equal_the_scan(name):
    """scan_layers=False runs the same layers, each its own code: the same logits and the
    same gradients, to float32 rounding, as the scan over stacked weights."""
    scan = dataclasses.replace(MODELS[name], seq_len=32, n_layers=3)
    unrolled = dataclasses.replace(scan, scan_layers=False)
    p = jax.tree.map(jnp.asarray, model.init_params(scan, 0))
    tokens, segs = packed_row(seed=2)
    batch = {"tokens": tokens[None], "segment_ids": segs[None]}
    fwd = lambda cfg: jax.jit(lambda p: model.forward(p, tokens[None], segs[None], cfg))(p)
    np.testing.assert_allclose(fwd(scan), fwd(unrolled), rtol=1e-5, atol=1e-5)
    grad = lambda cfg: jax.jit(jax.grad(lambda p: model.loss_sum(p, batch, cfg)[0]))(p)
    ga, gb = grad(scan), grad(unrolled)
    assert jax.tree.structure(ga) == jax.tree.structure(gb)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # each layer its own weights: a loop that read layer 0 three times would differ
    one = {**p, "layers": jax.tree.map(lambda a: jnp.stack([a[0]] * 3), p["layers"])}
    assert not np.allclose(fwd(scan), jax.jit(
        lambda q: model.forward(q, tokens[None], segs[None], unrolled))(one), atol=1e-3)


def test_xla_attention_runs_the_match_heads_bias_on_head_0_alone():
    """The XLA path runs head 0 with the match head's bias and the others without (an
    [B, N, T, T] bias zero off head 0 cost 6x the step at rows of 1,024 on the CPU): the
    same outputs and gradients (q, k, v and the bias) as that full bias, segments masked."""
    rng = np.random.default_rng(4)
    b, t, n, h = 2, 24, 4, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))
    segs = jnp.asarray(np.repeat([[1] * 10 + [2] * 9 + [0] * 5], b, axis=0), jnp.int32)
    bias = jnp.asarray(3.0 * (rng.random((b, 1, t, t)) < 0.2), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)

    def split(q, k, v, bias):
        return jnp.sum(w * attention.attention(q, k, v, segs, implementation="xla",
                                               max_segments=8, bias=bias))

    def full(q, k, v, bias):
        on0 = bias * (jnp.arange(n) == 0).astype(bias.dtype)[None, :, None, None]
        return jnp.sum(w * attention.xla_attention(q, k, v, segs, on0))

    got, want = (jax.value_and_grad(f, argnums=(0, 1, 2, 3))(q, k, v, bias) for f in (split, full))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, wg in zip(got[1], want[1]):
        np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-6)
