"""What the loop measures: the steps between log lines, and the loss on a sample of test rows.

One log line per ``log_every`` steps, e.g.

    step   200/300 | loss 2.7314 | 41.2 ms | 198,513 tok/s | mfu - | wait 0.4% | lr 1.1e-03

loss averaged over those steps, real (non-padding) tokens/s, MFU (FLOPs on real tokens,
train.model.model; "-" where the device's peak is unknown) and the share of wall time spent
waiting for a batch; the first step (compilation) is left out. ``Meter`` holds the steps'
device metrics until the log line fetches them all at once (the one host sync);
``EvalSample`` runs the current parameters over a fixed, seeded sample of test rows.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from train.fit import reader
from train.fit.config import TrainConfig


class Meter:
    """Device metrics of the steps since the last log line, plus host-side timings."""

    def __init__(self):
        self.totals = {"time": 0.0, "wait": 0.0, "tokens": 0.0, "flops": 0.0}
        self.reset()

    def reset(self):
        self.pending, self.timed, self.wait, self.t0 = [], [], 0.0, time.perf_counter()

    def add(self, metrics: dict, wait: float, timed: bool):
        self.pending.append(metrics)
        self.timed.append(timed)
        self.wait += wait if timed else 0.0

    def flush(self, flops_of) -> dict:
        """Fetch (the one host sync) and summarize; timed steps exclude compilation."""
        fetched = jax.device_get(self.pending)
        elapsed = time.perf_counter() - self.t0
        n_timed = sum(self.timed)
        out = {"loss": sum(float(m["loss"]) for m in fetched) / len(fetched),
               "grad_norm": float(fetched[-1]["grad_norm"]), "lr": float(fetched[-1]["lr"])}
        if n_timed:
            timed = [m for m, t in zip(fetched, self.timed) if t]
            tokens = sum(float(m["tokens"]) for m in timed)
            flops = sum(flops_of(float(m["tokens"]), float(m["attn_ctx"])) for m in timed)
            for k, v in (("time", elapsed), ("wait", self.wait), ("tokens", tokens),
                         ("flops", flops)):
                self.totals[k] += v
            out.update(step_ms=1e3 * elapsed / n_timed, tokens_per_s=tokens / elapsed,
                       flops_per_s=flops / elapsed, data_wait=self.wait / elapsed)
        self.reset()
        return out


def format_line(rec: dict, steps: int) -> str:
    """A log line (the module docstring) from a record of ``Meter.flush``."""
    mfu = f"{100 * rec['mfu']:.1f}%" if rec.get("mfu") is not None else "-"
    timing = (f"{rec['step_ms']:.1f} ms | {rec['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
              f"wait {100 * rec['data_wait']:.1f}%" if "step_ms" in rec else "(compiling)")
    return (f"step {rec['step']:>{len(str(steps))}}/{steps} | loss {rec['loss']:.4f} | "
            f"{timing} | lr {rec['lr']:.1e}")


class EvalSample:
    """A fixed, seeded sample of ``cfg.eval_rows`` test rows, read once, with the role of
    every target (prep.tokens.rowdecode); each eval runs the current parameters over all of it."""

    def __init__(self, cfg: TrainConfig, data: Path, manifest: dict, rows_sharding):
        from prep.schema.rows import RowFormatError
        from prep.tokens import rowdecode

        tok, seg = reader.read_split(data, manifest, "test", sha256=False)  # checked at start
        pick = np.random.default_rng([cfg.seed, 0xE7A1]).permutation(len(tok))[:cfg.eval_rows]
        tok, seg = tok[np.sort(pick)], seg[np.sort(pick)]
        try:  # the roles themselves are read on the device (train.model.model.loss_by_role)
            rowdecode.token_roles(tok, seg)
            self.roles_known = True
        except RowFormatError:  # rows that are not measurements (synthetic test shards)
            self.roles_known = False
        self.n_rows, self.sharding = len(tok), rows_sharding
        # global batches of cfg.batch_size rows, this process's contiguous part of each (as
        # the train batches), the last padded (padding rows count nothing)
        self.pi, self.pc = jax.process_index(), jax.process_count()
        self.batch = max(1, cfg.batch_size // self.pc)
        self.arrays = [tok, seg]

    def __call__(self, params, eval_step) -> dict | None:
        from prep.tokens.rowdecode import ROLES

        if not self.n_rows:
            return None
        total = count = 0
        tok, seg = self.arrays
        for r0 in range(0, max(len(tok), 1), self.batch * self.pc):
            lo = r0 + self.pi * self.batch
            part = {k: _pad(a[lo:lo + self.batch], self.batch) for k, a in
                    zip(("tokens", "segment_ids"), (tok, seg))}
            batch = {k: jax.make_array_from_process_local_data(self.sharding, v)
                     for k, v in part.items()}
            s, c = eval_step(params, batch)
            total, count = total + s, count + c
        total, count = np.asarray(total, np.float64), np.asarray(count, np.float64)
        if not count.sum():
            return None
        out = {"eval_loss": float(total.sum() / count.sum()), "eval_rows": self.n_rows}
        if self.roles_known:
            out["eval_loss_by_role"] = {ROLES[k]: float(total[k] / count[k])
                                        for k in range(1, len(ROLES)) if count[k]}
        return out


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) == n else np.concatenate([a, np.zeros((n - len(a),) + a.shape[1:], a.dtype)])

