"""The cuDNN packed attention, lowered for CUDA on this (CPU) machine: a JAX upgrade that
changes the private API we call fails here, in CI, instead of in a user's GPU run. Plus the
segment tables in both conventions and the CPU-side choices of `resolve`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from prep.base.errors import InputError
from train.model import attention

B, T, N, H, M = 2, 64, 2, 16, 4
TARGETS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


DENSE = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")


def cuda_custom_calls(fn) -> list[dict]:
    """Every cuDNN custom call of ``fn`` exported for CUDA: target, mask, max segments,
    operand types."""
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TARGETS + DENSE]
    text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
        x, x, x, seg).mlir_module()
    calls = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @([\w$]+)\(", line)
        if not m or not m.group(1).startswith("__cudnn"):
            continue
        calls.append({
            "target": m.group(1),
            "mask": re.search(r"mask_type\\22: \\22(\w+)\\22", line).group(1),
            "max_seg_per_batch": int(re.search(r"max_seg_per_batch\\22: (\d+)", line).group(1)),
            "operands": re.findall(r"tensor<([\dx]*x?\w+)>", line[line.rindex(" : (") + 4:
                                                                  line.rindex(") -> ")]),
        })
    return calls


def forward(q, k, v, s):
    return attention.cudnn_attention(q, k, v, s, max_segments=M)


def gradient(q, k, v, s):
    return jax.grad(lambda q, k, v: forward(q, k, v, s).astype(jnp.float32).sum(),
                    (0, 1, 2))(q, k, v)


QKV = [f"{B}x{T}x{N}x{H}xbf16"] * 3
TABLES = [f"{B}x{M}xi32", f"{B}x{M}xi32", f"{B}x{M + 1}xi32", f"{B}x{M + 1}xi32"]


def test_forward_lowers_to_the_packed_cudnn_kernel(no_cuda_probes):
    (call,) = cuda_custom_calls(forward)
    assert call == {"target": "__cudnn$fmhaSoftmax", "mask": "PADDING_CAUSAL",
                    "max_seg_per_batch": M, "operands": QKV + TABLES}


def test_gradient_lowers_to_the_packed_cudnn_kernels(no_cuda_probes):
    calls = cuda_custom_calls(gradient)
    assert [c["target"] for c in calls] == list(TARGETS)
    assert all(c["mask"] == "PADDING_CAUSAL" and c["max_seg_per_batch"] == M for c in calls)
    assert calls[0]["operands"] == QKV + TABLES
    # backward: q, k, v, softmax statistics, output, output gradient, then the same tables
    assert calls[1]["operands"][:3] == QKV and calls[1]["operands"][-4:] == TABLES


SEGS = jnp.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.uint8)


@pytest.mark.parametrize("missing", [-1, 0])
def test_segment_layout_in_either_convention(missing):
    seqlen, offsets = attention.segment_layout(SEGS, max_segments=4, missing=missing)
    x = missing
    np.testing.assert_array_equal(seqlen, [[3, 2, 1, x], [8, x, x, x]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, x, x], [0, x, x, x, x]])


def test_missing_segment_value_follows_the_wrappers_docstring(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    assert attention.missing_segment_value() == -1  # what JAX 0.10.2 documents
    fake = lambda *a, **k: None
    fake.__doc__ = "q_seqlen: ... fill the padded entries with 0. q_offsets: ... with 0."
    monkeypatch.setattr(cudnn, "dot_product_attention", fake)
    assert attention.missing_segment_value() == 0


def test_resolve_on_a_cpu():
    assert attention.why_not_cudnn() == "no NVIDIA GPU (cpu)"
    assert attention.resolve("auto") == "xla"
    with pytest.raises(InputError, match="--attention cudnn: no NVIDIA GPU"):
        attention.resolve("cudnn")


@pytest.mark.parametrize("dense, packed, bias, want", [
    (None, None, False, "dense"), (None, None, True, "dense"),  # the default since 2026-11-30
    ("old cuDNN", None, False, "cudnn"), ("old cuDNN", None, True, "xla"),
    ("old cuDNN", "pre-Hopper", False, "xla")])
def test_auto_on_a_gpu_is_dense_then_packed_then_xla(monkeypatch, capsys, dense, packed, bias,
                                                     want):
    """"auto" on a GPU: cuDNN's dense kernel where it compiles (it takes the match head's
    bias), else the packed one for a model without a bias, else XLA with one line naming both
    reasons (docs/learning.md 6.6: dense 1.12x packed on an H200)."""
    import types

    monkeypatch.setattr(attention.jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")])
    monkeypatch.setattr(attention, "why_not_dense", lambda: dense)
    monkeypatch.setattr(attention, "why_not_cudnn", lambda: packed)
    assert attention.resolve("auto", bias=bias) == want
    err = capsys.readouterr().err
    if want == "xla":
        why = "the model's match_dst head adds a bias" if bias else packed
        assert err == (f"attention: cuDNN's dense attention unavailable (old cuDNN), its packed "
                       f"one too ({why}); using the masked XLA attention (computes all T x T "
                       "scores: slower)\n")
    else:
        assert err == ""


def stand_in_kernel(q, k, v, *, q_seqlen, q_offsets, **_):
    """What cuDNN's packed kernel computes, from its own segment tables (the XLA attention
    over the segments they describe), leaving NaN in the output and in dq, dk, dv at
    padding tokens, where the kernel writes nothing."""
    T = q.shape[1]
    t = jnp.arange(T)[None, :, None]
    start, n = q_offsets[:, None, :-1], q_seqlen[:, None, :]
    inside = (n > 0) & (t >= start) & (t < start + n)  # [B, T, M]
    segs = jnp.where(inside.any(-1), jnp.argmax(inside, -1) + 1, 0)
    return _nan_at_padding(q, k, v, segs)


def _attend(q, k, v, segs):
    return attention.xla_attention(q, k, v, segs)


@jax.custom_vjp
def _nan_at_padding(q, k, v, segs):
    return jnp.where((segs == 0)[:, :, None, None], jnp.nan, _attend(q, k, v, segs))


def _nan_fwd(q, k, v, segs):
    return _nan_at_padding(q, k, v, segs), (q, k, v, segs)


def _nan_bwd(res, g):
    q, k, v, segs = res
    grads = jax.vjp(lambda q, k, v: _attend(q, k, v, segs), q, k, v)[1](g)
    return (*(jnp.where((segs == 0)[:, :, None, None], jnp.nan, d) for d in grads), None)


_nan_at_padding.defvjp(_nan_fwd, _nan_bwd)


@pytest.fixture
def stand_in_cudnn(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "dot_product_attention", stand_in_kernel)


def test_padding_gradients_are_zero_whatever_the_kernel_leaves_there(stand_in_cudnn):
    """cuDNN writes neither the output nor dq, dk, dv at padding tokens. With a stand-in
    that leaves NaN there, cudnn_attention's output and its gradients are the XLA path's at
    real tokens, 0 at padding, all finite."""
    segs = np.zeros((B, T), np.int32)
    segs[0, :40], segs[0, 40:60] = 1, 2  # 4 tokens of padding
    segs[1, :64] = 1
    pad = jnp.asarray(segs == 0)[:, :, None, None]
    ref = lambda q, k, v: jnp.where(pad, 0, attention.xla_attention(q, k, v, jnp.asarray(segs)))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
    ours = lambda q, k, v: attention.cudnn_attention(q, k, v, jnp.asarray(segs), max_segments=M)
    out = ours(q, k, v)
    assert np.isfinite(out).all() and (np.asarray(out)[segs == 0] == 0).all()
    np.testing.assert_allclose(out, ref(q, k, v), rtol=1e-5, atol=1e-6)
    g = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all() and (a[segs == 0] == 0).all()
        np.testing.assert_allclose(a[segs > 0], b[segs > 0], rtol=1e-5, atol=1e-6)


def test_a_biased_head_0_runs_apart_from_the_kernel(no_cuda_probes):
    """With a bias on head 0 (ModelConfig.match_dst), the cuDNN path sends the other heads
    to the packed kernel, and head 0 to the XLA attention (the kernel takes no bias)."""
    bias = jnp.zeros((B, 1, T, T), jnp.float32)
    fn = lambda q, k, v, s: attention.attention(q, k, v, s, implementation="cudnn",
                                                max_segments=M, bias=bias)
    (call,) = cuda_custom_calls(fn)
    assert call["operands"] == [f"{B}x{T}x{N - 1}x{H}xbf16"] * 3 + TABLES


def assert_the_recipe_equals_the_xla_path(implementation):
    """`small`'s loss and gradients on ``implementation``: the XLA path's, to float32
    rounding, and finite."""
    import dataclasses

    from train.model import arch, model
    from train.model.attention import AttentionConfig

    cfg = dataclasses.replace(arch.MODELS["small"], seq_len=T)
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    segs = np.repeat(np.arange(1, 5), T // 4)[None].repeat(B, 0)
    segs[:, -3:] = 0
    batch = {"tokens": tokens, "segment_ids": jnp.asarray(segs)}
    runs = {}
    for impl in ("xla", implementation):
        att = AttentionConfig(impl, max_segments=M)
        runs[impl] = jax.value_and_grad(lambda p: model.loss_sum(p, batch, cfg, att)[0])(params)
    (l_x, g_x), (l_c, g_c) = runs["xla"], runs[implementation]
    assert float(l_c) == pytest.approx(float(l_x), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_x)):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def test_the_recipe_on_the_cudnn_path_equals_the_xla_path(stand_in_cudnn):
    """`small` (a match head on head 0) through the cuDNN path (head 0 on XLA, the rest
    through a stand-in for the kernel that leaves NaN at padding)."""
    assert_the_recipe_equals_the_xla_path("cudnn")


def test_table_size_is_the_next_power_of_two_within_the_datasets():
    from train.fit.loop import table_size

    got = [table_size(n, 68) for n in (0, 1, 2, 3, 4, 5, 16, 17, 33, 64, 65, 68)]
    assert got == [2, 2, 2, 4, 4, 8, 16, 32, 64, 64, 68, 68]
    assert table_size(3, 2) == 2 and table_size(1, 1) == 2


def test_segment_tables_per_batch_train_as_one_table_does(stand_in_cudnn, monkeypatch, tmp_path):
    """`--segment-tables batch` on the cuDNN path (a stand-in kernel that reads its tables,
    so a table too small would drop segments): each batch runs at the power of two that
    holds its fullest row, counted per size in the summary, and the losses are those of one
    table for the whole dataset, step for step."""
    import json

    from prep.tools import synthetic_shards as synthetic
    from train.fit import reader
    from train.fit.config import TrainConfig
    from train.fit.loop import table_size, train

    monkeypatch.setattr(attention, "resolve", lambda *a, **k: "cudnn")
    d = tmp_path / "shards"
    synthetic.write_shards(d, {"train": synthetic.counting_rows(48, 64, seed=0, max_segments=12),
                               "test": synthetic.counting_rows(8, 64, seed=1)})
    want = {}
    for b in reader.batches(d, "train", batch_size=4, seed=0):
        size = table_size(int(b["segment_ids"].max()), 12)
        want[str(size)] = want.get(str(size), 0) + 1
        if sum(want.values()) == 10:
            break
    assert len(want) >= 2, want  # the test needs batches of more than one size
    losses = {}
    for mode in ("batch", "data"):
        run = tmp_path / mode
        out = train(TrainConfig(data=str(d), run_dir=str(run), steps=10, batch_size=4,
                                lr=3e-3, warmup=2, log_every=1, eval_every=0, ckpt_every=0,
                                segment_tables=mode))
        assert out["segment_tables"] == (want if mode == "batch" else None)
        losses[mode] = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").open())
                        if "loss" in r]
    assert len(losses["batch"]) == 10
    np.testing.assert_allclose(losses["batch"], losses["data"], rtol=1e-6)


# --- the dense path: cuDNN's dense causal kernel, the segments as a mask -----------------

def test_the_dense_path_lowers_to_the_dense_kernel_with_the_segments_as_a_bias(no_cuda_probes):
    """Forward and backward: cuDNN's causal kernel with one bias operand, [B, 1, T, T] (the
    segment mask, broadcast over the heads); no segment tables."""
    grad = lambda q, k, v, s: jax.grad(lambda q, k, v: attention.attention(
        q, k, v, s, implementation="dense", max_segments=M).astype(jnp.float32).sum(),
        (0, 1, 2))(q, k, v)
    calls = cuda_custom_calls(grad)
    assert [c["target"] for c in calls] == list(DENSE)
    assert all(c["mask"] == "CAUSAL" for c in calls)
    assert calls[0]["operands"] == QKV + [f"{B}x1x{T}x{T}xbf16"]


def test_on_the_dense_path_a_biased_head_0_runs_through_the_kernel_too(no_cuda_probes):
    """With the match head's bias: head 0 through the kernel with its bias, the others
    through it without; nothing on XLA's attention."""
    bias = jnp.zeros((B, 1, T, T), jnp.float32)
    fn = lambda q, k, v, s: attention.attention(q, k, v, s, implementation="dense",
                                                max_segments=M, bias=bias)
    calls = cuda_custom_calls(fn)
    assert [c["target"] for c in calls] == [DENSE[0]] * 2
    assert sorted(c["operands"][0] for c in calls) == sorted(
        [f"{B}x{T}x1x{H}xbf16", f"{B}x{T}x{N - 1}x{H}xbf16"])


def test_the_recipe_on_the_dense_path_equals_the_xla_path(monkeypatch):
    """`small` through the dense path's plumbing (the head split, the bias, the mask; the
    kernel asked of jax.nn on XLA here)."""
    monkeypatch.setattr(attention, "DENSE_KERNEL", "xla")
    assert_the_recipe_equals_the_xla_path("dense")


def test_dense_on_a_cpu_is_one_line_naming_the_alternative():
    with pytest.raises(InputError, match=r"--attention dense: no NVIDIA GPU \(cpu\).*use "
                                         r"--attention xla"):
        attention.resolve("dense")
