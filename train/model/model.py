"""A decoder-only transformer over packed rows, in plain JAX.

Pre-norm blocks (RMSNorm -> causal self-attention with RoPE -> RMSNorm -> GELU MLP),
no biases, an untied output head. Parameters are a plain dict of float32 arrays with
the layers stacked on a leading axis, so the forward pass is one ``lax.scan`` (fast to
compile at 20 layers) and the state is trivially jit-, shard- and Orbax-friendly; a
module library would add nothing here.

Packing is invisible to the math: positions restart at 0 in every segment (RoPE sees
the same angles a context would see alone) and attention is block-diagonal by segment
(train.model.attention), so each context's logits equal those of the context run alone.
Positions and next-token targets are derived here, on the device, from the row's
tokens and segment_ids (prep.schema.rows documents the row).

What the model is (its shapes, the named configs, the parameter tree and which parameters
weight decay applies to) is train.model.arch, free of JAX; this module is the math over it,
and counts its own FLOPs (``flop_counts``, ``train_flops``) for the trainer's MFU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

from prep.schema import vocab
from train.model import arch
from train.model import attention as attn
from train.model.arch import ModelConfig
from train.model.failprior import FAIL_ANCHOR


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """float32 parameters (train.model.arch.param_specs), drawn on the host: a jitted init costs
    seconds of compilation."""
    rng = np.random.default_rng(seed)
    draw = lambda p: (np.zeros(p.shape, np.float32) if p.data or p.zeros
                      else p.std * rng.standard_normal(p.shape, np.float32) if p.std
                      else np.ones(p.shape, np.float32))
    return arch.map_params(draw, arch.param_specs(cfg))


def positions(segment_ids: jax.Array) -> jax.Array:
    """Index of each token within its segment (0 at each segment start and on padding)."""
    T = segment_ids.shape[-1]
    idx = jnp.arange(T, dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                             segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return jnp.where(segment_ids > 0, idx - start_idx, 0)


def targets_and_mask(tokens: jax.Array, segment_ids: jax.Array):
    """Next token at t, and whether it counts: segment_ids[t] == segment_ids[t+1] != 0."""
    nxt_tok = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    nxt_seg = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    return nxt_tok, (segment_ids == nxt_seg) & (segment_ids != 0)


def _rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)  # the mean of squares in float32 even under bf16 compute
    rstd = checkpoint_name(jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps),
                           "rms_norm.rstd")
    return (x32 * rstd * w).astype(x.dtype)


# Under a gradient, rms_norm keeps its input (in the compute dtype) and the float32
# statistic per token, and redoes the rest in the backward pass: left to autodiff it would
# keep the float32 upcast and the normalized float32 product: 8 bytes per element, 4x the
# bf16 activation it normalizes (train.model.memory counts what a step keeps).
_SAVE_RSTD = jax.checkpoint_policies.save_only_these_names("rms_norm.rstd")
rms_norm = jax.checkpoint(_rms_norm, static_argnums=(2,), policy=_SAVE_RSTD)


# einsum(spec, rms_norm(x, g), w) as rms_norm keeps it, and without the normalized x that
# the matmul would keep for w's gradient: the backward pass redoes the normalization, one
# elementwise pass (no matmul is redone).
@functools.partial(jax.checkpoint, static_argnums=(0, 4), policy=_SAVE_RSTD)
def norm_matmul(spec, x, g, w, eps):
    return jnp.einsum(spec, _rms_norm(x, g, eps), w)


# gelu(u) @ w_out, keeping only u (and w) for the backward pass, where gelu and its
# derivative are recomputed from u, elementwise (no matmul is redone). Left to autodiff,
# the tanh approximation keeps four intermediates of the MLP's width besides u, and the
# matmul keeps gelu(u): 6x the bytes of u, most of a layer's activations.
@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
def gelu_out(u, w):
    return jax.nn.gelu(u) @ w


@jax.custom_vjp
def lookup(table, ids):
    """``table[ids]`` whose gradient is a matmul (one-hot of ``ids`` by the cotangent, float32
    accumulation), not the scatter-add of ``[]``'s: on an H200 that scatter, every token's
    row added into one of 267, took 30 ms of base's 127 ms step (docs/learning.md 6.5)."""
    return table[ids]


def _lookup_fwd(table, ids):
    return table[ids], (ids, jnp.zeros((0,), table.dtype), table.shape[0])


def _lookup_bwd(res, g):
    ids, like, rows = res
    hot = jax.nn.one_hot(ids, rows, dtype=g.dtype)
    grad = jnp.einsum("...v,...d->vd", hot, g, preferred_element_type=jnp.float32)
    return grad.astype(like.dtype), None


lookup.defvjp(_lookup_fwd, _lookup_bwd)


def rope_tables(pos, head_dim, base):
    """(cos, sin), float32 [B, T, 1, head_dim / 2], of positions pos [B, T]: computed once
    for all layers (per layer, each unrolled layer would keep its own copy for the backward)."""
    half = head_dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = pos.astype(jnp.float32)[:, :, None, None] * freqs  # [B, T, 1, half]
    return jnp.cos(angles), jnp.sin(angles)


