"""Packed causal self-attention: causal, and block-diagonal by segment.

A row holds several contexts (segment ids 1..n, 0 = padding). Token t may attend to token
s only if s <= t and segment_ids[s] == segment_ids[t], so each context sees itself alone
(tests/test_model.py holds us to that). Three implementations of the same function:

- ``xla``: ``jax.nn.dot_product_attention`` with a [B, 1, T, T] boolean mask. Runs
  everywhere (CPU tests), costs O(T^2) mask memory and computes the masked blocks.
- ``dense``: cuDNN's dense causal kernel (``jax.nn.dot_product_attention``, public API)
  with the segments as a [B, 1, T, T] mask: it computes every block below the diagonal
  and takes a bias (the match head's); docs/learning.md 6.4 has what it costs. The default
  on a GPU (``resolve``): faster than the packed kernel in the trainer, in less memory.
- ``cudnn``: cuDNN's native packed ("ragged") layout on NVIDIA Hopper or newer. Each
  segment becomes a sequence of its own given by an offset and a length, under a
  PADDING_CAUSAL mask, so masked blocks are never computed. It is reached through a private
  module, ``jax._src.cudnn.fused_attention_stablehlo`` (``q_offsets`` / ``kv_offsets`` are not
  in ``jax.nn``), so it is probed, not assumed: ``cudnn_available`` compiles it (forward and
  gradient) on tiny shapes at start-up, and ``resolve("auto")`` takes it only where the
  dense kernel does not compile; tests/test_cudnn_lowering.py lowers it for CUDA on a CPU,
  so a JAX upgrade that changes the private API fails CI. Query and key/value head counts
  are equal (no GQA).

Padding tokens (segment 0) attend to earlier padding under XLA and ``dense``; under the
packed kernel they belong to no segment and their output is undefined, so it is zeroed.
Nothing reads those outputs: padding is never a loss target and no real token attends to it.

``AttentionConfig``: the implementation, segment-table size and compute dtype, hashable.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp

from prep.schema.errors import InputError


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How train.model.model.forward computes: ``implementation`` "xla" or "cudnn" (``resolve``
    turns "auto" into one), ``max_segments`` (the most segments a row holds: the size of
    cuDNN's per-row segment tables) and ``dtype``, the compute dtype (parameters are cast
    to it at use). Frozen and hashable: a jit static argument and a compile-cache key."""
    implementation: str = "xla"
    max_segments: int = 255
    dtype: Any = jnp.float32

    def __post_init__(self):  # float32, "float32" and jnp.float32 are one setting
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B, 1, T, T]: query t may see key s (causal, same segment)."""
    T = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = jnp.tril(jnp.ones((T, T), bool))
    return (same & causal)[:, None]


def xla_attention(q, k, v, segment_ids, bias=None):
    """q, k, v: [B, T, N, H]; bias: None or float[B, N, T, T] added to the scores. The
    reference implementation (any backend)."""
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=segment_mask(segment_ids),
                                        implementation="xla")


def probe_attention(q, k, v, k_self, v_self, mask, bias=None):
    """Probes (train.model.model.forward's ``probes``): q, k_self, v_self [B, M, N, H], one
    query, key and value per probe; k, v [B, T, N, H] the row's; mask bool[B, 1, M, T], probe
    m may see row key t. Each probe sees what its mask allows of the row and itself, never
    another probe: ``xla_attention``'s maths over the keys [row, probes] with the probes'
    part masked to the diagonal."""
    B, M = q.shape[0], q.shape[1]
    own = jnp.broadcast_to(jnp.eye(M, dtype=bool), (B, 1, M, M))
    if bias is not None:  # [B, N, M, T] on the row's keys; none on the probe's own
        bias = jnp.concatenate([bias, jnp.zeros(bias.shape[:3] + (M,), bias.dtype)], axis=-1)
    return jax.nn.dot_product_attention(
        q, jnp.concatenate([k, k_self], axis=1), jnp.concatenate([v, v_self], axis=1),
        bias=bias, mask=jnp.concatenate([mask, own], axis=-1), implementation="xla")


def missing_segment_value() -> int:
    """What the installed JAX's cuDNN wrapper wants in unused segment slots, read from its
    own docstring ("fill the padded entries with -1"); -1 (JAX 0.10-0.11) if it says nothing.

    The wrapper compacts the tables by keeping entries ``>= 0``, so with -1 a 0 would read
    as a real, empty segment; a wrapper documenting 0 (as newer cuDNN on Blackwell is said
    to want) gets 0."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError:
        return -1
    found = re.findall(r"fill the padded entries with (-?\d+)", cudnn.dot_product_attention.__doc__ or "")
    return int(found[0]) if found and len(set(found)) == 1 else -1


def segment_layout(segment_ids: jax.Array, max_segments: int, *, missing: int | None = None):
    """(seqlen int32[B, M], offsets int32[B, M+1]) for cuDNN's packed layout, M = max_segments.

    Segment k (id k+1) starts at offsets[b, k] and has seqlen[b, k] tokens; missing
    segments and the spare last offset hold ``missing`` (default: what the installed JAX's
    wrapper documents, ``missing_segment_value()``).
    """
    missing = missing_segment_value() if missing is None else missing
    B, T = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    rows = jnp.arange(B)[:, None]
    counts = jnp.zeros((B, max_segments + 1), jnp.int32).at[rows, seg].add(1)
    starts = jnp.full((B, max_segments + 1), T, jnp.int32).at[rows, seg].min(
        jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    counts, starts = counts[:, 1:], starts[:, 1:]  # drop padding (id 0)
    present = counts > 0
    seqlen = jnp.where(present, counts, missing)
    offsets = jnp.where(present, starts, missing)
    spare = jnp.full((B, 1), missing, jnp.int32)
    return seqlen, jnp.concatenate([offsets, spare], axis=1)


def cudnn_attention(q, k, v, segment_ids, *, max_segments: int):
    """q, k, v: bf16/fp16 [B, T, N, H] on a Hopper+ GPU. Same result as xla_attention."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # private: see the module doc

    seqlen, offsets = segment_layout(segment_ids, max_segments)
    kernel = lambda q, k, v, seqlen, offsets: cudnn.dot_product_attention(
        q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / float(q.shape[-1]) ** 0.5, mask_type=cudnn.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH")
    valid = (segment_ids > 0)[:, :, None, None]
    return _zero_at_padding(kernel, q, k, v, seqlen, offsets, valid).astype(q.dtype)


def _zero_at_padding(kernel, q, k, v, seqlen, offsets, valid):
    """kernel(q, k, v, seqlen, offsets) set to 0 where ``valid`` is False, and so are dq, dk,
    dv. cuDNN writes neither the output nor dq, dk, dv at padding tokens (no segment holds
    them): whatever their buffers held stays there (an H200 run with unrolled layers stopped
    at a NaN gradient norm). The backward pass keeps what cuDNN's keeps, and the mask."""
    zero = lambda valid, x: jnp.where(valid, x, jnp.zeros((), x.dtype))

    @jax.custom_vjp  # (what it closes over is static: a custom VJP takes no outer tracers)
    def f(q, k, v, seqlen, offsets, valid):
        return zero(valid, kernel(q, k, v, seqlen, offsets))

    def fwd(q, k, v, seqlen, offsets, valid):
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, seqlen, offsets), q, k, v)
        return zero(valid, out), (vjp, valid)

    def bwd(res, g):
        vjp, valid = res
        return (*(zero(valid, d) for d in vjp(zero(valid, g))), None, None, None)

    f.defvjp(fwd, bwd)
    return f(q, k, v, seqlen, offsets, valid)


