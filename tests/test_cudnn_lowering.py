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


def cuda_custom_calls(fn) -> list[dict]:
    """Every cuDNN custom call of ``fn`` exported for CUDA: target, mask, max segments,
    operand types."""
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in TARGETS]
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


def test_padding_gradients_are_zero_whatever_the_kernel_leaves_there(monkeypatch):
    """cuDNN writes neither the output nor dq, dk, dv at padding tokens. A stand-in for its
    kernel that leaves NaN there (the XLA attention elsewhere): cudnn_attention's output and
    its gradients are the XLA path's at real tokens, 0 at padding, all finite."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    segs = np.zeros((B, T), np.int32)
    segs[0, :40], segs[0, 40:60] = 1, 2  # 4 tokens of padding
    segs[1, :64] = 1
    pad = jnp.asarray(segs == 0)[:, :, None, None]
    ref = lambda q, k, v: attention.xla_attention(q, k, v, jnp.asarray(segs))

    @jax.custom_vjp
    def kernel(q, k, v):
        return jnp.where(pad, jnp.nan, ref(q, k, v))

    def kernel_bwd(res, g):
        return tuple(jnp.where(pad, jnp.nan, d) for d in jax.vjp(ref, *res)[1](g))

    kernel.defvjp(lambda q, k, v: (kernel(q, k, v), (q, k, v)), kernel_bwd)
    monkeypatch.setattr(cudnn, "dot_product_attention", lambda q, k, v, **kw: kernel(q, k, v))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * w)
    ours = lambda q, k, v: attention.cudnn_attention(q, k, v, jnp.asarray(segs), max_segments=M)
    out = ours(q, k, v)
    assert np.isfinite(out).all() and (np.asarray(out)[segs == 0] == 0).all()
    g = jax.grad(loss(ours), argnums=(0, 1, 2))(q, k, v)
    g_ref = jax.grad(loss(lambda q, k, v: jnp.where(pad, 0, ref(q, k, v))), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all() and (a[segs == 0] == 0).all()
        np.testing.assert_allclose(a[segs > 0], b[segs > 0], rtol=1e-5, atol=1e-6)
