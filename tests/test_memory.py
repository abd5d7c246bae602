"""Activation memory: what the train step keeps for its backward pass, read on the CPU
(train.model.memory), and the numerics of the forms that keep less (train.model.model's
rms_norm, norm_matmul and gelu_out) held to the plain ones they replace."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.model import arch, memory, model
from train.model.attention import AttentionConfig

pytestmark = pytest.mark.no_kernel_warmup  # the model alone

BASE = arch.MODELS["base"]  # rows of 1024
D, F = BASE.d_model, BASE.d_mlp
LIMIT = 22_000  # bytes per token per layer under bf16 (DESIGN.md section 9)


def plain_rms_norm(x, w, eps):
    """The normalization as autodiff alone would differentiate it (before issue 33)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def plain_gelu_out(u, w):
    return jax.nn.gelu(u) @ w


def plain_norm_matmul(spec, x, g, w, eps):
    return jnp.einsum(spec, plain_rms_norm(x, g, eps), w)


def use_plain_forms(monkeypatch):
    monkeypatch.setattr(model, "rms_norm", plain_rms_norm)
    monkeypatch.setattr(model, "gelu_out", plain_gelu_out)
    monkeypatch.setattr(model, "norm_matmul", plain_norm_matmul)


@pytest.fixture
def plain_model(monkeypatch):
    use_plain_forms(monkeypatch)


def test_base_keeps_at_most_22kb_per_token_per_layer():
    got = memory.per_token_layer(BASE)
    assert got["bytes"] <= LIMIT, got
    kinds = got["by_kind"]
    # one bf16 tensor of the MLP's width: its input to gelu, nothing of gelu's inside
    assert kinds[f"bfloat16[{F}]"] == 2 * F
    # no float32 copy of an activation, nor the normalized inputs of the matmuls: the norms
    # keep their bf16 input and a float32 statistic per token; per layer 2 of d_model (the
    # block's input, the MLP's), plus the final norm's input and output
    assert f"float32[{D}]" not in kinds
    assert kinds[f"bfloat16[{D}]"] == (2 + 2 / BASE.n_layers) * 2 * D
    # q, k, v and the attention's output, one bf16 each
    assert (kinds[f"bfloat16[{BASE.n_heads},{BASE.head_dim}]"]
            + kinds[f"bfloat16[{BASE.n_heads},1,{BASE.head_dim}]"]) == 4 * 2 * D


def test_the_plain_forms_kept_3_4_to_3_8x_as_much(plain_model):
    """What the same count gave before (issue 33's 49.1 KB, jax 0.10): six bf16 tensors of
    the MLP's width and four float32 ones of d_model per layer. From jax 0.11 on (the GPU
    machine's) autodiff of jax.nn.gelu keeps one of the six fewer: 44.0 KB."""
    got = memory.per_token_layer(BASE)
    gelu_kept = 6 if jax.__version_info__ < (0, 11) else 5
    assert got["by_kind"][f"bfloat16[{F}]"] == gelu_kept * 2 * F
    assert got["by_kind"][f"float32[{D}]"] == (4 + 2 / BASE.n_layers) * 4 * D
    # (49,136.5 when each layer computed its own RoPE angles; now they are computed once)
    assert got["bytes"] == pytest.approx(49_123.7 - (6 - gelu_kept) * 2 * F, abs=0.5)


def test_on_the_cudnn_path_the_softmax_statistics_grow_with_the_segment_table(no_cuda_probes):
    """The GPU's path, traced here: no T x T scores, but the kernel's output besides the
    zeroed one the model reads, and float32 softmax statistics of [rows * max_segments,
    heads, T]. At the built-in data's most segments in a row (68) the step stays within
    the limit; the figure counts them at the table size a run uses."""
    xla = memory.per_token_layer(BASE)
    for segments in (16, 68):
        got = memory.per_token_layer(BASE, implementation="cudnn", max_segments=segments)
        stats = memory.cudnn_stats_bytes(BASE, segments)
        assert got["by_kind"][f"float32[{BASE.n_heads},T]"] == stats == 40 * segments
        # one more bf16 activation than the XLA path (cuDNN's own output, kept for its
        # backward), and not the XLA softmax's two float32 per token and head (its max, sum)
        assert got["bytes"] - stats == pytest.approx(
            xla["bytes"] + 2 * D - 2 * 4 * BASE.n_heads, abs=2)  # (+ the segment tables)
    assert got["bytes"] <= LIMIT


def test_on_the_dense_path_the_step_keeps_its_mask_and_no_tables(no_cuda_probes):
    """cuDNN's dense kernel (--attention dense): q, k, v and its output, as the XLA path,
    float32 softmax statistics per token and head (no segment tables), and per layer the
    segment mask as a bf16 bias [rows, 1, T, T] (one of them once XLA merges the copies):
    within the limit even counted 20 times."""
    got = memory.per_token_layer(BASE, implementation="dense")
    assert got["by_kind"][f"bfloat16[{BASE.n_heads},{BASE.head_dim}]"] == 4 * 2 * D
    assert got["by_kind"][f"float32[{BASE.n_heads},T]"] == 4 * BASE.n_heads
    masks = [a for a, _ in memory.saved_residuals(BASE, 1, implementation="dense")
             if a.shape[-2:] == (BASE.seq_len, BASE.seq_len)]
    assert [(a.shape, str(a.dtype)) for a in masks] == [
        ((1, 1, BASE.seq_len, BASE.seq_len), "bfloat16")] * BASE.n_layers
    assert got["bytes"] + 2 * BASE.seq_len <= LIMIT  # the mask: T bf16 per token, per layer


def _loss_and_grads(cfg, dtype):
    params = jax.tree.map(jnp.asarray, model.init_params(cfg, 0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, cfg.seq_len))
    segs = np.repeat(np.arange(1, 5), cfg.seq_len // 4)[None].repeat(2, 0)
    segs[:, -3:] = 0
    batch = {"tokens": jnp.asarray(tokens), "segment_ids": jnp.asarray(segs)}
    att = AttentionConfig("xla", dtype=dtype)
    fn = jax.jit(jax.value_and_grad(lambda p, b: model.loss_sum(p, b, cfg, att)[2]))
    with jax.default_matmul_precision("highest"):
        return fn(params, batch)


def _rel(a, b):
    if not np.any(b):  # (a gradient of zeros, where nothing reaches a parameter)
        return float(np.abs(a).max())
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def test_loss_and_gradients_equal_the_plain_forms(monkeypatch):
    """The forms that keep less compute the same function and the same gradient: under
    float32 to 1e-5 (seen: <= 4e-7); under bf16 the forward is the same operations (the
    same loss) and the gradients differ by less than bf16's own rounding does (the plain
    forms' bf16 gradients differ from their float32 ones by 0.6-0.8 %, these by <= 0.6 %)."""
    cfg = dataclasses.replace(arch.MODELS["tiny"], seq_len=64)
    new = {dt: _loss_and_grads(cfg, dt) for dt in (jnp.float32, jnp.bfloat16)}
    use_plain_forms(monkeypatch)
    old = {dt: _loss_and_grads(cfg, dt) for dt in (jnp.float32, jnp.bfloat16)}
    for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
        (l_new, g_new), (l_old, g_old) = new[dt], old[dt]
        assert float(l_new) == pytest.approx(float(l_old), rel=1e-6)
        for path, a in jax.tree_util.tree_flatten_with_path(g_new)[0]:
            b = g_old
            for k in path:
                b = b[k.key]
            assert _rel(a, b) <= tol, (jnp.dtype(dt).name, jax.tree_util.keystr(path), _rel(a, b))
