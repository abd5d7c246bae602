"""Packed causal self-attention: causal, and block-diagonal by segment.

A row holds several contexts (segment ids 1..n, 0 = padding). Token t may attend to
token s only if s <= t and segment_ids[s] == segment_ids[t], so each context sees itself
alone, exactly as if it were the only thing in the row (tests/test_model.py holds us
to that). Two implementations of the same function:

- ``xla``: ``jax.nn.dot_product_attention`` with a [B, 1, T, T] boolean mask. Runs
  everywhere (CPU tests), costs O(T^2) mask memory and computes the masked blocks.
- ``cudnn``: cuDNN's native packed ("ragged") layout on NVIDIA Hopper or newer. Each
  segment becomes a sequence of its own given by an offset and a length, under a
  PADDING_CAUSAL mask, so masked blocks are never computed. This is reached through
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (``q_offsets`` /
  ``kv_offsets`` are not in the public ``jax.nn`` API), a private module: it is used only
  with the JAX version pinned in pyproject.toml (PINNED_JAX) and falls back to XLA on any
  other. Query and key/value head counts are equal (no GQA), which the packed path needs.

Padding tokens (segment 0) attend to earlier padding under XLA, which keeps every softmax
row non-empty; under cuDNN they belong to no segment and their output is undefined, so
it is zeroed. Nothing reads those outputs: padding is never a loss target and no real
token attends to it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from prep.errors import InputError

PINNED_JAX = "0.10.2"


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B, 1, T, T]: query t may see key s (causal, same segment)."""
    T = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return (same & causal)[:, None]


def xla_attention(q, k, v, segment_ids):
    """q, k, v: [B, T, N, H]. The reference implementation (any backend)."""
    return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids),
                                        implementation="xla")


def segment_layout(segment_ids: jax.Array, max_segments: int):
    """(seqlen int32[B, M], offsets int32[B, M+1]) for cuDNN's packed layout, M = max_segments.

    Segment k (id k+1) starts at offsets[b, k] and has seqlen[b, k] tokens; missing
    segments and the spare last offset are -1, as the JAX wrapper expects.
    """
    B, T = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    rows = jnp.arange(B)[:, None]
    counts = jnp.zeros((B, max_segments + 1), jnp.int32).at[rows, seg].add(1)
    starts = jnp.full((B, max_segments + 1), T, jnp.int32).at[rows, seg].min(
        jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    counts, starts = counts[:, 1:], starts[:, 1:]  # drop padding (id 0)
    present = counts > 0
    seqlen = jnp.where(present, counts, -1)
    offsets = jnp.where(present, starts, -1)
    spare = jnp.full((B, 1), -1, jnp.int32)
    return seqlen, jnp.concatenate([offsets, spare], axis=1)


def cudnn_attention(q, k, v, segment_ids, *, max_segments: int):
    """q, k, v: bf16/fp16 [B, T, N, H] on a Hopper+ GPU. Same result as xla_attention."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # private: see PINNED_JAX

    seqlen, offsets = segment_layout(segment_ids, max_segments)
    out = cudnn.dot_product_attention(
        q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / float(q.shape[-1]) ** 0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH")
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)


@functools.cache
def cudnn_available() -> bool:
    """True on an NVIDIA GPU with compute capability >= 9.0, cuDNN, and the pinned JAX."""
    if jax.__version__ != PINNED_JAX:
        return False
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        if jax.devices()[0].platform != "gpu" or not cudnn.check_compute_capability("9.0"):
            return False
        return cudnn.check_cudnn_version() >= 90600
    except Exception:  # no CUDA backend, no cuDNN, or an API change: use XLA
        return False


def resolve(implementation: str) -> str:
    """"auto" -> "cudnn" where it works, else "xla"; an explicit choice is checked."""
    if implementation == "auto":
        return "cudnn" if cudnn_available() else "xla"
    if implementation == "cudnn" and not cudnn_available():
        raise InputError("attention 'cudnn' needs an NVIDIA GPU with compute capability >= 9.0, "
                         f"cuDNN >= 9.6 and jax=={PINNED_JAX}; use --attention xla")
    if implementation not in ("xla", "cudnn"):
        raise InputError(f"unknown attention implementation {implementation!r}")
    return implementation


def attention(q, k, v, segment_ids, *, implementation: str, max_segments: int):
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, segment_ids, max_segments=max_segments)
    return xla_attention(q, k, v, segment_ids)
