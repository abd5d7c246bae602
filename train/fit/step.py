"""The jitted train and eval steps, data-parallel over a 1-D device mesh, and device peaks.

State is ``{"params", "opt", "step"}``: float32 parameters (cast to the compute dtype at
use, so bf16 math keeps fp32 master weights), the optax AdamW state, and an int step.
The train step is one jitted function with the state donated (updated in place) that
returns device scalars only: the loop fetches them every N steps, never per step.

Data parallelism: the state is replicated and each batch is sharded along its rows over
the "data" axis of a mesh of every device; XLA inserts the gradient all-reduce. The loss
is a mean over all counted targets of the global batch (sum / count), so it does not
depend on how the batch is split.

The model says what it costs and what is decayed (train.model.model.train_flops,
train.model.arch.decay_mask); the attention settings travel as one hashable
train.model.attention.AttentionConfig, which keys the compiled steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from prep.schema.vocab import ROLES
from train.fit.config import TrainConfig
from train.model import arch, model
from train.model.arch import ModelConfig
from train.model.attention import AttentionConfig
from train.model.model import N_ROLES  # noqa: F401  (re-exported: eval_step's length)


def make_mesh(devices=None) -> Mesh:
    return Mesh(np.asarray(devices or jax.devices()), ("data",))


def shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(replicated, batch rows split over "data")."""
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at
    cfg.schedule_steps (or cfg.steps where that is 0), and that final rate after it."""
    span = cfg.schedule_steps or cfg.steps
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup_steps=cfg.warmup, decay_steps=max(span, cfg.warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig, mcfg: ModelConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW with weight decay where the model says (arch.decay_mask)."""
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                                   weight_decay=cfg.weight_decay, mask=arch.decay_mask(mcfg)))


def init_state(mcfg: ModelConfig, opt: optax.GradientTransformation, seed: int,
               sharding: NamedSharding) -> dict:
    params = jax.device_put(model.init_params(mcfg, seed), sharding)
    return {"params": params, "opt": jax.jit(opt.init, out_shardings=sharding)(params),
            "step": jax.device_put(np.int32(0), sharding)}


def role_weights(spec: str) -> tuple[float, ...] | None:
    """``--loss-weights`` "rtt=10,result=10,src=0.5" -> one weight per prep.schema.vocab.ROLES entry
    (unnamed roles 1.0; padding never counts), or None for "" (every target alike)."""
    if not spec.strip():
        return None
    w = dict.fromkeys(ROLES, 1.0)
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in ROLES or name == "padding":
            raise ValueError(f"--loss-weights: {part.strip()!r} is not ROLE=WEIGHT with ROLE one "
                             f"of {', '.join(r for r in ROLES if r != 'padding')}")
        try:
            w[name] = float(value)
        except ValueError:
            raise ValueError(f"--loss-weights: {value.strip()!r} in {part.strip()!r} is not a "
                             "number") from None
        if not (w[name] >= 0 and np.isfinite(w[name])):
            raise ValueError(f"--loss-weights: the weight of {name} must be finite and >= 0")
    if not any(w[r] > 0 for r in ROLES if r != "padding"):
        raise ValueError("--loss-weights: every weight is 0; nothing would be learned")
    return tuple(w[r] for r in ROLES)