# what dense_attention asks jax.nn.dot_product_attention for (tests put "xla" here to run
# its plumbing on a CPU)
DENSE_KERNEL = "cudnn"


def dense_attention(q, k, v, segment_ids, bias=None):
    """q, k, v: bf16/fp16 [B, T, N, H] on a GPU with cuDNN; ``bias`` None or [B, 1, T, T]
    added to every head's scores. Same result as xla_attention."""
    return jax.nn.dot_product_attention(
        q, k, v, bias=None if bias is None else bias.astype(q.dtype),
        mask=segment_mask(segment_ids), is_causal=True,
        implementation=DENSE_KERNEL).astype(q.dtype)


@functools.cache
def cudnn_available() -> bool:
    """True where the packed cuDNN attention compiles for the first device; see ``why_not``."""
    return why_not_cudnn() is None


@functools.cache
def why_not_cudnn() -> str | None:
    """None if the packed cuDNN attention (forward and gradient, bf16) compiles for the first
    device, else why not, in a few words. Compiling tiny shapes costs a second or two once."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"no NVIDIA GPU ({device.platform})"
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: F401
    except ImportError as e:
        return f"this JAX has no cuDNN attention module ({e})"
    return _compiles(lambda q, k, v, s: cudnn_attention(q, k, v, s, max_segments=4))


@functools.cache
def why_not_dense() -> str | None:
    """None if cuDNN's dense attention with a segment mask and a head-0 bias (forward and
    gradient, bf16) compiles for the first device, else why not, in a few words."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"no NVIDIA GPU ({device.platform})"
    bias = jnp.zeros((2, 1, 128, 128), jnp.float32)
    return _compiles(lambda q, k, v, s: attention(q, k, v, s, implementation="dense",
                                                  max_segments=4, bias=bias))


