"""What the model is, without JAX: its shape, the named shapes, its parameters.

- ``ModelConfig``: the transformer's shape (frozen: a jit static argument).
- ``MODELS``: the named shapes; ``train --model`` offers exactly these.
- ``param_specs``: every parameter's shape, initialization and whether AdamW's weight decay
  applies to it. ``decay_mask`` reads the last straight from that structure, and
  ``n_params`` the count.

train.model.model is the math over these (initialization, the forward pass, the loss, the FLOP
count); they live here, apart, so that ``train --help`` lists the models without
importing JAX.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from prep.schema import vocab


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    d_model: int
    n_heads: int
    head_dim: int
    d_mlp: int
    seq_len: int = 1024  # the shards' row_len; set from the manifest at run time
    vocab_size: int = vocab.VOCAB_SIZE
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6
    remat: bool = False  # recompute each layer in the backward pass (less memory, ~30% more FLOPs)
    # the layers as one jax.lax.scan over stacked weights (compiles once, whatever the depth)
    # or unrolled (each layer its own code: what a layer keeps for the backward pass is its
    # own buffer, not a slice copied into and out of a stack; docs/measurements.md)
    scan_layers: bool = True
    # add an embedding of each token's role (prep.schema.vocab.ROLES) and byte index in its block,
    # computed from the tokens before it (train.model.model.grammar): the parse a layer would
    # otherwise have to learn before any field can be matched or copied
    grammar_embed: bool = False
    # std of the initial weights (GPT-2's 0.02; residual projections / sqrt(2 n_layers)).
    # Narrow models learn to copy much sooner from a larger one (tests/test_copy.py)
    init_std: float = 0.02
    # smooth functions of a byte's value: the embedding of BYTE_v, and the head's logit for
    # it, each gain a learned mix of 2 * byte_features fixed waves of v (periods 512, 256,
    # ..., ``byte_waves``), so "an RTT byte near the earlier one" is a few parameters, not a
    # relation among 256 unrelated symbols learned one pair at a time. 0: off. The function
    # class is unchanged (the tables could hold it); only what is cheap to learn changes.
    byte_features: int = 0
    # head 0 of every layer gets this bias (times a learned gain per layer, starting at 1)
    # on keys of earlier measurements whose destination is the one the query's measurement
    # has named so far (train.model.model.same_destination): "the earlier pings to this
    # destination" is given, as the grammar is; the head learns what to read there. 0: off.
    # The cuDNN kernel takes no bias: `--attention cudnn` runs head 0 on the XLA attention and
    # the other heads on the packed kernel (train.model.attention.attention); `--attention
    # dense` (auto on a GPU) runs every head on cuDNN's dense kernel, which takes the bias.
    match_dst: float = 0.0
    # a learned memory of destinations: a table of this many rows (a power of two; 0: off),
    # one row per destination address, hashed on the device from its bytes
    # (train.model.model.dst_memory_rows), added to every token of a measurement from the
    # one that completes its destination on. What a destination costs is then one row to
    # learn, not a function of 4 or 16 bytes through the layers, and it is there whatever
    # the context holds (docs/learning.md section 8)
    dst_memory: int = 0
    # a destination prior in the output: a second table (dst_memory rows of PRIOR_DIM)
    # whose row, through a learned map to the vocabulary, is added to the logits of the
    # tokens where the memory is on, gated per token by a sigmoid of the final residual, so
    # the layers can turn it down where the context says more. Its rows are this many times
    # their parameters, which start this many times smaller: Adam moves a parameter by
    # about lr a step whatever its scale, so a row learns this many times faster, which a
    # row needs, visited only when its destination is in the batch. (Scaling the residual
    # memory so instead displaced the context-reading circuits: docs/learning.md section 8.)
    # 0: off
    dst_prior_scale: float = 0.0
    # whether that prior moves the result's split (FAILED against RTT_START). False: its
    # map's two columns are zeroed, so a destination's row learns its RTTs, not the train
    # split's failure share, which in a world of per-pair failure rates (prep synth's)
    # does not carry to a new probe (docs/learning.md section 8.30)
    dst_prior_result: bool = True
    # training only: each context's source addresses replaced by random ones (the same
    # address the same within a context; train.model.model.anonymize_sources), so nothing
    # the model learns about a training probe's address can carry a prediction: the test
    # probes are unseen
    anonymize_src: bool = False
    # a copy of the context in the output (a pointer-generator's, over values): where an RTT
    # byte is next and the row holds earlier replies to the measurement's destination, the
    # model's distribution is mixed, by a learned gate on the final residual, with the
    # distribution of those replies' byte weighted as an EMA of this alpha would weigh
    # them (the second byte: among the replies whose first byte is the one written;
    # train.model.model.context_copy). The context_ema baseline is one setting of the gate
    # away. 0: off
    context_copy: float = 0.0
    # with context_copy (or dst_store): the training objective also counts, this many times,
    # the loss of the model's own distribution before the copy (and the store) is mixed in,
    # so that what it knows alone (a destination's cost, where no reply is in the context)
    # keeps learning where the copy answers (docs/learning.md section 8.6). 0: off
    copy_aux: float = 0.0
    # a store of the train split's replies by destination, read as the copy reads the
    # context (a retrieval memory, as kNN-LM's datastore): a table of this many rows (a
    # power of two; 0: off), one per destination address hashed as dst_memory's, holding
    # the STORE_K quantiles of its RTTs in the train split, filled from the train split when
    # a run starts (train.model.store) and not learned. Where an RTT byte is next and the
    # measurement's destination has at least STORE_MIN replies there, the distribution is
    # mixed, by a gate of its own, with those quantiles' byte, spread as the copy's. What
    # dst_median knows of a destination is then the model's too. Only where the context
    # holds no earlier reply to the destination (with context_copy, the copy answers there;
    # docs/learning.md section 8.7)
    dst_store: int = 0
    # with dst_store: a destination's quantiles are over its train sources (each source's
    # median reply once) instead of over its replies, so that a few probes that ping it
    # often do not set what it costs a new one; the placed and kriged stores read it as
    # their center (kriging about the replies' median instead of the sources' loses most of
    # context_krig's edge over dst_median: docs/learning.md section 8.14); on in `small`
    # since five generated worlds pooled put it ahead of the replies' store in `cold`
    # (section 8.15)
    store_by_source: bool = False
    # a store of the train split's replies by ordered address pair, read for a measurement
    # at its reverse pair (its destination's pings to its source: a round trip crosses the
    # same two ends), as dst_store's rows are read: a table of this many rows (a power of
    # two; 0: off), filled when a run starts. A node held out as a source whose pings
    # from others are in the train split (a latency matrix's) is then known pair by pair;
    # where no reverse ping exists (probes to targets), it is off. Only where the context
    # holds no earlier reply to the destination (docs/learning.md section 8.8)
    pair_store: int = 0
    # with pair_store: whether it is read at the reverse pair (above). A run whose train
    # replies never find their reverse pair there turns this off and keeps the forward read
    # (train.fit.loop; its config.json says so)
    pair_reverse: bool = True
    # with pair_store: the store read a second time, at the measurement's own pair (its
    # source's train replies to the destination), mixed in by a gate of its own: a probe
    # known from the train split, asked about a destination its context holds no reply to,
    # is then known pair by pair, as the pair baselines know it. The gate learns on one
    # context in this many (by a hash of the context's tokens: a probe's contexts fall in
    # it one by one, train.model.model.context_fold), and the pair store is built without
    # those contexts (and with the gate fold's probes, unlike the other stores: a test query
    # may ask for their pairs), so a fold context's pair is known from its probe's other
    # contexts, as a test query's is from the train split (docs/learning.md section 8.20).
    # 0: off
    pair_forward: int = 0
    # with pair_store: the fewest train replies a pair's row is read with (both reads). The
    # destination store's STORE_MIN keeps a training measurement from finding itself among
    # its destination's quantiles; the forward read's fold already keeps it out, and a
    # known pair is worth reading from a few replies, as the pair baselines read it from
    # one. 32 (STORE_MIN) where a saved config predates it
    pair_min: int = 32
    # with pair_store: a pair's quantiles are over its latest this many train replies (by
    # their timestamps, or their context's latest where a measurement lost its own; its count
    # stays that of all its replies): RTTs drift, and what a pair answered last says more of
    # what it answers next than all it ever answered (the median of a pair's latest 8
    # replies: 0.026 median relative error on a time split's known probes, against 0.033
    # for all of them; docs/learning.md section 8.21). 0: all
    pair_recent: int = 0
    # with pair_recent and pair_forward (else unread): the latest replies only for the read
    # at the measurement's own pair (a second table of the pair store's rows, pair_latest);
    # the read at the reverse pair keeps quantiles over all of a pair's replies. A reverse
    # pair is another host's pings, read where the probe is not known: on Seattle's
    # latency matrix, whose pairs are noisy frame to frame, the latest 8 there cost the
    # held-out nodes 0.333 -> 0.500 median relative error (docs/learning.md section 8.24).
    # False: both reads take the latest
    pair_recent_own: bool = False
    # with pair_recent: whether a run first checks on its train split that a pair's latest
    # pair_recent replies predict its later ones better than all of them
    # (train.model.store.recency_check: each pair's latest tenth held back), and where they
    # do not, takes all of them (pair_recent 0 in its config.json; a log line gives both
    # errors). A generated world's RTTs drift (0.018 against 0.025 for all), Seattle's
    # scatter about a steady value frame to frame (0.393 against 0.235), where the latest 8
    # lost to the context's last reply on known nodes (docs/learning.md section 8.24).
    # False: pair_recent as set
    pair_recent_check: bool = False
    # with pair_forward: the pair store counts each pair's failed pings too (one more
    # column), and where a measurement's pair is stored (pair_min pings) and its result is
    # still to come, its share of failures moves the model's P(failed) (its split of the
    # mass of FAILED and RTT_START; nothing else) by a gate of its own, learned on the forward
    # read's fold: a known pair that never answers is known to fail, as the pair baselines
    # know it (docs/learning.md section 8.21); not where the source address is one hosts
    # share (a NAT's: several probes' failures; section 8.22). False: off
    pair_fail: bool = False
    # with pair_fail (else unread): a pair's failures are counted over its latest this many pings
    # (replies and failures, timed as pair_recent's), its share (failed + 1/2) / (pings + 1)
    # over them. Chosen (16) where a NAT address's failures were still read, whose latest
    # pings beat all of them; with those left out (pair_fail) it acts on global sources
    # alone, where the study found it neutral (docs/learning.md section 8.22). 0: all
    pair_fail_recent: int = 0
    # with pair_store: the pairs whose source address hosts share (a NAT's private address:
    # train.model.store.local_scope) are stored as any other. False: not stored at all, as
    # the evaluation never counts such an address a known node. Stored, a probe held out
    # behind a NAT read the RTTs of other probes behind other NATs as its own pair's, and
    # `cold` lost to kriging on every generated world (docs/learning.md section 8.23)
    pair_shared: bool = True
    # with pair_shared False: a run stores such pairs after all (pair_shared True in its
    # config.json) where its data set is split by time alone (`prep shards --split time`),
    # whose test probes are its train probes: there a NAT address's pair holds the probe's
    # own history among other probes' behind the address, and leaving it out lost `cold` to
    # the pair's last reply (docs/learning.md sections 8.23, 8.25); a log line says so.
    # Split by probe (the default) or time+probe, the test probes are held out and it stays
    # False. False: pair_shared as set
    pair_shared_by_split: bool = False
    # with pair_shared and pair_fail (else unread): the failures of a NAT address's pairs
    # are counted and read as any other's, not -1 (train.model.store.build's shared_fails).
    # Where the test probes are held out they are strangers' (docs/learning.md section
    # 8.22); where they are the train probes, their own (section 8.25: a time split's `cold`
    # Brier from a loss to a win). pair_shared_by_split sets it with pair_shared. False: -1
    pair_shared_fail: bool = False
    # the failures among a measurement's earlier pings to its destination in the row (the
    # pings the destination-match head finds, same_destination): where there is one, the
    # model's P(failed) (its split of FAILED and RTT_START's mass) is taken as a beta prior
    # of this many pseudo-pings (times exp(a gate's logit from the final residual)) and
    # updated by them: (failed + s P) / (pings + s). A pair's own failure rate is what 2
    # layers read weakly, or not at all: without it, one seed's model gave a pair that had
    # failed on all of 4-7 earlier pings 0.24 (0.92 failed), one that never had in 8-15
    # 0.15 (0.05 failed), and both seeds lost to the context's shares shrunk so
    # (docs/learning.md section 8.29). 0: off
    context_fail: float = 0.0
    # with context_fail: the pair may be dead (a firewalled target, a broken family: it
    # fails on nearly every ping) or live (failing at a rate of its own): a prior
    # P(dead) = sigmoid(a gate's logit - 2) and a dead pair's rate sigmoid(a logit + 3),
    # both learned, weighed against the counts by their likelihoods (the live one's the
    # beta-binomial of context_fail's prior): P(failed) = w q + (1 - w) (failed + s m) /
    # (pings + s), w the posterior P(dead). A beta alone pulls a pair that failed on all
    # of its 3 pings to 0.68 (0.84 failed; docs/learning.md section 8.30)
    context_dead: bool = False
    # with context_fail: where the counts update the model's split, the split is read as a
    # constant (no gradient into the layers there), so the layers learn it where there are
    # no counts: a prior, not a second reading of the counts (the layers' own reading of
    # the pair's failures, counted again by the update, pulled P(failed) up where some of
    # the pair's pings failed and down where none had; docs/learning.md section 8.30)
    context_fail_detach: bool = False
    # with context_fail: P(failed) before a result is no longer the layers' split updated by
    # the counts but the context baselines' rule on the row's own counts (train.eval's
    # FailPrior: the pair dead or live, its live beta of context_fail pseudo-pings; where
    # the context has no ping to the destination, the context's share of failures shrunk
    # toward a rate), its six constants learned (starting where they fit the train rows'
    # counts best: train.model.failprior.anchor_start, at a run's start), plus a logit
    # that a gate reads from the final residual (0 at the start): the model starts at the
    # baselines' answer and learns what the layers add to it. The layers' split counted a
    # pair's failures a second time under the update (docs/learning.md section 8.30)
    context_fail_anchor: bool = False
    # with context_fail_anchor and dst_store: the rule's rate, P(dead) and live rate each the
    # destination's where the destination store has its row: their logits moved by the
    # destination's offsets from its train pairs (train.model.failprior.dst_offsets, a table
    # beside the store's rows filled at a run's start: train.model.store.fail_offsets), as
    # the context baselines' rule moves them. A firewalled target fails on most pairs; a
    # root server on few (docs/learning.md section 8.32)
    fail_dst: bool = False
    # with context_fail_anchor: the rule's constants kept as the run's start fit them (data,
    # not learned) and the gate's logit only where the pair has a ping in the context: what
    # the gate and the drifting constants added where it has none was noise uncorrelated
    # with the rule's miss, on held-out probes (docs/learning.md section 8.33)
    fail_anchor_fixed: bool = False
    # with context_fail_anchor: where every earlier ping of the measurement's address family
    # in its context failed, the family broken at the probe (every ping of it fails, as IPv6
    # without a route) weighed against those pings failing each on its own, as the context
    # baselines' rule weighs it (train.model.failprior.broken_shares; the chain of the
    # anchor's own P(failed) at them, read as a constant; a prior per family, data, fit on
    # the train rows when a run starts: docs/learning.md section 8.34)
    fail_broken: bool = False
    # with dst_store: the store read a second time, its quantiles moved by the probe's
    # factor as the context says it (the sum of the log ratios of the context's earlier
    # replies to their destinations' store medians, over their count plus this shrink;
    # train.model.model.probe_shift), mixed in by a gate of its own where the store is: a
    # new probe placed from its replies to other targets (docs/learning.md section 8.12).
    # 0: off
    placed_store: float = 0.0
    # with dst_store: the store read once more, its quantiles moved by what the context's
    # earlier replies say of the query's destination through the destinations' covariance
    # over the train split's sources (kriging; train.model.model.kriged_shift, the
    # context_krig baseline's rule), mixed in by a gate of its own: a table of this many
    # rows (a power of two) of destination pairs, filled when a run starts. 0: off
    krig_store: int = 0
    # training only, with dst_store or pair_store: the RTTs of one training context in this
    # many (by its source address's hash, train.model.model.fold_targets) train nothing but
    # the stores' gates, and those gates learn from nothing else. The model never learns
    # those probes' RTTs, so it meets them as it meets the test split's, and the gates learn
    # how far to trust a store where the model does not know the probe: trained on every
    # context, they learned it where the model had memorized the probe, and stayed too
    # closed for new ones (docs/learning.md section 8.9). 0: off
    gate_fold: int = 0
    # with gate_fold: the stores (dst_store, pair_store unless pair_forward, krig_store) are
    # built without the fold's contexts, so that the gates learn on probes the stores have not seen either,
    # as the test split's are (with them in, a fold probe's own replies are among its
    # destinations' quantiles, and the gates learn to trust the stores more than a new
    # probe should: docs/learning.md section 8.17)
    store_without_fold: bool = False

    def __post_init__(self):
        for name in ("dst_memory", "dst_store", "pair_store", "krig_store"):
            n = getattr(self, name)
            if n < 0 or n & (n - 1):
                raise ValueError(f"{name} must be 0 or a power of two, not {n}")
        if self.gate_fold < 0 or self.gate_fold == 1:
            raise ValueError(f"gate_fold must be 0 (off) or at least 2, not {self.gate_fold}")
        if self.pair_forward < 0 or self.pair_forward == 1:
            raise ValueError(f"pair_forward must be 0 (off) or at least 2, not {self.pair_forward}")
        if self.pair_min < 1:
            raise ValueError(f"pair_min must be at least 1, not {self.pair_min}")
        if self.pair_recent < 0:
            raise ValueError(f"pair_recent must be 0 (all replies) or more, not {self.pair_recent}")
        if self.pair_fail_recent < 0:
            raise ValueError(f"pair_fail_recent must be 0 (all pings) or more, not "
                             f"{self.pair_fail_recent}")
        if self.pair_fail and not self.pair_forward:
            raise ValueError("pair_fail's gate learns on pair_forward's fold: set pair_forward")
        if self.pair_forward and not self.pair_store:
            raise ValueError("pair_forward reads the pair store: set pair_store")
        if not self.context_fail >= 0:
            raise ValueError(f"context_fail must be 0 (off) or more, not {self.context_fail}")
        if self.context_dead and not self.context_fail:
            raise ValueError("context_dead weighs context_fail's counts: set context_fail")
        if self.context_fail_anchor and not self.context_fail:
            raise ValueError("context_fail_anchor reads context_fail's counts: set context_fail")
        if self.context_fail_anchor and self.context_dead:
            raise ValueError("context_fail_anchor weighs a dead pair itself: unset context_dead")
        if self.fail_anchor_fixed and not self.context_fail_anchor:
            raise ValueError("fail_anchor_fixed keeps context_fail_anchor's rule: set "
                             "context_fail_anchor")
        if self.fail_broken and not self.context_fail_anchor:
            raise ValueError("fail_broken weighs context_fail_anchor's rule: set "
                             "context_fail_anchor")
        if self.fail_dst and not (self.context_fail_anchor and self.dst_store):
            raise ValueError("fail_dst moves context_fail_anchor's rule by the destination "
                             "store's rows: set context_fail_anchor and dst_store")
        if self.store_without_fold and not self.gate_fold:
            raise ValueError("store_without_fold leaves out the gate fold's contexts: set gate_fold")

    @property
    def own_latest(self) -> bool:
        """Whether the read at the own pair has a table of its own (pair_recent_own, with
        pair_store, pair_forward and pair_recent; unread without them)."""
        return bool(self.pair_recent_own and self.pair_store and self.pair_forward
                    and self.pair_recent)


MODELS = {
    # runs the same code as `base` on a CPU in seconds
    "tiny": ModelConfig(n_layers=2, d_model=64, n_heads=4, head_dim=16, d_mlp=256),
    # the CPU recipe (train.fit.config.SMALL_CPU): tiny's shape, reading the grammar from
    # embeddings, so its 2 layers go to matching fields; larger initial weights, with which
    # copying forms sooner; a head pointed at the earlier pings to the query's destination,
    # and byte values with a sense of nearness, with which it copies an RTT; the train
    # split's replies by destination (each source once), by pair (read at the reverse pair
    # and at its own) and placed by the probe's other replies, each behind a gate that
    # learns where neither the layers nor the stores have seen the probe, or (the own
    # pair's) the context (docs/learning.md)
    "small": ModelConfig(n_layers=2, d_model=64, n_heads=4, head_dim=16, d_mlp=256,
                         grammar_embed=True, init_std=0.08, match_dst=4.0, byte_features=7,
                         dst_memory=8192, dst_prior_scale=30.0, anonymize_src=True,
                         context_copy=0.3, copy_aux=1.0, dst_store=32768, pair_store=65536,
                         store_by_source=True, placed_store=0.25, gate_fold=8,
                         store_without_fold=True, pair_forward=8, pair_min=4, pair_recent=8,
                         pair_recent_own=True, pair_recent_check=True, pair_fail=True,
                         pair_fail_recent=16, pair_shared=False,
                         pair_shared_by_split=True, context_fail=4.0,
                         context_fail_anchor=True, fail_dst=True, dst_prior_result=False),
    # ping-llm's ~95M model (98.6M parameters here, untied output head); its layers
    # unrolled: 1.21x the scan's tokens/s on an H200 (bench/results/gpu-nvidia-h200-unrolled.json)
    "base": ModelConfig(n_layers=20, d_model=640, n_heads=10, head_dim=64, d_mlp=2560,
                        scan_layers=False),
}


# settings a run turns off where its data could not teach them (train.fit.loop's stores:
# no pair with pair_min train replies, no train reply with its reverse pair there, a
# pair's latest replies no better than all of them: pair_recent_check) or on (test probes
# that are train probes: pair_shared_by_split), so that two runs of one preset may differ
# in them by their data alone
SET_BY_DATA = ("pair_store", "pair_reverse", "pair_forward", "pair_fail", "pair_recent",
               "pair_shared", "pair_shared_fail")


def model_config(name: str, *, seq_len: int) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; one of {sorted(MODELS)}")
    return dataclasses.replace(MODELS[name], seq_len=seq_len)


PRIOR_DIM = 16  # width of the destination prior's rows (ModelConfig.dst_prior_scale)
STORE_K = 64  # quantiles of a destination's train-split RTTs in its store row (dst_store)
# a store row is read only with at least this many replies behind it: fewer, and a training
# measurement would find itself among the quantiles it is asked to predict
STORE_MIN = 32

# grammar embedding: one row per byte index a block can hold, and one for headers/markers
N_INDEX = int(vocab.WIDTH_OF.max()) + 1


class Param(NamedTuple):
    """One parameter: its shape, its initialization (normal with this std; 0 means ones)
    and whether AdamW's weight decay pulls it toward 0. ``data``: not learned but filled
    from the train split when a run starts (zeros until then; the model reads it through
    stop_gradient, so Adam never moves it): the destination store."""
    shape: tuple[int, ...]
    std: float
    decay: bool = True
    data: bool = False
    zeros: bool = False  # starts at 0 (learned): the pair store's gate, which draws nothing


def _gain(*shape: int) -> Param:
    """An RMSNorm gain: starts at one and is not decayed (decay toward 0 would fight the
    normalization)."""
    return Param(shape, 0.0, decay=False)


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree (a dict of dicts of ``Param``), layers stacked on a leading axis."""
    L, D, N, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_mlp,
                        cfg.vocab_size)
    std = cfg.init_std
    out_std = std / (2 * L) ** 0.5  # GPT-2: residual projections scaled by depth
    grammar = ({"role_embed": Param((len(vocab.ROLES), D), std),
                "index_embed": Param((N_INDEX, D), std)} if cfg.grammar_embed else {})
    K2 = 2 * cfg.byte_features
    # each wave mix starts as large as one embedding row (about sqrt(K2 / 2) waves' worth)
    w_std = std / max(K2 / 2, 1) ** 0.5
    waves = {"wave_in": Param((K2, D), w_std), "wave_out": Param((D, K2), w_std)} if K2 else {}
    # not decayed: a destination seen rarely keeps what it has learned between its visits
    memory = {"dst_memory": Param((cfg.dst_memory, D), std, decay=False)} if cfg.dst_memory else {}
    if cfg.dst_memory and cfg.dst_prior_scale:
        memory |= {"prior_table": Param((cfg.dst_memory, PRIOR_DIM), std / cfg.dst_prior_scale,
                                        decay=False),
                   "prior_out": Param((PRIOR_DIM, V), std),
                   "prior_gate": Param((D,), std)}
    if cfg.context_copy:  # the copy's gate: a logit from the final residual, bias 1 (0.73)
        memory |= {"copy_gate": Param((D,), std), "copy_bias": Param((), 0.0, decay=False),
                   # the spread of a copied byte: train.model.model.COPY_WIDTH
                   "copy_width": Param((2,), 0.0, decay=False)}
    if cfg.dst_store:  # filled by train.model.store; a gate and spreads of its own, as the copy's
        memory |= {"dst_store": Param((cfg.dst_store, STORE_K + 2), 0.0, decay=False, data=True),
                   "store_gate": Param((D,), std), "store_bias": Param((), 0.0, decay=False),
                   "store_width": Param((2,), 0.0, decay=False)}
    if cfg.dst_store and cfg.placed_store:  # the store moved by the probe's factor
        memory |= {"placed_gate": Param((D,), 0.0, zeros=True),  # no draw, as the pair's
                   "placed_bias": Param((), 0.0, decay=False),
                   "placed_width": Param((2,), 0.0, decay=False)}
    if cfg.dst_store and cfg.krig_store:  # the store moved by the destinations' covariance
        memory |= {"krig_store": Param((cfg.krig_store, 2), 0.0, decay=False, data=True),
                   "krig_noise": Param((1,), 0.0, decay=False, data=True),
                   "krig_gate": Param((D,), 0.0, zeros=True),
                   "krig_bias": Param((), 0.0, decay=False),
                   "krig_width": Param((2,), 0.0, decay=False)}
    if cfg.pair_store:  # the same, for the reverse pair's replies
        memory |= {"pair_store": Param((cfg.pair_store, STORE_K + 2 + int(cfg.pair_fail)), 0.0,
                                       decay=False, data=True),
                   # zeros: the bias opens it at first; and no draw, so the other parameters
                   # start as they do without it
                   "pair_gate": Param((D,), 0.0, zeros=True),
                   "pair_bias": Param((), 0.0, decay=False),
                   "pair_width": Param((2,), 0.0, decay=False)}
    if cfg.pair_store and cfg.pair_forward:  # the same table, read at the measurement's own pair
        if cfg.own_latest:  # its rows, each pair's latest replies' quantiles (not learned)
            memory |= {"pair_latest": Param((cfg.pair_store, STORE_K + 2), 0.0, decay=False,
                                            data=True)}
        memory |= {"fwd_gate": Param((D,), 0.0, zeros=True),
                   "fwd_bias": Param((), 0.0, decay=False),
                   "fwd_width": Param((2,), 0.0, decay=False)}
    if cfg.pair_store and cfg.pair_fail:  # its failure counts, read before a result
        memory |= {"fail_gate": Param((D,), 0.0, zeros=True),
                   "fail_bias": Param((), 0.0, decay=False)}
    if cfg.context_fail and not cfg.context_fail_anchor:  # the prior's strength against
        # the context's own counts: a logit; no draws, so the others start as before
        memory |= {"cfail_gate": Param((D,), 0.0, zeros=True),
                   "cfail_bias": Param((), 0.0, decay=False, zeros=True)}
    if cfg.context_fail_anchor:  # the rule's constants, offsets from FAIL_ANCHOR's
        # (train.model.failprior; a run sets them from its train rows), and the residual's
        # logit on top of it; no draws
        memory |= {"fanchor": Param((6,), 0.0, decay=False, data=cfg.fail_anchor_fixed,
                                    zeros=True),
                   "fanchor_gate": Param((D,), 0.0, zeros=True),
                   "fanchor_bias": Param((), 0.0, decay=False, zeros=True)}
    if cfg.fail_broken:  # P(broken) per family (IPv4, IPv6): fit when a run starts
        memory |= {"fbroken": Param((2,), 0.0, decay=False, data=True, zeros=True)}
    if cfg.fail_dst:  # each destination store row's offsets (train.model.store.fail_offsets)
        memory |= {"fail_dst": Param((cfg.dst_store, 3), 0.0, decay=False, data=True)}
    if cfg.context_dead:  # P(dead)'s logit (a gate) and a dead pair's rate, offsets in the model
        memory |= {"cdead_gate": Param((D,), 0.0, zeros=True),
                   "cdead_bias": Param((), 0.0, decay=False, zeros=True),
                   "cdead_rate": Param((), 0.0, decay=False, zeros=True)}
    return {
        **grammar,
        **waves,
        **memory,
        "embed": Param((V, D), std),
        "layers": {
            "attn_norm": _gain(L, D),
            **({"match_gain": _gain(L)} if cfg.match_dst else {}),
            "wqkv": Param((L, D, 3, N, H), std),
            "wo": Param((L, N, H, D), out_std),
            "mlp_norm": _gain(L, D),
            "w_in": Param((L, D, F), std),
            "w_out": Param((L, F, D), out_std),
        },
        "final_norm": _gain(D),
        "head": Param((D, V), std),
    }


def map_params(fn: Callable[[Param], object], specs: dict) -> dict:
    """``fn`` of every ``Param`` of ``specs``, in the tree's shape. Keys are visited in
    sorted order, as JAX flattens dicts: init_params draws in this order."""
    return {k: map_params(fn, specs[k]) if isinstance(specs[k], dict) else fn(specs[k])
            for k in sorted(specs)}


def _leaves(tree: dict) -> list:
    return [x for k in sorted(tree)
            for x in (_leaves(tree[k]) if isinstance(tree[k], dict) else [tree[k]])]


def n_params(cfg: ModelConfig) -> int:
    """Learned parameters (not the destination store, which is data)."""
    return sum(math.prod(p.shape) for p in _leaves(param_specs(cfg)) if not p.data)


def decay_mask(cfg: ModelConfig) -> dict:
    """The parameter tree of bools: True where weight decay applies (optax's ``mask``)."""
    return map_params(lambda p: p.decay, param_specs(cfg))