def train_step(state: dict, batch: dict, *, mcfg: ModelConfig, opt, schedule,
               attention: AttentionConfig, weights: tuple[float, ...] | None = None):
    """One optimizer step on the objective (the mean next-token loss, weighted by role where
    ``weights``); the metrics' ``loss`` is the plain mean either way, comparable across runs.
    A model with ``anonymize_src`` reads its rows with each context's source addresses made
    random (train.model.model.anonymize_sources), new at every step (its pair store still
    reads the real ones). A model with ``gate_fold`` trains its stores' gates on the RTTs of
    one fold of the contexts, and learns those RTTs nothing else (train.model.model.fold_targets).
    A model with ``pair_forward`` reads its pair store at the measurement's own pair on the
    contexts of a fold of its own, which the store was built without
    (train.model.model.pair_fold_targets)."""
    if mcfg.gate_fold and (mcfg.dst_store or mcfg.pair_store):  # from the real sources
        batch = dict(batch, fold=model.fold_targets(batch["tokens"], batch["segment_ids"],
                                                    mcfg.gate_fold))
    if mcfg.pair_store and mcfg.pair_forward:  # from the real tokens
        batch = dict(batch, pair_fold=model.pair_fold_targets(
            batch["tokens"], batch["segment_ids"], mcfg.pair_forward))
    if mcfg.anonymize_src:
        if mcfg.pair_store:  # its rows are keyed by the real sources (model.pair_keys)
            batch = dict(batch, src_hash=model.field_hashes(batch["tokens"], batch["segment_ids"],
                                                            "src")[0])
        batch = dict(batch, tokens=model.anonymize_sources(batch["tokens"], batch["segment_ids"],
                                                           state["step"]))

    def loss_fn(params):
        total, count, objective = model.loss_sum(params, batch, mcfg, attention, weights)
        return objective, total / jnp.maximum(count, 1)

    (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
               **model.flop_counts(batch["segment_ids"])}
    return {"params": params, "opt": opt_state, "step": state["step"] + 1}, metrics


def eval_step(params: dict, batch: dict, *, mcfg: ModelConfig, attention: AttentionConfig):
    """(loss sum, target count), each float32[N_ROLES] by the role of the token each
    position predicts (train.model.model.loss_by_role)."""
    loss, _, count = model.loss_by_role(params, batch["tokens"], batch["segment_ids"], mcfg,
                                        attention)
    return loss, count


# what make_optimizer reads: runs that agree on these (and the mesh, model and attention)
# share one compiled step within a process
OPT_FIELDS = ("steps", "lr", "min_lr_ratio", "warmup", "weight_decay", "b1", "b2", "grad_clip",
              "loss_weights", "schedule_steps")


def compile_steps(mesh: Mesh, mcfg: ModelConfig, cfg: TrainConfig, attention: AttentionConfig):
    """(train_step(state, batch) -> (state, metrics), eval_step(params, batch) -> (sums, counts) by role)."""
    # --steps counts only through the schedule's span: a resume that runs on past it (the
    # same span) is the same step
    span = cfg.schedule_steps or cfg.steps
    opt_cfg = TrainConfig(**{f: getattr(cfg, f) for f in OPT_FIELDS}
                          | {"steps": span, "schedule_steps": span})
    return _compile_steps(mesh, mcfg, opt_cfg, attention)


@functools.lru_cache(maxsize=8)  # a run's segment-table sizes (train.fit.loop.table_size)
def _compile_steps(mesh: Mesh, mcfg: ModelConfig, cfg: TrainConfig, attention: AttentionConfig):
    rep, rows = shardings(mesh)
    step_fn = functools.partial(train_step, mcfg=mcfg, opt=make_optimizer(cfg, mcfg),
                                schedule=lr_schedule(cfg), attention=attention,
                                weights=role_weights(cfg.loss_weights))
    train = jax.jit(step_fn, in_shardings=(rep, rows), out_shardings=(rep, rep),
                    donate_argnums=0)
    return train, _compile_eval(mesh, mcfg, attention)


@functools.lru_cache(maxsize=4)
def _compile_eval(mesh: Mesh, mcfg: ModelConfig, attention: AttentionConfig):
    rep, rows = shardings(mesh)
    return jax.jit(functools.partial(eval_step, mcfg=mcfg, attention=attention),
                   in_shardings=(rep, rows), out_shardings=(rep, rep))


# Dense bf16 peak per device (FLOP/s), by jax device_kind prefix; most specific first.
PEAK_BF16 = (
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100", 989e12),
    ("NVIDIA H200", 989e12), ("NVIDIA GH200", 989e12), ("NVIDIA B200", 2250e12),
    ("NVIDIA A100", 312e12), ("NVIDIA L4", 121e12), ("NVIDIA A10", 125e12),
    ("TPU v5 lite", 197e12), ("TPU v5", 459e12), ("TPU v4", 275e12),
)


def peak_flops(device=None) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPUs): MFU is then not reported."""
    kind = (device or jax.devices()[0]).device_kind
    return next((f for prefix, f in PEAK_BF16 if kind.startswith(prefix)), None)
