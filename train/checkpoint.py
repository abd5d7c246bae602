"""Checkpoints with Orbax: the train state and the Grain iterator state, saved together.

    RUN_DIR/checkpoints/<step>/state/   params, optimizer state, step (Orbax, async)
    RUN_DIR/checkpoints/<step>/data/    the reader's iterator state (JSON, a few ints)

Both halves of a step are written under one Orbax step directory that only appears once
complete, so a checkpoint is never half state, half data. Restoring gives the state back
with the shardings of an abstract template (replicated over the mesh) and the iterator
state to pass to ``DatasetIterator.set_state``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | Path, *, max_to_keep: int = 3):
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options,
                                             item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_state: dict) -> None:
        """Start writing (asynchronously; the arrays are copied first, so training can go on)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

    def restore(self, step: int, template: dict | None = None) -> tuple[dict, dict]:
        """(state shaped and sharded like ``template`` (or as saved), iterator state) of ``step``."""
        abstract = None if template is None else jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                              template)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
