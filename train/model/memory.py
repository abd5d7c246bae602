"""What the train step keeps for its backward pass, read on the CPU without running it.

Activation memory is what limits the batch on a GPU: every array the gradient needs from the
forward pass (a residual) lives from the forward pass until the backward pass consumes it.
``jax._src.ad_checkpoint.saved_residuals`` (private, as train.model.attention's cuDNN path is;
tests/test_memory.py fails CI if it changes) lists them by tracing the gradient of the loss
abstractly: shapes only, no FLOPs, seconds for the 95M model on a CPU.

The figure is bytes per token per layer: the residuals of 2 rows minus those of 1 row (so
whatever does not grow with the batch, such as the bf16 copies of the weights, cancels),
over the row's tokens and the layers. Arrays whose last two axes are T x T are left out: they
are the XLA attention's masked scores and probabilities, which the fused cuDNN kernel never
materializes (it keeps its output and float32 softmax statistics, ``cudnn_stats_bytes``).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from train.model import arch, model
from train.model.attention import AttentionConfig
from train.model.arch import ModelConfig


def saved_residuals(cfg: ModelConfig, rows: int, dtype=jnp.bfloat16,
                    implementation: str = "xla", max_segments: int = 255) -> list:
    """(aval, where it comes from) of every array the gradient of the training loss keeps,
    for ``rows`` rows of ``cfg.seq_len`` tokens; abstract (nothing is computed)."""
    from jax._src.ad_checkpoint import saved_residuals as jax_saved_residuals

    params = arch.map_params(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32),
                             arch.param_specs(cfg))
    row = jax.ShapeDtypeStruct((rows, cfg.seq_len), jnp.int32)
    att = AttentionConfig(implementation, max_segments=max_segments, dtype=dtype)
    loss = lambda p, b: model.loss_sum(p, b, cfg, att)[2]
    return [(aval, why) for aval, why in jax_saved_residuals(
        loss, params, {"tokens": row, "segment_ids": row}) if hasattr(aval, "shape")]


def _is_scores(aval, T: int) -> bool:
    return len(aval.shape) >= 2 and aval.shape[-2:] == (T, T)


def _bytes(aval) -> int:
    return int(np.prod(aval.shape)) * aval.dtype.itemsize


def per_token_layer(cfg: ModelConfig, dtype=jnp.bfloat16, implementation: str = "xla",
                    max_segments: int = 255) -> dict:
    """{"bytes": saved bytes per token per layer, "by_kind": {kind: bytes}}: the activation
    memory of training ``cfg`` (the module docstring says how it is counted). A kind is a
    dtype and the trailing axes, "bfloat16[2560]" for a tensor of the MLP's width; the
    T x T scores of the XLA attention are not counted."""
    T = cfg.seq_len
    by_kind = collections.Counter()
    for rows, sign in ((2, 1), (1, -1)):
        for aval, _ in saved_residuals(cfg, rows, dtype, implementation, max_segments):
            if _is_scores(aval, T):
                continue
            by_kind[_kind(aval, rows, T)] += sign * _bytes(aval)
    scale = T * cfg.n_layers
    # (segment tables and the like, a few bytes a row, are counted in the total, not listed)
    return {"bytes": sum(by_kind.values()) / scale,
            "by_kind": {k: v / scale for k, v in sorted(by_kind.items())
                        if abs(v) >= 0.05 * scale}}


def _kind(aval, rows: int, T: int) -> str:
    """"bfloat16[2560]": the dtype and the axes after the token axis (one tensor of the MLP's
    width); "float32[10,T]" where the tokens are the last of 3 or more axes (cuDNN's softmax
    statistics, [rows * segments, heads, T])."""
    shape = [T if d == rows * T else d for d in aval.shape]  # rows and tokens flattened
    if len(shape) >= 3 and shape[-1] == T:
        return f"{aval.dtype}[{shape[-2]},T]"
    if T in shape:
        shape = shape[shape.index(T) + 1:]
    return f"{aval.dtype}[{','.join(map(str, shape))}]"


def cudnn_stats_bytes(cfg: ModelConfig, max_segments: int) -> int:
    """Bytes per token per layer of the cuDNN packed attention's float32 softmax statistics:
    JAX's wrapper sizes them [rows * max_segments, heads, T], so they grow with the
    segment-table size, not with the segments a row really holds."""
    return 4 * cfg.n_heads * max_segments
