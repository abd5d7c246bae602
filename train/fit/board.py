"""TensorBoard event files in the run folder, beside ``metrics.jsonl``, so a run can be
watched live with ``tensorboard --logdir runs/`` (each run folder one run there).

The same records as ``metrics.jsonl`` (train.fit.runfolder), as scalars:

    train/loss, train/grad_norm, train/lr, train/step_ms, train/tokens_per_s, train/mfu,
    train/data_wait, eval/loss, eval/loss_<role>

written by tensorboardX (the ``tensorboard`` extra: event files without TensorFlow or
PyTorch), flushed at every record so the board is at most one log line behind. Without
it, one line says so at the start and the run goes on: metrics.jsonl has every number.
A resumed run purges the events after its checkpoint's step, as metrics.jsonl is trimmed.
"""

from __future__ import annotations

from pathlib import Path

TRAIN = ("loss", "grad_norm", "lr", "step_ms", "tokens_per_s", "mfu", "data_wait")
MISSING = ("note: no TensorBoard event files: they need tensorboardX (pip install "
           "'ping-pack[tensorboard]'); metrics.jsonl has the same numbers")


class Board:
    """Scalars of metrics records into event files under ``run_dir``; a no-op without
    tensorboardX (``available`` False; ``MISSING`` is the line to say)."""

    def __init__(self, run_dir: str | Path, *, purge_step: int | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            self.available, self._writer = False, None
            return
        self.available = True
        # the file is made at the first record: a start that never steps leaves none
        self._open = lambda: SummaryWriter(logdir=str(run_dir), purge_step=purge_step)
        self._writer = None

    def add(self, rec: dict) -> None:
        """One metrics.jsonl record (a train log line or an eval)."""
        if not self.available:
            return
        if self._writer is None:
            self._writer = self._open()
        step, w = rec["step"], self._writer
        for k in TRAIN:
            if rec.get(k) is not None:
                w.add_scalar(f"train/{k}", rec[k], step)
        if rec.get("eval_loss") is not None:
            w.add_scalar("eval/loss", rec["eval_loss"], step)
            for role, v in rec.get("eval_loss_by_role", {}).items():
                w.add_scalar(f"eval/loss_{role}", v, step)
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