def rope(x, tables):
    """Rotate pairs (i, i + H/2) of x [B, T, N, H] by pos * base^(-2i/H) (rope_tables)."""
    cos, sin = tables
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def forward(params: dict, tokens: jax.Array, segment_ids: jax.Array, cfg: ModelConfig,
            attention: attn.AttentionConfig = attn.AttentionConfig(), *,
            probes: tuple[jax.Array, jax.Array] | None = None, own: bool = False,
            src_hash: jax.Array | None = None, fold: jax.Array | None = None,
            pair_fold: jax.Array | None = None):
    """float32 logits [B, T, V] of int tokens [B, T] under segment_ids [B, T], computed as
    ``attention`` says (implementation, segment-table size, compute dtype).

    ``probes = (probe_tokens int[B, M], probe_prev int[B, M])`` also returns the logits
    [B, M, V] of M extra tokens per row, each as if it stood right after row position
    ``probe_prev`` in that position's segment (everything after it ignored): the logits
    the row would give there with that token written at ``probe_prev + 1``. One pass
    answers "what follows if this token came next" for many tokens and many places at
    once; evaluation reads the second RTT byte's distribution given each candidate first
    byte this way (train.predict.predictor). A probe attends to its segment up to ``probe_prev``
    and to itself, never to other probes.

    ``own`` (no probes): also the logits before the stores and the context copy are mixed
    in (ModelConfig.dst_store, pair_store, context_copy): (logits, own logits).
    ``src_hash``: the pair store's source hashes, where the tokens' sources are anonymized
    (``pair_keys``). ``fold`` (training, no probes; bool [B, T], ``fold_targets``):
    its positions' logits pass gradient to the stores' gates alone, and only where a store
    answers; the stores' gates take gradient from nothing else (ModelConfig.gate_fold).
    ``pair_fold`` (training; bool [B, T], ``pair_fold_targets``): the only positions where
    the pair store is read at the measurement's own pair, and where that read's gate learns
    (ModelConfig.pair_forward); without it (evaluation, queries) that read answers wherever
    the pair is stored.
    """
    dtype = attention.dtype
    seg = segment_ids.astype(jnp.int32)
    pos = positions(seg)
    embed, head_w = tables(params, cfg)
    x = lookup(embed.astype(dtype), tokens)
    if cfg.grammar_embed:  # what the grammar says of each token, given, not learned by layers
        role, index, last = grammar(tokens, seg)
        x = x + (params["role_embed"][role] + params["index_embed"][index]).astype(dtype)
    if probes is not None:
        p_tok, p_prev = probes
        p_prev = p_prev.astype(jnp.int32)
        p_pos = jnp.take_along_axis(pos, p_prev, axis=1) + 1
        p_seg = jnp.take_along_axis(seg, p_prev, axis=1)
        T = seg.shape[1]
        # probe m of row b sees key t: same segment as its anchor, not after it
        p_mask = ((seg[:, None, :] == p_seg[:, :, None])
                  & (jnp.arange(T)[None, None, :] <= p_prev[:, :, None]))[:, None]  # [B,1,M,T]
        xp = lookup(embed.astype(dtype), p_tok)
        if cfg.grammar_embed:
            p_role, p_index = _probe_grammar(tokens, seg, last, p_tok, p_prev)
            xp = xp + (params["role_embed"][p_role] + params["index_embed"][p_index]).astype(dtype)
    else:
        xp = jnp.zeros((tokens.shape[0], 0, cfg.d_model), dtype)
    if cfg.dst_memory:  # what the named destination costs, learned per destination
        mem = params["dst_memory"]
        row, on, p_row, p_on = dst_memory_rows(tokens, seg, cfg.dst_memory, probes)
        x = x + jnp.where(on[..., None], mem[row], 0).astype(dtype)
        if probes is not None:
            xp = xp + jnp.where(p_on[..., None], mem[p_row], 0).astype(dtype)
    match = p_match = None
    # bool [B, 1, T, T] (and [B, 1, M, T] for probes)
    if cfg.match_dst or cfg.context_copy or cfg.context_fail:
        match, p_match = same_destination(tokens, seg, probes)  # same destination
    head0 = (jnp.arange(cfg.n_heads) == 0).astype(dtype)[None, :, None, None] * cfg.match_dst
    # head 0's bias [B, 1, T, T] (train.model.attention.attention spreads it over the heads
    # or runs that head apart): the same values as match * head0 * gain on head 0

    rot = rope_tables(pos, cfg.head_dim, cfg.rope_base)
    p_rot = rope_tables(p_pos, cfg.head_dim, cfg.rope_base) if probes is not None else None

    def mlp(x, p):
        u = norm_matmul("btd,df->btf", x, p["mlp_norm"], p["w_in"].astype(dtype), cfg.norm_eps)
        return x + gelu_out(u, p["w_out"].astype(dtype))

    def block(carry, p):
        x, xp = carry
        # [B, T, 3, N, H]: q, k and v are strided views of the matmul's output, read by the
        # fusions that use them (an [3, B, T, N, H] output was a transpose of its own)
        qkv = norm_matmul("btd,dsnh->btsnh", x, p["attn_norm"], p["wqkv"].astype(dtype),
                          cfg.norm_eps)
        qkv = (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        q, k = rope(qkv[0], rot), rope(qkv[1], rot)
        bias = None if not cfg.match_dst else match.astype(dtype) * (cfg.match_dst * p["match_gain"])
        a = attn.attention(q, k, qkv[2], seg, implementation=attention.implementation,
                           max_segments=attention.max_segments, bias=bias)
        x = mlp(x + jnp.einsum("btnh,nhd->btd", a, p["wo"].astype(dtype)), p)
        if probes is not None:
            hp = rms_norm(xp, p["attn_norm"], cfg.norm_eps)
            qkv_p = jnp.einsum("bmd,dsnh->sbmnh", hp, p["wqkv"].astype(dtype))
            qp, kp = rope(qkv_p[0], p_rot), rope(qkv_p[1], p_rot)
            p_bias = (None if not cfg.match_dst
                      else p_match.astype(dtype) * (head0 * p["match_gain"]))
            ap = attn.probe_attention(qp, k, qkv[2], kp, qkv_p[2], p_mask, p_bias)
            xp = mlp(xp + jnp.einsum("bmnh,nhd->bmd", ap, p["wo"].astype(dtype)), p)
        return (x, xp), None

    if cfg.remat:
        block = jax.checkpoint(block)
    if cfg.scan_layers:
        (x, xp), _ = jax.lax.scan(block, (x, xp), params["layers"])
    else:
        for i in range(cfg.n_layers):
            (x, xp), _ = block((x, xp), jax.tree.map(lambda a: a[i], params["layers"]))
    def head(x, at=None):
        logits = (rms_norm(x, params["final_norm"], cfg.norm_eps)
                  @ head_w.astype(dtype)).astype(jnp.float32)
        if at is None:
            return logits
        r, o = at  # the destination prior, gated by what the layers read
        gate = jax.nn.sigmoid(x.astype(jnp.float32) @ params["prior_gate"])
        prior_out = params["prior_out"]
        if not cfg.dst_prior_result:
            prior_out = prior_out.at[:, jnp.array([vocab.FAILED, vocab.RTT_START])].set(0.0)
        prior = (params["prior_table"][r] * cfg.dst_prior_scale) @ prior_out
        return logits + jnp.where(o[..., None], gate[..., None] * prior, 0.0)

    prior = bool(cfg.dst_memory and cfg.dst_prior_scale)
    out = head(x, (row, on) if prior else None)
    out_p = None if probes is None else head(xp, (p_row, p_on) if prior else None)
    if fold is not None:  # the fold's tokens: what the layers give is a constant to them
        assert probes is None, "fold is for training; probes are for queries"
        sg = jax.lax.stop_gradient
        out, x = (jnp.where(fold[..., None], sg(a), a) for a in (out, x))
    own_out = out
    answered = jnp.zeros(tokens.shape, bool)  # where a store is mixed in
    copy = p_copy = None
    if cfg.context_copy:
        widths = tuple(jax.nn.softplus(params["copy_width"][i]) * COPY_WIDTH[i] for i in range(2))
        copy, p_copy = context_copy(tokens, seg, match, cfg.context_copy, probes, p_match, widths)
    stores = []  # (table, parameter prefix, keys: the destination's hashes where None, shift)
    if cfg.dst_store:  # the train split's replies to the destination (not learned)
        stores.append(("dst_store", "store", None, None))
    if cfg.dst_store and cfg.placed_store:  # the same, moved by the probe's factor
        stores.append(("dst_store", "placed", None,
                       probe_shift(jax.lax.stop_gradient(params["dst_store"]), tokens, seg,
                                   cfg.placed_store, probes)))
    if cfg.dst_store and cfg.krig_store:  # the same, moved by the destinations' covariance
        sg = jax.lax.stop_gradient
        stores.append(("dst_store", "krig", None,
                       kriged_shift(sg(params["dst_store"]), sg(params["krig_store"]),
                                    sg(params["krig_noise"][0]), tokens, seg, probes)))
    if cfg.pair_store and cfg.pair_reverse:  # the train split's replies of the reverse pair
        stores.append(("pair_store", "pair", pair_keys(tokens, seg, probes, src_hash),
                       None))
    if cfg.pair_store and cfg.pair_forward:  # and of the measurement's own pair (mixed last)
        stores.append(("pair_latest" if cfg.own_latest else "pair_store", "fwd",
                       pair_keys(tokens, seg, probes, src_hash, reverse=False), None))
    for table, name, keys, shift in stores:
        widths = tuple(jax.nn.softplus(params[f"{name}_width"][i]) * COPY_WIDTH[i] for i in range(2))
        (dist, s_on), p_store = store_dists(
            jax.lax.stop_gradient(params[table]), tokens, seg, probes, widths, keys, shift,
            cfg.pair_min if table.startswith("pair_") else arch.STORE_MIN)
        # only where the context holds no reply to the destination: where it does, the copy
        # answers, and a store mixed in there too diluted what the layers read of the
        # context (docs/learning.md section 8.7)
        if copy is not None:
            s_on = s_on & ~copy[1]
        gate_fold = fold
        if name == "fwd":  # in training, only on its fold, whose contexts the store lacks
            gate_fold = pair_fold
            if pair_fold is not None:
                s_on = s_on & pair_fold
        out = _mix_copy(params, out, x, dist, s_on, name, gate_fold)
        answered = answered | s_on
        if probes is not None:
            p_on = p_store[1] if p_copy is None else p_store[1] & ~p_copy[1]
            out_p = _mix_copy(params, out_p, xp, p_store[0], p_on, name)
    if cfg.context_fail and cfg.context_fail_anchor:  # the baselines' rule on the context's
        # counts, and the residual's logit; the pair store's failures mix in after it
        failed, pings = context_fails(tokens, seg, match)
        c_failed, c_pings = segment_fails(tokens, seg)
        off = dst_fail_offsets(params, tokens, seg) if cfg.fail_dst else None
        out = _anchor_fail(params, out, x, failed, pings, c_failed, c_pings, cfg.context_fail,
                           before_result(tokens, seg), off, cfg.fail_anchor_fixed,
                           (tokens, seg) if cfg.fail_broken else None)
    if cfg.pair_store and cfg.pair_fail:  # the own pair's failures, before its result
        key, key_on = next(k for _, n, k, _ in stores if n == "fwd")[:2]
        share, f_on = fail_share(jax.lax.stop_gradient(params["pair_store"]), key, cfg.pair_min,
                                 cfg.pair_fail_recent)
        f_on = f_on & key_on & before_result(tokens, seg)
        if pair_fold is not None:  # in training, only on the forward read's fold
            f_on = f_on & pair_fold
        out = _mix_fail(params, out, x, share, f_on, pair_fold)
    if cfg.context_fail and not cfg.context_fail_anchor:  # the pair's own failures in the
        # context update what came before
        failed, pings = context_fails(tokens, seg, match)
        out = _update_fail(params, out, x, failed, pings, cfg.context_fail,
                           before_result(tokens, seg) & (pings > 0), cfg.context_dead,
                           cfg.context_fail_detach)
    if copy is not None:
        out = _mix_copy(params, out, x, *copy)
        if probes is not None:
            out_p = _mix_copy(params, out_p, xp, *p_copy)
    if fold is not None:  # where no store answers, the fold's tokens train nothing
        out = jnp.where((fold & ~answered)[..., None], jax.lax.stop_gradient(out), out)
    if own:
        return out, own_out
    return out if probes is None else (out, out_p)


# the copied bytes' spread (in byte values) is softplus(copy_width) times these (the
# parameter starts at 1: 0.66 and 13): a first-byte step is 1/8 of an octave, a second-byte
# one 1/2,048, and replies to one destination scatter by a few per cent
COPY_WIDTH = (0.5, 10.0)


def _ema_weights(cand: jax.Array, alpha: float) -> jax.Array:
    """float32[..., T]: the weight an EMA of ``alpha`` (the first value as is) gives each
    candidate key of bool ``cand`` [..., T], in key order; rows without one are 0."""
    c = cand.astype(jnp.int32)
    n = c.sum(-1, keepdims=True)
    after = (jnp.flip(jnp.cumsum(jnp.flip(c, -1), -1), -1) - c).astype(jnp.float32)
    w = jnp.where(after == (n - 1).astype(jnp.float32), (1.0 - alpha) ** after,
                  alpha * (1.0 - alpha) ** after)
    return jnp.where(cand, w, 0.0)


def _byte_kernel(b: jax.Array, width) -> jax.Array:
    """float32[..., 256]: a Laplace kernel of ``width`` (bytes) around byte values b [...],
    normalized: a reply's byte as a smooth distribution (one-hot as width goes to 0)."""
    d = jnp.abs(jnp.arange(256, dtype=jnp.float32) - b[..., None].astype(jnp.float32))
    return jax.nn.softmax(-d / width, axis=-1)


def context_copy(tokens: jax.Array, segment_ids: jax.Array, match: jax.Array, alpha: float,
                 probes=None, p_match=None, widths=(None, None)):
    """((dist float32[B, T, 256], on bool[B, T]), (p_dist, p_on) or None): at each token
    whose next one is an RTT byte (the result header RTT_START: the first byte; the first
    byte: the second), the distribution of that byte over the earlier replies to the
    measurement's destination in the row (``match``, same_destination's), each weighted as
    an EMA of ``alpha`` in row order weighs it; for the second byte, only the replies whose
    first byte is the one written. ``on``: such a token with at least one such reply. With
    ``probes`` (forward's; a probe that is a first RTT byte asks for the second) and
    ``p_match``, the same for them. ``widths`` (first byte, second): each reply's byte
    spread by a Laplace kernel of that many byte values, or one-hot (None)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    role, index, last = grammar(tokens, seg)
    rtt = vocab.ROLES.index("rtt")
    key = (role == rtt) & (index == 1)  # the second byte of a reply: the reply is whole
    b2 = jnp.clip(tokens - vocab.BYTE_OFFSET, 0, 255)
    b1 = jnp.clip(jnp.concatenate([tokens[:, :1], tokens[:, :-1]], 1) - vocab.BYTE_OFFSET,
                  0, 255)
    w1, w2 = widths  # smooth each reply's byte (a kernel of that width), or not (None)
    onehot1 = jax.nn.one_hot(b1, 256) if w1 is None else _byte_kernel(b1, w1)
    onehot2 = jax.nn.one_hot(b2, 256) if w2 is None else _byte_kernel(b2, w2)
    cand = match[:, 0] & key[:, None, :]  # [B, Q, T]

    def second(cand, q, first):  # q: asks for the second byte, its first byte ``first``
        c2 = cand & q[..., None] & (b1[:, None, :] == first[..., None])
        return jnp.einsum("bqt,btv->bqv", _ema_weights(c2, alpha), onehot2), c2.any(-1)

    q1 = tokens == vocab.RTT_START
    w1 = _ema_weights(cand & q1[..., None], alpha)
    d1, on1 = jnp.einsum("bqt,btv->bqv", w1, onehot1), (cand & q1[..., None]).any(-1)
    d2, on2 = second(cand, (role == rtt) & (index == 0), tokens - vocab.BYTE_OFFSET)
    out = (jnp.where(q1[..., None], d1, d2), on1 | on2)
    if probes is None:
        return out, None
    p_tok, p_prev = (x.astype(jnp.int32) for x in probes)
    p_role, p_index = _probe_grammar(tokens, seg, last, p_tok, p_prev)
    p_cand = p_match[:, 0] & key[:, None, :]
    return out, second(p_cand, (p_role == rtt) & (p_index == 0), p_tok - vocab.BYTE_OFFSET)


def _gate(params: dict, x: jax.Array, name: str, fold: jax.Array | None = None):
    """The logit of gate ``name``: x . {name}_gate + {name}_bias; with ``fold``, learned
    on the fold's positions alone, x read as a constant."""
    if fold is not None:
        x = jax.lax.stop_gradient(x)
    z = x.astype(jnp.float32) @ params[f"{name}_gate"] + params[f"{name}_bias"]
    return z if fold is None else jnp.where(fold, z, jax.lax.stop_gradient(z))


def _mix_copy(params: dict, logits: jax.Array, x: jax.Array, dist: jax.Array, on: jax.Array,
              name: str = "copy", fold: jax.Array | None = None):
    """log((1 - g) softmax(logits) + g dist) where ``on`` (dist over the 256 byte tokens),
    g = sigmoid(x . {name}_gate + {name}_bias); the logits elsewhere. With ``fold``
    (forward's), g is learned on the fold's tokens alone, and reads x as a constant."""
    z = _gate(params, x, name, fold)
    lo = vocab.BYTE_OFFSET
    copy = jnp.full(logits.shape, -jnp.inf, jnp.float32).at[..., lo:lo + 256].set(
        jnp.log(jnp.maximum(jnp.where(on[..., None], dist, 1.0), 1e-30)))  # (0 x log'(0): NaN)
    mixed = jnp.logaddexp(jax.nn.log_sigmoid(-z)[..., None] + jax.nn.log_softmax(logits),
                          jax.nn.log_sigmoid(z)[..., None] + copy)
    return jnp.where(on[..., None], mixed, logits)


def _mix_fail(params: dict, logits: jax.Array, x: jax.Array, share: jax.Array, on: jax.Array,
              fold: jax.Array | None = None):
    """Where ``on``: log-probabilities whose FAILED and RTT_START keep their sum S and split
    it as (1 - g) m + g ``share`` (m: the model's P(FAILED) / S) and 1 minus that, g =
    sigmoid(x . fail_gate + fail_bias), every other token's as the model's; the logits
    elsewhere. With ``fold`` (forward's ``pair_fold``), g learns on the fold alone, reading
    x as a constant (ModelConfig.pair_fail)."""
    g = jax.nn.sigmoid(_gate(params, x, "fail", fold))
    return _resplit_fail(logits, lambda m: (1.0 - g) * m + g * share, on)


def _resplit_fail(logits: jax.Array, rule, on: jax.Array, detach: bool = False) -> jax.Array:
    """Where ``on``: log-probabilities whose FAILED and RTT_START keep their sum S and split
    it as q = rule(m) and 1 - q, m the logits' P(FAILED) / S (a constant to the gradient
    with ``detach``); the logits elsewhere."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32))
    l_f, l_r = lp[..., vocab.FAILED], lp[..., vocab.RTT_START]
    l_s = jnp.logaddexp(l_f, l_r)
    m = jnp.exp(l_f - l_s)
    q = rule(jax.lax.stop_gradient(m) if detach else m)
    mixed = (lp.at[..., vocab.FAILED].set(l_s + jnp.log(jnp.maximum(q, 1e-30)))
             .at[..., vocab.RTT_START].set(l_s + jnp.log(jnp.maximum(1.0 - q, 1e-30))))
    return jnp.where(on[..., None], mixed, logits)


def context_fails(tokens: jax.Array, segment_ids: jax.Array, match: jax.Array):
    """(failed, pings) float32[B, T]: at each token, how many of the row's earlier
    measurements to the destination its measurement names (``match``, same_destination's)
    have a result (RTT_START or FAILED), and how many of those failed."""
    tokens = tokens.astype(jnp.int32)
    m = match[:, 0].astype(jnp.float32)
    head = ((tokens == vocab.RTT_START) | (tokens == vocab.FAILED)) & (segment_ids > 0)
    failed = jnp.einsum("bqt,bt->bq", m, (tokens == vocab.FAILED).astype(jnp.float32))
    return failed, jnp.einsum("bqt,bt->bq", m, head.astype(jnp.float32))


def segment_fails(tokens: jax.Array, segment_ids: jax.Array):
    """(failed, pings) float32[B, T]: at each token, how many results (RTT_START or FAILED)
    its segment holds up to it, and how many of those failed: before a measurement's
    result, its context's earlier measurements to any destination."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    new = (seg > 0) & (seg != jnp.pad(seg, ((0, 0), (1, 0)), constant_values=0)[:, :-1])
    first = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    on = seg > 0
    failed = ((tokens == vocab.FAILED) & on).astype(jnp.float32)
    pings = (((tokens == vocab.RTT_START) | (tokens == vocab.FAILED)) & on).astype(jnp.float32)
    return _so_far(failed, first), _so_far(pings, first)


def anchor_rule(c: jax.Array, failed, pings, c_failed, c_pings, strength: float, off=None):
    """P(failed) by the context baselines' dead-or-live rule (train.model.failprior's
    FailPrior and fail_shares) from the pair's counts (``failed`` of ``pings``) and the context's
    (``c_failed`` of ``c_pings``), its constants ``c`` (float32[6]) offsets from
    FAIL_ANCHOR's: the context's share (c_failed + s_c r) / (c_pings + s_c) where the pair
    has no ping, else w q + (1 - w) (failed + s live) / (pings + s), w the posterior
    P(dead) (dead_posterior), s = ``strength`` exp(c[3]). ``off`` ([..., 3], the
    destination's: dst_fail_offsets) moves the logits of r, P(dead) and live."""
    c = c + jnp.asarray(FAIL_ANCHOR, jnp.float32)
    o = [0.0, 0.0, 0.0] if off is None else [off[..., k] for k in range(3)]
    rate, s_c, live = jax.nn.sigmoid(c[0] + o[0]), jnp.exp(c[1]), jax.nn.sigmoid(c[2] + o[2])
    s, prior, q = strength * jnp.exp(c[3]), c[4] + o[1], jax.nn.sigmoid(c[5])
    ctx = (c_failed + s_c * rate) / (c_pings + s_c)
    w = dead_posterior(failed, pings, s * live, s * (1.0 - live), prior, q)
    pair = w * q + (1.0 - w) * (failed + s * live) / (pings + s)
    return jnp.where(pings > 0, pair, ctx)


@jax.jit
def _result_counts(tokens: jax.Array, segment_ids: jax.Array):
    """(counts float32[4, B, T - 1], failed bool[B, T - 1], at bool[B, T - 1]): at each
    token that is followed by its measurement's result, the counts anchor_rule reads
    (context_fails', segment_fails'), whether that result is FAILED, and where it is one
    whose measurement named its whole destination before it (the order a query has: where
    the block order puts the result first, the pair is not known there)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    failed, pings = context_fails(tokens, seg, same_destination(tokens, seg)[0])
    counts = jnp.stack([failed, pings, *segment_fails(tokens, seg)])[:, :, :-1]
    so_far, full, _ = address_hashes(tokens, seg, "dst")
    nxt = tokens[:, 1:]
    at = (before_result(tokens, seg)[:, :-1] & (seg[:, 1:] > 0)
          & ((nxt == vocab.FAILED) | (nxt == vocab.RTT_START))
          & ((so_far == full) & (full != 0))[:, :-1])
    return counts, nxt == vocab.FAILED, at


def dst_fail_offsets(params: dict, tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """float32[B, T, 3]: at each token, the offsets (ModelConfig.fail_dst's table, beside
    the destination store's rows) of the destination its measurement has named whole up to
    it, where the destination store holds that destination's row; 0 elsewhere."""
    h, on, _, _ = dst_hashes(tokens, segment_ids)
    store = jax.lax.stop_gradient(params["dst_store"])
    table = jax.lax.stop_gradient(params["fail_dst"])
    K = arch.STORE_K
    mine = lambda r: (store[r, K] >= arch.STORE_MIN) & (store[r, K + 1] == store_check(h))
    r1, r2 = store_rows(h, store.shape[0])
    ok1, ok2 = mine(r1), mine(r2)
    off = jnp.where(ok1[..., None], table[r1], table[r2])
    return jnp.where((on & (ok1 | ok2))[..., None], off, 0.0)


@jax.jit
def _result_pairs(tokens: jax.Array, segment_ids: jax.Array):
    """(dst, src, failed, at), [B, T - 1] each: at each token followed by its measurement's
    result (``at``), the hashes of the measurement's whole destination and source
    (address_hashes') and whether the result is FAILED."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    dst = address_hashes(tokens, seg, "dst")[1][:, :-1]
    src = address_hashes(tokens, seg, "src")[1][:, :-1]
    nxt = tokens[:, 1:]
    at = (before_result(tokens, seg)[:, :-1] & (seg[:, 1:] > 0)
          & ((nxt == vocab.FAILED) | (nxt == vocab.RTT_START)))
    return dst, src, nxt == vocab.FAILED, at


def _at_results(fn, tokens: np.ndarray, segment_ids: np.ndarray, batch: int, *args):
    """fn's outputs (jitted; [B, T - 1] each, the last its ``at`` mask, with args after the
    rows) at every ``at`` of the rows (numpy, [rows, T]), in row order, over batches of
    ``batch`` rows (the last padded with empty rows: one compiled shape); a leading axis
    kept. None without rows."""
    out = []
    for a in range(0, len(tokens), batch):
        tok, seg = tokens[a:a + batch], segment_ids[a:a + batch]
        if len(tok) < batch:
            pad = ((0, batch - len(tok)), (0, 0))
            tok, seg = np.pad(tok, pad), np.pad(seg, pad)
        *xs, at = (np.asarray(x) for x in fn(tok, seg, *args))
        out.append([x[..., at] for x in xs])
    return [np.concatenate(x, axis=-1) for x in zip(*out)] if out else None


def result_pairs(tokens: np.ndarray, segment_ids: np.ndarray, batch: int = 256):
    """(dst, src int32[n], failed bool[n]) of every result in the rows, in row order: its
    measurement's destination and source hashes (the destination store's keys) and whether
    it failed."""
    got = _at_results(_result_pairs, tokens, segment_ids, batch)
    if got is None:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, bool)
    return tuple(got)


def result_fail_counts(tokens: np.ndarray, segment_ids: np.ndarray, batch: int = 256):
    """(counts float64[4, n], failed bool[n]) over every result in the rows (``tokens``,
    ``segment_ids`` [rows, T], numpy) whose destination came before it, in row order: the
    pair's earlier (failed, pings) in its segment and the segment's (failed, results) before
    it, as the model reads them before the result (train.model.failprior.fail_shares'
    counts); whether it failed."""
    got = _at_results(_result_counts, tokens, segment_ids, batch)
    if got is None:
        return np.zeros((4, 0)), np.zeros(0, bool)
    return got[0].astype(np.float64), got[1]


def family_chain(tokens: jax.Array, segment_ids: jax.Array, logp: jax.Array):
    """(family int32, n float32, loglik float32), [B, T] each: at each token, the address
    family (4, 6) its measurement has named so far (0 before its first address header)
    and, where every one of the segment's earlier measurements of that family failed, how
    many there are and the sum of ``logp`` ([B, T], log P(failed) at each token) at the
    token before each of their results (what the model gave each failure); 0 and 0 where
    one of them replied or there is none. The context baselines' chain
    (train.eval.context_baselines.family_chain) for the broken family
    (ModelConfig.fail_broken)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    start, first = _starts(tokens, seg)
    on = seg > 0
    named = lambda *ids: _so_far((jnp.isin(tokens, jnp.asarray(ids)) & on).astype(jnp.int32),
                                 first) > 0
    fam = jnp.where(named(vocab.SRC_IPV6, vocab.DST_IPV6), 6,
                    jnp.where(named(vocab.SRC_IPV4, vocab.DST_IPV4), 4, 0))
    fail = (tokens == vocab.FAILED) & on
    was_failed = _so_far(fail.astype(jnp.int32), first) > 0
    replied = named(vocab.RTT_START)
    ll = _so_far(jnp.where(fail, jnp.pad(logp, ((0, 0), (1, 0)))[:, :-1], 0.0), first)
    # a measurement's last token: its family, its result and what it was given are whole
    last = jnp.concatenate([start[:, 1:] | (seg[:, 1:] != seg[:, :-1]),
                            jnp.ones_like(start[:, :1])], axis=1) & on
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    new = on & (seg != jnp.pad(seg, ((0, 0), (1, 0)))[:, :-1])
    seg_first = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    n, loglik = jnp.zeros(tokens.shape), jnp.zeros(tokens.shape)
    for f in (4, 6):  # the segment's measurements so far that ended before each token
        mine = last & (fam == f)
        k = _so_far(jnp.where(mine & was_failed, 1.0, 0.0), seg_first)
        ok = _so_far(jnp.where(mine & replied, 1.0, 0.0), seg_first) == 0
        lk = _so_far(jnp.where(mine & was_failed, ll, 0.0), seg_first)
        n = jnp.where((fam == f) & ok, k, n)
        loglik = jnp.where((fam == f) & ok, lk, loglik)
    return fam, n, loglik


def broken_mix(p: jax.Array, family, n, loglik, broken: jax.Array) -> jax.Array:
    """train.model.failprior.broken_shares in jax: w + (1 - w) p where ``n`` > 0 and the
    family's prior (``broken``, float32[2]: IPv4's, IPv6's) is above 0, w the posterior
    P(broken) = b / (b + (1 - b) exp(loglik)); ``p`` elsewhere."""
    b = jnp.where(family == 6, broken[1], broken[0])
    on = (n > 0) & (b > 0)
    b = jnp.clip(b, 1e-9, 1.0 - 1e-9)
    w = jax.nn.sigmoid(jnp.log(b) - jnp.log1p(-b) - loglik)
    return jnp.where(on, w + (1.0 - w) * p, p)


@functools.partial(jax.jit, static_argnames="strength")
def _result_chain(tokens: jax.Array, segment_ids: jax.Array, c: jax.Array, strength: float):
    """(p, family, n, loglik, failed, at), [B, T - 1] each: anchor_rule's P(failed) with
    constants ``c`` and the broken family's chain of it (family_chain) at each token before
    a result, whether that result failed, and where it is one result_fail_counts takes."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    failed, pings = context_fails(tokens, seg, same_destination(tokens, seg)[0])
    p = jnp.clip(anchor_rule(c, failed, pings, *segment_fails(tokens, seg), strength),
                 1e-6, 1.0 - 1e-6)
    chain = family_chain(tokens, seg, jnp.log(p))
    _, y, at = _result_counts(tokens, seg)
    return (p[:, :-1], *(x[:, :-1] for x in chain), y, at)


def result_family_chain(tokens: np.ndarray, segment_ids: np.ndarray, c: np.ndarray,
                        strength: float, batch: int = 256):
    """(p, family, n, loglik, failed), [n] each, over the results result_fail_counts takes,
    in row order: the anchor's P(failed) with constants ``c`` (fanchor's), the broken
    family's chain of it and whether the result failed: what
    train.model.failprior.fit_broken fits the priors of ModelConfig.fail_broken on."""
    got = _at_results(_result_chain, tokens, segment_ids, batch,
                      jnp.asarray(c, jnp.float32), float(strength))
    if got is None:
        return (np.zeros(0),) * 5
    p, fam, n, ll, y = got
    return p.astype(np.float64), fam, n.astype(np.float64), ll.astype(np.float64), y


def _anchor_fail(params: dict, logits: jax.Array, x: jax.Array, failed, pings, c_failed,
                 c_pings, strength: float, on: jax.Array, off=None,
                 fixed: bool = False, rows=None) -> jax.Array:
    """Where ``on``: log-probabilities whose FAILED and RTT_START keep their sum and split
    it as sigmoid(logit(anchor_rule) + x . fanchor_gate + fanchor_bias)
    (ModelConfig.context_fail_anchor; ``off``: anchor_rule's); the logits elsewhere. With
    ``fixed`` (ModelConfig.fail_anchor_fixed) the rule's constants are data and the gate
    adds its logit only where the pair has a ping (``pings`` > 0). With ``rows`` (tokens,
    segment_ids: ModelConfig.fail_broken) the rule weighs the broken family (broken_mix,
    the chain of its own answers as a constant, fbroken's priors)."""
    c = jax.lax.stop_gradient(params["fanchor"]) if fixed else params["fanchor"]
    p = jnp.clip(anchor_rule(c, failed, pings, c_failed, c_pings, strength, off),
                 1e-6, 1.0 - 1e-6)
    if rows is not None:
        chain = family_chain(*rows, jax.lax.stop_gradient(jnp.log(p)))
        p = jnp.clip(broken_mix(p, *chain, jax.lax.stop_gradient(params["fbroken"])),
                     1e-6, 1.0 - 1e-6)
    g = _gate(params, x, "fanchor")
    if fixed:
        g = jnp.where(pings > 0, g, 0.0)
    z = jnp.log(p) - jnp.log1p(-p) + g
    return _resplit_fail(logits, lambda m: jax.nn.sigmoid(z), on)


def _update_fail(params: dict, logits: jax.Array, x: jax.Array, failed: jax.Array,
                 pings: jax.Array, strength: float, on: jax.Array, dead: bool = False,
                 detach: bool = False):
    """Where ``on``: log-probabilities whose FAILED and RTT_START keep their sum S and split
    it as q = (failed + s m) / (pings + s) and 1 - q (m: the logits' P(FAILED) / S), s =
    ``strength`` exp(x . cfail_gate + cfail_bias): the logits' split a beta prior of s
    pseudo-pings, the counts its update (ModelConfig.context_fail); with ``dead``, that
    mixed with a dead pair's rate by the posterior P(dead) (dead_posterior); the logits
    elsewhere."""
    z = _gate(params, x, "cfail")
    s = strength * jnp.exp(jnp.clip(z, -8.0, 8.0))
    if not dead:
        return _resplit_fail(logits, lambda m: (failed + s * m) / (pings + s), on, detach)
    prior = _gate(params, x, "cdead") + DEAD_PRIOR
    rate = jax.nn.sigmoid(params["cdead_rate"] + DEAD_RATE)

    def rule(m):
        m = jnp.clip(m, 1e-4, 1.0 - 1e-4)
        w = dead_posterior(failed, pings, s * m, s * (1.0 - m), prior, rate)
        return w * rate + (1.0 - w) * (failed + s * m) / (pings + s)
    return _resplit_fail(logits, rule, on, detach)


# P(dead)'s logit and a dead pair's rate's logit at the start (ModelConfig.context_dead)
DEAD_PRIOR, DEAD_RATE = -2.0, 3.0


def dead_posterior(failed, pings, a, b, prior_logit, rate):
    """P(dead | failed of pings): a dead pair fails at ``rate``, a live one at a Beta(a, b)
    draw; ``prior_logit`` the prior's logit (the binomial coefficient, in both, cancels)."""
    lg = jax.scipy.special.gammaln
    live = (lg(failed + a) + lg(pings - failed + b) - lg(pings + a + b)
            - lg(a) - lg(b) + lg(a + b))
    dead = failed * jnp.log(rate) + (pings - failed) * jnp.log1p(-rate)
    return jax.nn.sigmoid(prior_logit + dead - live)


# one odd multiplier per byte index: an address's hash is the sum of (byte + 1) * M[index]
# over its block (int32, wrapping), 0 for "no address named yet"
_ADDR_MULT = (np.random.default_rng(12345).integers(1 << 20, 1 << 30, arch.N_INDEX) | 1
             ).astype(np.int32)


def _so_far(x: jax.Array, first: jax.Array) -> jax.Array:
    """The running sum of x [B, T] from each token's measurement start (``first``) to it."""
    csum = jnp.cumsum(x, axis=1, dtype=x.dtype)
    return csum - jnp.take_along_axis(csum - x, first, axis=1)


def _starts(tokens: jax.Array, seg: jax.Array):
    """(start, first), [B, T] each: whether each token is a measurement's MEASUREMENT_START
    (never on padding), and the index of the start of the measurement it is in (0 before a
    row's first)."""
    start = (tokens == vocab.MEASUREMENT_START) & (seg > 0)
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    return start, jax.lax.cummax(jnp.where(start, idx, 0), axis=1)


def _addr_part(tokens: jax.Array, role: jax.Array, index: jax.Array, field: str) -> jax.Array:
    """Each token's part of its ``field`` address's hash: (byte + 1) * _ADDR_MULT[index] on
    the field's bytes, 0 elsewhere (summed over a block, with wrapping, that is the hash)."""
    return jnp.where(role == vocab.ROLES.index(field),
                     (tokens - vocab.BYTE_OFFSET + 1) * jnp.asarray(_ADDR_MULT)[index], 0)


def address_hashes(tokens: jax.Array, segment_ids: jax.Array, field: str):
    """(so_far, full, meas), int32[B, T] each: the hash of the ``field`` ("src" or "dst")
    address that each token's measurement has named up to and including it (0 before the
    block), of the whole measurement's address, and the measurement's number along the row.
    A hash is the sum of (byte + 1) * _ADDR_MULT[byte index] over the block (wrapping)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    role, index, last = grammar(tokens, seg)
    c = _addr_part(tokens, role, index, field)
    start, first = _starts(tokens, seg)
    meas = jnp.cumsum(start, axis=1, dtype=jnp.int32)
    T = tokens.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)
    so_far = _so_far(c, first)
    # the whole measurement's: so_far at its last token (the next start - 1, or the row's end)
    nxt = jnp.flip(jax.lax.cummin(jnp.flip(jnp.where(start, idx, T), 1), axis=1), 1)
    end = jnp.concatenate([nxt[:, 1:], jnp.full_like(nxt[:, :1], T)], axis=1) - 1
    full = jnp.take_along_axis(so_far, end, axis=1)
    return so_far, full, meas


# each address header's block width, by token id (0 for any other token)
_WIDTH = {f: np.zeros(vocab.VOCAB_SIZE, np.int32) for f in ("src", "dst")}
_WIDTH["src"][[vocab.SRC_IPV4, vocab.SRC_IPV6]] = vocab.WIDTH_OF[[vocab.SRC_IPV4, vocab.SRC_IPV6]]
_WIDTH["dst"][[vocab.DST_IPV4, vocab.DST_IPV6]] = vocab.WIDTH_OF[[vocab.DST_IPV4, vocab.DST_IPV6]]


def memory_row(h: jax.Array, rows: int) -> jax.Array:
    """A destination hash's row of a table of ``rows`` (a power of two): Fibonacci hashing,
    the top bits of h times 2^32 / golden ratio."""
    shift = 32 - int(rows).bit_length() + 1
    return ((h.astype(jnp.uint32) * jnp.uint32(2654435769)) >> shift).astype(jnp.int32)


# a store key's second row: memory_row of key * _ALT[0] + _ALT[1]
_ALT = (np.random.default_rng(31415).integers(1 << 20, 1 << 30, 2) | 1).astype(np.int32)


def store_rows(h, rows: int):
    """The two rows of a store of ``rows`` where key ``h`` may be (train.model.store places
    each key in one of them by cuckoo hashing; a lookup reads both)."""
    h = jnp.asarray(h, jnp.int32)
    return memory_row(h, rows), memory_row(h * _ALT[0] + _ALT[1], rows)


def field_hashes(tokens: jax.Array, segment_ids: jax.Array, field: str = "dst", probes=None):
    """(h int32[B, T], on bool[B, T], p_h, p_on): the hash of each token's measurement's
    ``field`` ("src" or "dst") address (address_hashes' hash), and whether that address is
    whole at it (from the token that completes its block to the measurement's end; off
    before, on padding and on markers of a new measurement); with ``probes`` (forward's),
    the same two, [B, M], for them, else None. Read from the token and those before it in
    its measurement."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    role, index, last = grammar(tokens, seg)
    is_field = role == vocab.ROLES.index(field)
    c = _addr_part(tokens, role, index, field)
    width = jnp.asarray(_WIDTH[field])[tokens]
    _, first = _starts(tokens, seg)
    h, n, w = (_so_far(x, first) for x in (c, is_field.astype(jnp.int32), width))
    on = (w > 0) & (n == w) & (seg > 0)
    if probes is None:
        return h, on, None, None
    p_tok, p_prev = (x.astype(jnp.int32) for x in probes)
    p_role, p_index = _probe_grammar(tokens, seg, last, p_tok, p_prev)
    p_field = p_role == vocab.ROLES.index(field)
    keep = p_tok != vocab.MEASUREMENT_START  # a probe that starts a measurement names nothing
    at = lambda x: jnp.where(keep, jnp.take_along_axis(x, p_prev, axis=1), 0)
    p_h = at(h) + _addr_part(p_tok, p_role, p_index, field)
    p_n = at(n) + p_field
    p_w = at(w) + jnp.asarray(_WIDTH[field])[p_tok]
    p_on = (p_w > 0) & (p_n == p_w) & (jnp.take_along_axis(seg, p_prev, axis=1) > 0)
    return h, on, p_h, p_on


def dst_hashes(tokens: jax.Array, segment_ids: jax.Array, probes=None):
    """``field_hashes`` of the destination."""
    return field_hashes(tokens, segment_ids, "dst", probes)


# two odd multipliers: a pair's key is a * _PAIR[0] + b * _PAIR[1] (int32, wrapping), so
# (a, b) and (b, a) differ
_PAIR = (np.random.default_rng(2718).integers(1 << 20, 1 << 30, 2) | 1).astype(np.int32)


def pair_key(a, b):
    """The key of the ordered address pair (a, b) from their hashes (numpy or jax int32)."""
    return a * _PAIR[0] + b * _PAIR[1]


def pair_keys(tokens: jax.Array, segment_ids: jax.Array, probes=None, src_hash=None, *,
              reverse: bool = True):
    """(key, on, p_key, p_on) as ``field_hashes``: the key of each measurement's reverse
    pair, (its destination, its source), where both addresses are whole; with ``reverse``
    False, of its own pair, (its source, its destination) (ModelConfig.pair_forward).
    ``src_hash`` (int32[B, T], ``field_hashes(raw tokens, ..., "src")[0]``) stands in for
    the source hashes of ``tokens``: training reads rows whose sources are anonymized, and
    the pair store is keyed by the real ones."""
    hd, od, p_hd, p_od = field_hashes(tokens, segment_ids, "dst", probes)
    hs, os_, p_hs, p_os = field_hashes(tokens, segment_ids, "src", probes)
    if src_hash is not None:
        hs = src_hash.astype(jnp.int32)
    key = (lambda d, s: pair_key(d, s)) if reverse else (lambda d, s: pair_key(s, d))
    if probes is None:
        return key(hd, hs), od & os_, None, None
    return key(hd, hs), od & os_, key(p_hd, p_hs), p_od & p_os


def dst_memory_rows(tokens: jax.Array, segment_ids: jax.Array, rows: int, probes=None):
    """(row int32[B, T], on bool[B, T], p_row, p_on): each token's row of the destination
    memory (ModelConfig.dst_memory) and whether it is on (``dst_hashes``); with ``probes``,
    the same two for them, else None."""
    h, on, p_h, p_on = dst_hashes(tokens, segment_ids, probes)
    return (memory_row(h, rows), on, None if p_h is None else memory_row(p_h, rows), p_on)


def store_check(h):
    """What a destination store row holds to say whose it is: the low 16 bits of the
    destination's hash (its row comes from the high bits), exact in float32. numpy or jax."""
    return (h & 0xFFFF).astype(np.float32)


def _code_value(code):
    """An RTT code's value in µs (mantissa * 2^exponent; prep.tokens)."""
    return (code & 0x7FF).astype(jnp.float32) * jnp.exp2((code >> 11).astype(jnp.float32))


def _value_code(us):
    """The code of a value in µs, as the tokenizer writes it (prep.tokens.reference.rtt_code:
    the smallest exponent whose rounded mantissa fits 11 bits; at least 1 µs, saturating)."""
    us = jnp.maximum(us, 1.0)
    e = jnp.clip(jnp.floor(jnp.log2(us)).astype(jnp.int32) - 10, 0, 31)
    m = jnp.floor(us / jnp.exp2(e.astype(jnp.float32)) + 0.5).astype(jnp.int32)
    up = m >= 2048  # rounding carried into a 12th bit
    e = jnp.where(up, e + 1, e)
    m = jnp.where(up, jnp.floor(us / jnp.exp2(e.astype(jnp.float32)) + 0.5).astype(jnp.int32), m)
    big = e > 31
    return jnp.where(big, (31 << 11) | 2047, (e << 11) | jnp.minimum(m, 2047))


def _store_row(store, h, min_count: int = arch.STORE_MIN, pings: bool = False):
    """(row float32[..., K + 2], ok bool[...]): key h's row of a store (``store_rows``; its
    own: the check matches and it holds at least ``min_count`` replies, or with ``pings``
    replies and failed pings, the pair store's column K + 2, ModelConfig.pair_fail)."""
    K = arch.STORE_K
    count = (lambda r: r[..., K] + r[..., K + 2]) if pings else (lambda r: r[..., K])
    mine = lambda r: (count(r) >= min_count) & (r[..., K + 1] == store_check(h))
    r1, r2 = (store[i] for i in store_rows(h, store.shape[0]))
    ok1 = mine(r1)
    return jnp.where(ok1[..., None], r1, r2), ok1 | mine(r2)


def fail_share(store: jax.Array, h, min_count: int, recent: int = 0):
    """(share float32[...], ok bool[...]): key h's share of failed pings in the pair store
    with failures (ModelConfig.pair_fail; train.model.store.build's ``failures``), as
    (failed + 1/2) / (pings + 1); ok where its row is its own with ``min_count`` pings. With
    ``recent`` (ModelConfig.pair_fail_recent; build's ``fail_recent``) the row's failures are
    those among the pair's latest ``recent`` pings, and so are its pings: min(recent,
    replies + failed), the replies column counting all of them. Never ok where the row's
    failures are -1: a pair whose source address unrelated hosts share (a NAT's), whose
    failures are several probes' (build)."""
    K = arch.STORE_K
    r, ok = _store_row(store, h, min_count, pings=True)
    failed = r[..., K + 2]
    known = failed >= 0
    failed = jnp.maximum(failed, 0.0)  # (finite where not read: a gradient meets both sides)
    pings = r[..., K] + failed
    if recent:
        pings = jnp.minimum(pings, float(recent))
    return (failed + 0.5) / (pings + 1.0), ok & known


def before_result(tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """bool[B, T]: the tokens of a measurement before its result header (RTT_START or
    FAILED), where the next token may yet be it; never on padding."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    _, first = _starts(tokens, seg)
    result = ((tokens == vocab.RTT_START) | (tokens == vocab.FAILED)) & (seg > 0)
    return (_so_far(result.astype(jnp.int32), first) == 0) & (seg > 0)


def _reply_ratios(store: jax.Array, tokens: jax.Array, seg: jax.Array):
    """(start, last, h, dst_on, seen, lr), [B, T] each: the measurement starts; a
    measurement's last tokens (the next is a start, padding, or the row's end); the hash of
    the destination it has named so far and whether that is whole (``dst_hashes``);
    whether it has a reply and its destination a row of its own in ``store`` (the
    destination store); the log2 ratio of that reply to the row's median quantile. At a
    measurement's last token these are the whole measurement's."""
    K = arch.STORE_K
    role, index, _ = grammar(tokens, seg)
    start, first = _starts(tokens, seg)
    rtt, b = vocab.ROLES.index("rtt"), tokens - vocab.BYTE_OFFSET
    on1, on2 = (role == rtt) & (index == 0), (role == rtt) & (index == 1)
    code = _so_far(jnp.where(on1, b << 8, 0) + jnp.where(on2, b, 0), first)
    replied = _so_far(on2.astype(jnp.int32), first) > 0
    h, dst_on, _, _ = dst_hashes(tokens, seg)
    row, ok = _store_row(store, h)
    median = row[..., K // 2].astype(jnp.int32)
    nxt_start = jnp.concatenate([start[:, 1:] | (seg[:, 1:] != seg[:, :-1]),
                                 jnp.ones_like(start[:, :1])], axis=1)
    last = nxt_start & (seg > 0)
    lr = jnp.log2(_code_value(code)) - jnp.log2(_code_value(median))
    return start, last, h, dst_on, replied & dst_on & ok, lr


def probe_shift(store: jax.Array, tokens: jax.Array, segment_ids: jax.Array, shrink: float,
                probes=None):
    """(shift float32[B, T], p_shift [B, M] or None): at each token, the probe's factor as
    its context says it, in octaves: over the earlier measurements of its segment that
    have a reply and a destination with its own row in ``store`` (the destination store),
    the sum of log2(reply / the row's median quantile), divided by their count plus
    ``shrink`` (no such measurement: 0). A measurement counts from its last token on, so
    its own reply never moves its own answer. For probes: their anchor's."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    _, last, _, _, seen, lr = _reply_ratios(store, tokens, seg)
    count = last & seen
    lr = jnp.where(count, lr, 0.0)
    idx = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    # sums over the segment's tokens up to each one (the segment's start: position 0)
    seg_first = jax.lax.cummax(jnp.where(positions(seg) == 0, idx, 0), axis=1)
    s, n = (_so_far(x, seg_first) for x in (lr, count.astype(jnp.float32)))
    shift = jnp.where(seg > 0, s / (n + shrink), 0.0)
    if probes is None:
        return shift, None
    return shift, jnp.take_along_axis(shift, probes[1].astype(jnp.int32), axis=1)


def cov_key(a, b):
    """The key of the unordered destination pair {a, b} (hashes, numpy or jax int32): the
    ordered pair's key, the smaller hash first."""
    xp = jnp if isinstance(a, jax.Array) or isinstance(b, jax.Array) else np
    return pair_key(xp.minimum(a, b), xp.maximum(a, b))


def _cov_lookup(table: jax.Array, key: jax.Array) -> jax.Array:
    """float32[...]: the covariance key's row of the kriging store holds (``store_rows``;
    the row whose check is the key's), 0 where neither is."""
    r1, r2 = (table[i] for i in store_rows(key, table.shape[0]))
    c = store_check(key)
    return jnp.where(r1[..., 1] == c, r1[..., 0], jnp.where(r2[..., 1] == c, r2[..., 0], 0.0))


def kriged_shift(store: jax.Array, cov: jax.Array, noise: jax.Array, tokens: jax.Array,
                 segment_ids: jax.Array, probes=None):
    """(shift float32[B, T], p_shift [B, M] or None) as ``probe_shift``'s, from the
    destinations' covariance instead of one factor (ModelConfig.krig_store; the
    context_krig baseline's rule, train.eval.context_baselines): a measurement's earlier
    replies in its segment, to destinations with a row in ``store``, give their log2 ratios
    to those rows' medians; the shift is the mean of the measurement's own destination's
    ratio given them, for a Gaussian over destinations with the covariances of ``cov``
    (train.model.store.build_krig, keyed by ``cov_key``; 0 where a pair has none) and a
    reply's ``noise`` variance. The measurements of a row are its first T // 12 + 1 (none
    is shorter than 12 tokens)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    B, T = tokens.shape
    Mx = T // 12 + 1
    start, last, h, dst_on, seen, lr = _reply_ratios(store, tokens, seg)
    meas = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1  # the measurement's number, -1 before
    last = last & (meas >= 0)  # a measurement's last token: its whole
    slot = jnp.where(last, meas, Mx)  # out of range: dropped
    rows = jnp.arange(B)[:, None]
    put = lambda x, fill: jnp.full((B, Mx), fill, x.dtype).at[rows, slot].set(x, mode="drop")
    m_h, m_seg = put(h, 0), put(seg, 0)
    m_has = put(dst_on, False)  # a destination named whole
    m_ok = put(seen, False)  # and a reply and a store row: observed
    m_r = jnp.where(m_ok, put(lr, 0.0), 0.0)
    C = jnp.where(m_has[:, :, None] & m_has[:, None, :],
                  _cov_lookup(cov, cov_key(m_h[:, :, None], m_h[:, None, :])), 0.0)
    i, j = jnp.arange(Mx)[:, None], jnp.arange(Mx)[None, :]
    obs = (j < i) & m_ok[:, None, :] & (m_seg[:, None, :] == m_seg[:, :, None])  # [B, i, j]
    both = obs[..., :, None] & obs[..., None, :]
    eye = jnp.eye(Mx, dtype=jnp.float32)
    A = jnp.where(both, C[:, None] + noise * eye, eye)  # [B, i, j, k]; 1 on the unobserved
    w = jnp.linalg.solve(A, jnp.where(obs, m_r[:, None, :], 0.0)[..., None])[..., 0]
    m_shift = jnp.sum(jnp.where(obs, C * w, 0.0), axis=-1)  # [B, i]
    at = jnp.take_along_axis(m_shift, jnp.clip(meas, 0, Mx - 1), axis=1)
    shift = jnp.where((seg > 0) & (meas >= 0) & (meas < Mx), at, 0.0)
    if probes is None:
        return shift, None
    return shift, jnp.take_along_axis(shift, probes[1].astype(jnp.int32), axis=1)


def _byte_counts(b: jax.Array, where: jax.Array | None = None) -> jax.Array:
    """float32[..., 256]: how many of the last axis' byte values ``b`` [..., K] (where
    ``where``) are each value: a scatter-add of K ones a position, not a one-hot of
    [..., K, 256] summed (docs/measurements.md: ``store_dists`` 25x quicker on a CPU, the
    same counts)."""
    lead, k = b.shape[:-1], b.shape[-1]
    n = int(np.prod(lead))
    at = (jnp.arange(n, dtype=jnp.int32)[:, None] * 256 + b.reshape(n, k)).reshape(-1)
    ones = jnp.ones(n * k, jnp.float32) if where is None else where.reshape(-1).astype(
        jnp.float32)
    return jnp.zeros(n * 256, jnp.float32).at[at].add(ones).reshape(*lead, 256)


def store_dists(store: jax.Array, tokens: jax.Array, segment_ids: jax.Array, probes=None,
                widths=(1.0, 1.0), keys=None, shift=None, min_count: int = arch.STORE_MIN):
    """((dist float32[B, T, 256], on bool[B, T]), (p_dist, p_on) or None): at each token
    whose next one is an RTT byte, the distribution of that byte over the STORE_K quantiles
    of the measurement's destination's train-split RTTs (ModelConfig.dst_store; the table
    from train.model.store: codes, count, check; a key's row is the first of its two rows,
    ``store_rows``, whose check is its), each spread by a Laplace kernel of
    ``widths`` (first byte, second) byte values; for the second byte, over the quantiles
    whose first byte is the one written. ``on``: such a token whose destination is whole,
    has its own row (the check matches) and at least ``min_count`` replies there, and (second
    byte) one such quantile. With ``probes``, the same for them (a probe that is a first
    RTT byte asks for the second). ``keys``: (key, on, p_key, p_on) to look rows up by
    instead of the destination's hash (``dst_hashes``): the pair store's
    ``pair_keys``. ``shift``: ``probe_shift``'s (shift, p_shift): every quantile
    times 2^shift first (the placed store)."""
    K = arch.STORE_K
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    role, index, last = grammar(tokens, seg)
    h, on, p_h, p_on = dst_hashes(tokens, seg, probes) if keys is None else keys
    rtt = vocab.ROLES.index("rtt")
    lo = vocab.BYTE_OFFSET
    kern = [_byte_kernel(jnp.arange(256), w) for w in widths]  # [256, 256]: row v spread

    def dists(h, on, tok, first, second, octaves):
        r, ok = _store_row(store, h, min_count)  # [B, T, K + 2]
        ok = on & ok
        code = r[..., :K].astype(jnp.int32)
        if octaves is not None:  # (no shift: the codes as stored)
            code = jnp.where(octaves[..., None] == 0, code,
                             _value_code(_code_value(code) * jnp.exp2(octaves)[..., None]))
        b1, b2 = code >> 8, code & 255
        d1 = _byte_counts(b1) / K @ kern[0]
        hit = b1 == (tok - lo)[..., None]  # [B, T, K]: quantiles with the written first byte
        n = hit.sum(-1)
        d2 = _byte_counts(b2, hit) / jnp.maximum(n, 1)[..., None] @ kern[1]
        dist = jnp.where(first[..., None], d1, d2)
        return dist, ok & (first | (second & (n > 0)))

    shift, p_shift = (None, None) if shift is None else shift
    out = dists(h, on, tokens, tokens == vocab.RTT_START, (role == rtt) & (index == 0), shift)
    if probes is None:
        return out, None
    p_tok, p_prev = (x.astype(jnp.int32) for x in probes)
    p_role, p_index = _probe_grammar(tokens, seg, last, p_tok, p_prev)
    return out, dists(p_h, p_on, p_tok, p_tok == vocab.RTT_START,
                      (p_role == rtt) & (p_index == 0), p_shift)


# an odd multiplier per (what, index) for the source anonymization's mix
_ANON_MULT = (np.random.default_rng(54321).integers(1 << 20, 1 << 30, 4) | 1).astype(np.int32)


def anonymize_sources(tokens: jax.Array, segment_ids: jax.Array, step: jax.Array) -> jax.Array:
    """tokens with every source address byte moved by an offset that depends on the
    address, its byte index, its context (row and segment) and ``step``: within a context
    one address stays one address (a probe keeps copying its own), but what it is is
    random, and new at each step (ModelConfig.anonymize_src). Bytes stay bytes; nothing
    else changes."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    role, index, _ = grammar(tokens, seg)
    _, full, _ = address_hashes(tokens, seg, "src")
    B, T = tokens.shape
    row = jnp.arange(B, dtype=jnp.int32)[:, None]
    m = jnp.asarray(_ANON_MULT)
    x = (full * m[0] + (row * 4096 + seg) * m[1] + jnp.asarray(step, jnp.int32) * m[2]
         + index * m[3]).astype(jnp.uint32)
    x = (x ^ (x >> 15)) * jnp.uint32(2246822519)  # a murmur-style finalizer: all bits mixed
    x = (x ^ (x >> 13)) * jnp.uint32(3266489917)
    offset = (x >> 24).astype(jnp.int32)
    moved = vocab.BYTE_OFFSET + (tokens - vocab.BYTE_OFFSET + offset) % 256
    return jnp.where(role == vocab.ROLES.index("src"), moved, tokens)


def source_fold(tokens: jax.Array, segment_ids: jax.Array, k: int) -> jax.Array:
    """bool[B, T]: the tokens of the contexts (segments) in one fold of ``k``, chosen by a
    mix of their measurements' source address hashes (a context in the fold if any of its
    measurements' sources is: a probe's one address, or its two, IPv4 and IPv6, each
    deciding for the contexts it is in); read from the real addresses, before
    ``anonymize_sources`` (ModelConfig.gate_fold)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    _, full, _ = address_hashes(tokens, seg, "src")
    x = full.astype(jnp.uint32) * jnp.uint32(2654435761)
    x = (x ^ (x >> 16)) * jnp.uint32(2246822519)
    mine = ((x >> 8) % jnp.uint32(k) == 0) & (full != 0) & (seg > 0)
    T = tokens.shape[1]
    per_seg = jax.vmap(lambda m, s: jax.ops.segment_max(m, s, num_segments=T + 1)[s])
    return (per_seg(mine.astype(jnp.int32), seg) > 0) & (seg > 0)


def fold_targets(tokens: jax.Array, segment_ids: jax.Array, k: int) -> jax.Array:
    """bool[B, T]: the positions that predict an RTT byte in the contexts of one fold of
    ``k`` (``source_fold``): forward's ``fold`` (ModelConfig.gate_fold). The fold's other
    targets (addresses, times, results) train the model as any context's do; only its
    RTTs are kept from it, which is what it would otherwise know of those probes."""
    rtt = target_roles(tokens, segment_ids) == vocab.ROLES.index("rtt")
    return source_fold(tokens, segment_ids, k) & rtt


# odd multipliers by a token's place in its context (mod their count): context_fold's hash
_CTX_MULT = (np.random.default_rng(24680).integers(1 << 20, 1 << 30, 64) | 1).astype(np.int32)


def context_fold(tokens: jax.Array, segment_ids: jax.Array, k: int) -> jax.Array:
    """bool[B, T]: the tokens of the contexts (segments) in one fold of ``k``, chosen by a
    hash of each context's whole token sequence, so that one context decides alike in any
    row or place, and a probe's contexts fall in it one by one (unlike ``source_fold``,
    whose fold holds whole probes); read from the real tokens, before
    ``anonymize_sources`` (ModelConfig.pair_forward)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    m = jnp.asarray(_CTX_MULT)[positions(seg) % len(_CTX_MULT)]
    T = tokens.shape[1]
    per_seg = jax.vmap(lambda x, s: jax.ops.segment_sum(x, s, num_segments=T + 1)[s])
    x = per_seg(jnp.where(seg > 0, (tokens + 1) * m, 0), seg).astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(2654435761)
    x = (x ^ (x >> 13)) * jnp.uint32(3266489917)
    return ((x >> 8) % jnp.uint32(k) == 0) & (seg > 0)


def pair_fold_targets(tokens: jax.Array, segment_ids: jax.Array, k: int) -> jax.Array:
    """bool[B, T]: the positions that predict an RTT byte or a result header in the
    contexts of one fold of ``k`` (``context_fold``): forward's ``pair_fold``
    (ModelConfig.pair_forward), where the own pair's store is read in training (its
    quantiles at the RTT bytes, its failures at the result, ModelConfig.pair_fail) and its
    gates learn."""
    role = target_roles(tokens, segment_ids)
    want = (role == vocab.ROLES.index("rtt")) | (role == vocab.ROLES.index("result"))
    return context_fold(tokens, segment_ids, k) & want


def same_destination(tokens: jax.Array, segment_ids: jax.Array, probes=None):
    """bool[B, 1, T, T]: key s is in an earlier measurement of the row than query t, and that
    measurement's destination is the one t's measurement has named up to t (none before
    its destination block: then no key matches); with ``probes`` (forward's), also
    bool[B, 1, M, T] for them. Nothing of a later token is read: a key's measurement lies
    wholly before the query's, and in the same segment."""
    so_far, full, meas = address_hashes(tokens, segment_ids, "dst")

    def rule(q_so_far, q_meas):
        return ((q_so_far[:, :, None] != 0) & (full[:, None, :] == q_so_far[:, :, None])
                & (meas[:, None, :] < q_meas[:, :, None]))[:, None]

    seg = segment_ids.astype(jnp.int32)
    same_seg = (seg[:, :, None] == seg[:, None, :])[:, None]
    if probes is None:
        return rule(so_far, meas) & same_seg, None
    tokens = tokens.astype(jnp.int32)
    p_tok, p_prev = (x.astype(jnp.int32) for x in probes)
    p_start = p_tok == vocab.MEASUREMENT_START
    p_meas = jnp.take_along_axis(meas, p_prev, axis=1) + p_start
    p_role, p_index = _probe_grammar(tokens, seg, grammar(tokens, seg)[2], p_tok, p_prev)
    p_so_far = (jnp.where(p_start, 0, jnp.take_along_axis(so_far, p_prev, axis=1))
                + _addr_part(p_tok, p_role, p_index, "dst"))
    p_seg = jnp.take_along_axis(seg, p_prev, axis=1)
    return (rule(so_far, meas) & same_seg,
            rule(p_so_far, p_meas) & (p_seg[:, :, None] == seg[:, None, :])[:, None])


def byte_waves(n: int) -> np.ndarray:
    """float32[256, 2n]: cos and sin of 2 pi v / P for byte values v, periods P = 512, 256,
    ... (n of them, halving); the first is monotone over 0..255."""
    v = np.arange(256, dtype=np.float64)[:, None]
    ang = 2 * np.pi * v / (512.0 / 2.0 ** np.arange(n))[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def tables(params: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The embedding [V, D] and output head [D, V] the forward pass uses: the parameters'
    tables, plus, with ``cfg.byte_features``, the learned mix of byte waves on the byte rows
    (ModelConfig.byte_features)."""
    if not cfg.byte_features:
        return params["embed"], params["head"]
    w = jnp.asarray(byte_waves(cfg.byte_features))  # [256, 2K]
    lo, hi = vocab.BYTE_OFFSET, vocab.BYTE_OFFSET + 256
    embed = jnp.asarray(params["embed"]).at[lo:hi].add(w @ params["wave_in"])
    head = jnp.asarray(params["head"]).at[:, lo:hi].add(params["wave_out"] @ w.T)
    return embed, head


def _role_tables() -> tuple[np.ndarray, np.ndarray]:
    """By token id: the role (prep.schema.vocab.ROLES) of the token itself where it is a header or
    marker, and of a byte that follows it as its block's header; as prep.tokens.rowdecode assigns them."""
    roles = {name: k for k, name in enumerate(vocab.ROLES)}
    own = np.zeros(vocab.VOCAB_SIZE, np.int32)
    byte_of = np.zeros(vocab.VOCAB_SIZE, np.int32)
    by_block = {vocab.BLOCK_SRC: "src", vocab.BLOCK_DST: "dst", vocab.BLOCK_TIME: "timestamp",
                vocab.BLOCK_RESULT: "rtt"}
    by_block.update({vocab.BLOCK_VALUE + k: f.name for k, f in enumerate(vocab.VALUE_FIELDS)})
    for t in range(vocab.VOCAB_SIZE):
        if vocab.BYTE_OFFSET <= t < vocab.BYTE_OFFSET + 256:
            continue
        own[t] = roles["result"] if t in (vocab.RTT_START, vocab.FAILED) else roles["marker"]
        if vocab.BLOCK_OF[t] >= 0:
            byte_of[t] = roles[by_block[int(vocab.BLOCK_OF[t])]]
    return own, byte_of


ROLE_OWN, ROLE_BYTE_OF = _role_tables()


def _is_byte(tokens):
    return (tokens >= vocab.BYTE_OFFSET) & (tokens < vocab.BYTE_OFFSET + 256)


def grammar(tokens: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(role int32[B, T], byte index int32[B, T], last header int32[B, T]) of every token,
    read from the tokens before it on the device (no grammar check): a byte takes the role
    of the last header before it (prep.tokens.rowdecode.token_roles gives the same roles) and its
    index in that header's block; a header or marker has its own role and index
    ``arch.N_INDEX - 1``. Padding, and a byte with no header before it, have role 0."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    T = tokens.shape[-1]
    idx = jnp.arange(T, dtype=jnp.int32)
    is_byte = _is_byte(tokens)
    last = jax.lax.cummax(jnp.where(is_byte, -1, idx), axis=1)
    header = jnp.take_along_axis(tokens, jnp.maximum(last, 0), axis=1)
    role = jnp.where(is_byte, jnp.asarray(ROLE_BYTE_OF)[header], jnp.asarray(ROLE_OWN)[tokens])
    role = jnp.where((seg > 0) & (~is_byte | (last >= 0)), role, 0)
    index = jnp.where(is_byte, jnp.clip(idx - last - 1, 0, arch.N_INDEX - 2), arch.N_INDEX - 1)
    return role, index, last


def token_roles(tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """int32[B, T]: the role (index into prep.schema.vocab.ROLES) of every token, 0 on padding."""
    return grammar(tokens, segment_ids)[0]


def target_roles(tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """int32[B, T]: the role of the token each position predicts (t + 1), 0 at the last."""
    r = token_roles(tokens, segment_ids)
    return jnp.concatenate([r[:, 1:], jnp.zeros_like(r[:, :1])], axis=1)


def _probe_grammar(tokens, seg, last, p_tok, p_prev):
    """(role, index) of probe tokens standing right after row position p_prev."""
    p_tok = p_tok.astype(jnp.int32)
    prev_tok = jnp.take_along_axis(tokens.astype(jnp.int32), p_prev, axis=1)
    prev_last = jnp.take_along_axis(last, p_prev, axis=1)
    hdr_pos = jnp.where(_is_byte(prev_tok), prev_last, p_prev)
    header = jnp.take_along_axis(tokens.astype(jnp.int32), jnp.maximum(hdr_pos, 0), axis=1)
    byte = _is_byte(p_tok)
    role = jnp.where(byte, jnp.where(hdr_pos >= 0, jnp.asarray(ROLE_BYTE_OF)[header], 0),
                     jnp.asarray(ROLE_OWN)[p_tok])
    index = jnp.where(byte, jnp.clip(p_prev - hdr_pos, 0, arch.N_INDEX - 2), arch.N_INDEX - 1)
    return role, index


N_ROLES = len(vocab.ROLES) + 1  # prep.schema.vocab.ROLES (7, then one per value field), one spare


def loss_by_role(params: dict, tokens: jax.Array, segment_ids: jax.Array, cfg: ModelConfig,
                 attention: attn.AttentionConfig = attn.AttentionConfig(), *,
                 copied_src: bool = False, src_hash: jax.Array | None = None,
                 fold: jax.Array | None = None, pair_fold: jax.Array | None = None):
    """(cross-entropy sum, right-guess count, target count), each float32[N_ROLES] by the
    role of the token each position predicts (``target_roles``): the one place the loss is
    split by role, for the training objective (``loss_sum``), the eval during training
    (train.fit.step.eval_step) and `train eval` (train.eval.evaluate).

    ``copied_src``: also the same three sums (float32[1] each) over the source bytes of every
    measurement after its context's first, which mostly repeat an address already in the
    context (a probe's source), and three more over those of them whose address does stand
    in an earlier measurement of the context (a dual-stack probe's first IPv6 source after
    IPv4 ones does not): how well the model copies, and what it could copy."""
    tokens, segment_ids = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    ce, logits, targets, mask = token_losses(params, tokens, segment_ids, cfg, attention,
                                             src_hash=src_hash, fold=fold,
                                             pair_fold=pair_fold)
    by_role = _by_role(tokens, segment_ids)
    right = (jnp.argmax(logits, axis=-1) == targets) & mask
    sums = (by_role(jnp.where(mask, ce, 0.0)), by_role(right), by_role(mask))
    if not copied_src:
        return sums
    # the target t + 1 is a source byte and lies past the segment's first measurement
    later = measurement_index(tokens, segment_ids) >= 1
    later = jnp.concatenate([later[:, 1:], jnp.zeros_like(later[:, :1])], axis=1)
    sel = mask & later & (target_roles(tokens, segment_ids) == vocab.ROLES.index("src"))
    _, full, meas = address_hashes(tokens, segment_ids, "src")
    seen = ((full[:, :, None] == full[:, None, :]) & (meas[:, None, :] < meas[:, :, None])
            & (segment_ids[:, :, None] == segment_ids[:, None, :])).any(-1)
    seen = jnp.concatenate([seen[:, 1:], jnp.zeros_like(seen[:, :1])], axis=1)
    copied = tuple(jnp.where(c, x, 0).astype(jnp.float32).sum()[None]
                   for c in (sel, sel & seen) for x in (ce, right, c))
    return sums + copied


def _by_role(tokens: jax.Array, segment_ids: jax.Array):
    """x [B, T] -> float32[N_ROLES]: its sums by the role of the token each position predicts."""
    roles = target_roles(tokens, segment_ids).ravel()
    return lambda x: jax.ops.segment_sum(x.astype(jnp.float32).ravel(), roles, N_ROLES)


def measurement_index(tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """int32[B, T]: each token's measurement within its segment (0 for the first, which starts
    at the segment's first token); -1 on padding."""
    meas = jnp.cumsum((tokens == vocab.MEASUREMENT_START) & (segment_ids > 0), axis=1,
                      dtype=jnp.int32)  # numbered along the row
    first = jax.lax.cummax(jnp.where(positions(segment_ids) == 0, meas, 0), axis=1)
    return jnp.where(segment_ids > 0, meas - first, -1)


def loss_sum(params: dict, batch: dict, cfg: ModelConfig,
             attention: attn.AttentionConfig = attn.AttentionConfig(),
             role_weights: tuple[float, ...] | None = None):
    """(sum of next-token cross-entropy over counted targets, number of counted targets,
    the training objective). The objective is the mean cross-entropy, or, with
    ``role_weights`` (one weight per prep.schema.vocab.ROLES entry), the mean weighted by the role
    of each target: sum(w * ce) / sum(w)."""
    aux = cfg.copy_aux if cfg.context_copy or cfg.dst_store or cfg.pair_store else 0.0
    if aux:  # the mixed distribution's loss, and its own's before the copy (copy_aux)
        tokens, seg = (batch[k].astype(jnp.int32) for k in ("tokens", "segment_ids"))
        ce, own_ce, mask = token_losses(params, tokens, seg, cfg, attention, own=True,
                                        src_hash=batch.get("src_hash"), fold=batch.get("fold"),
                                        pair_fold=batch.get("pair_fold"))
        by_role = _by_role(tokens, seg)
        loss, count = by_role(jnp.where(mask, ce, 0.0)), by_role(mask)
        extra = aux * by_role(jnp.where(mask, own_ce, 0.0))
    else:
        loss, _, count = loss_by_role(params, batch["tokens"], batch["segment_ids"], cfg,
                                      attention, src_hash=batch.get("src_hash"),
                                      fold=batch.get("fold"), pair_fold=batch.get("pair_fold"))
        extra = 0.0
    total, n = loss.sum(), count.sum()
    if role_weights is None:
        return total, n, (total + jnp.sum(extra)) / jnp.maximum(n, 1)
    w = jnp.zeros(N_ROLES, jnp.float32).at[:len(role_weights)].set(
        jnp.asarray(role_weights, jnp.float32))
    return total, n, (w * (loss + extra)).sum() / jnp.maximum((w * count).sum(), 1e-9)


def token_losses(params: dict, tokens: jax.Array, segment_ids: jax.Array, cfg: ModelConfig,
                 attention: attn.AttentionConfig = attn.AttentionConfig(), *, own: bool = False,
                 src_hash: jax.Array | None = None, fold: jax.Array | None = None,
                 pair_fold: jax.Array | None = None):
    """(next-token cross-entropy, logits, targets, mask) at every position of a batch: the
    loss of training, of the eval during training and of `train eval`; count it where mask.
    ``own``: (cross-entropy, that of the distribution before the stores and the copy, mask).
    ``src_hash``, ``fold``, ``pair_fold``: forward's."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    out = forward(params, tokens, seg, cfg, attention, own=own, src_hash=src_hash, fold=fold,
                  pair_fold=pair_fold)
    targets, mask = targets_and_mask(tokens, seg)
    ce = lambda lg: optax.softmax_cross_entropy_with_integer_labels(lg, targets)
    if own:
        return ce(out[0]), ce(out[1]), mask
    return ce(out), out, targets, mask


# --- FLOPs, for MFU ----------------------------------------------------------------------

def flop_counts(segment_ids: jax.Array) -> dict:
    """What a batch's FLOPs scale with (``train_flops`` takes them): its real tokens, and
    the attention context they see (sum of position + 1)."""
    seg = segment_ids.astype(jnp.int32)
    real = seg > 0
    ctx = jnp.where(real, positions(seg) + 1, 0)
    return {"tokens": real.sum(), "attn_ctx": ctx.astype(jnp.float32).sum()}


def matmul_params(cfg: ModelConfig) -> int:
    """N in 6N: every parameter but the embedding table, whose use is a lookup, not a matmul."""
    specs = arch.param_specs(cfg)
    return arch.n_params(cfg) - sum(math.prod(p.shape) for k, p in specs.items()
                                    if k.endswith("embed"))


def train_flops(cfg: ModelConfig, tokens: float, attn_ctx: float) -> float:
    """Training FLOPs (forward + backward) over ``tokens`` real tokens that see ``attn_ctx``
    keys in all (``flop_counts``): 6N per token, plus attention.

    Attention per layer: QK^T and AV are 2 * d_attn * ctx each for a token seeing ctx
    keys, times 3 for forward + backward. Counted over the keys each token really sees
    (its position + 1, inside its own context), which is what the cuDNN kernel computes.
    """
    d_attn = cfg.n_heads * cfg.head_dim
    return 6.0 * matmul_params(cfg) * tokens + 12.0 * cfg.n_layers * d_attn * attn_ctx