def _compiles(fwd) -> str | None:
    """None if ``fwd`` and its gradient compile on tiny bf16 shapes, else why not."""
    B, T, N, H = 2, 128, 2, 64
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    grad = jax.grad(lambda q, k, v, s: fwd(q, k, v, s).astype(jnp.float32).sum(), (0, 1, 2))
    try:
        for fn in (fwd, grad):
            jax.jit(fn).lower(x, x, x, seg).compile()
    except Exception as e:  # an API change, an old cuDNN, a pre-Hopper GPU: say which
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    return None


IMPLEMENTATIONS = ("xla", "cudnn", "dense")  # and "auto", which resolve turns into one


def resolve(implementation: str, *, bias: bool = False) -> str:
    """"auto" -> "dense" on an NVIDIA GPU where cuDNN's dense kernel compiles (with or
    without ``bias``), else "cudnn" where the packed kernel does and there is no bias, else
    "xla" (on a GPU with one line on stderr saying why); an explicit choice is checked.
    ``bias``: the model adds a bias to head 0's scores (ModelConfig.match_dst), which the
    packed kernel does not take ("cudnn" runs that head on XLA and the others on the packed
    kernel: ``attention``). Dense is the GPU default since 2026-11-30: on an H200 it trains
    base at 1.09-1.12x the packed kernel's tokens/s in 0.58x its memory, and the recipe's
    model at 0.87-0.88x base (docs/learning.md 6.5, 6.6)."""
    if implementation == "auto":
        if jax.devices()[0].platform != "gpu":
            return "xla"
        dense = why_not_dense()
        if dense is None:
            return "dense"
        packed = "the model's match_dst head adds a bias" if bias else why_not_cudnn()
        if packed is None:
            return "cudnn"
        print(f"attention: cuDNN's dense attention unavailable ({dense}), its packed one too "
              f"({packed}); using the masked XLA attention (computes all T x T scores: "
              "slower)", file=sys.stderr)
        return "xla"
    if implementation == "cudnn" and not cudnn_available():
        raise InputError(f"--attention cudnn: {why_not_cudnn()}; it needs an NVIDIA Hopper or "
                         "newer GPU with cuDNN >= 9.6 and a CUDA jax (README: On a GPU); "
                         "use --attention xla")
    if implementation == "dense" and why_not_dense() is not None:
        raise InputError(f"--attention dense: {why_not_dense()}; it needs an NVIDIA GPU with "
                         "cuDNN and a CUDA jax (README: On a GPU); use --attention xla")
    if implementation not in IMPLEMENTATIONS:
        raise InputError(f"unknown attention implementation {implementation!r}")
    return implementation


def attention(q, k, v, segment_ids, *, implementation: str, max_segments: int, bias=None):
    """q, k, v [B, T, N, H] -> [B, T, N, H] under segment_ids [B, T]. ``bias``: None, or
    float[B, 1, T, T] added to head 0's scores only (ModelConfig.match_dst). The XLA path
    adds it as an [B, N, T, T] bias that is 0 on the other heads; the dense path runs head 0
    through the kernel with the bias and the other heads through it without; the cuDNN
    path, whose packed kernel takes no bias, runs head 0 on the XLA attention (T x T scores
    for one head) and the other heads on the packed kernel."""
    if implementation == "dense":
        if bias is None:
            return dense_attention(q, k, v, segment_ids)
        a0 = dense_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], segment_ids, bias)
        return jnp.concatenate([a0, dense_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:],
                                                    segment_ids)], axis=2)
    if bias is not None:  # head 0 with the bias; the others without (no [B, N, T, T] bias)
        a0 = xla_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], segment_ids, bias)
        rest = (cudnn_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], segment_ids,
                                max_segments=max_segments) if implementation == "cudnn"
                else xla_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], segment_ids))
        return jnp.concatenate([a0.astype(rest.dtype), rest], axis=2)
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, segment_ids, max_segments=max_segments)
    return xla_attention(q, k, v, segment_ids, bias)
