"""The parquet layout of an output folder (prep.jobs.claim describes the protocol): what
`prep import-atlas`, `prep synth` and `prep import-matrix` write into ``--out``, and its
publish by renames. What the folder may hold::

    out/*.parquet                              the output (of this run, or the one before)
    out/.lock                                  locked by the run writing the folder
    out/.tmp-<runner>-<pid>-<token>/           a run's staging folder

A shards or run folder is refused always. The publish writes the list of the files to
remove and to move in to the staging folder (``.publish``), then removes the old parquet
files not in the new output and moves the new ones in by renames. A SIGKILL in between
leaves that list, and the next run finishes the publish; until then readers refuse the
folder (prep.base.sniff.unfinished_publish).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from prep.base import sniff
from prep.base.atomic import write_atomic
from prep.base.lock import LOCK_NAME
from prep.jobs.owned import (
    FolderClaim,
    foreign,
    holds_parquet,
    is_owned,
    not_for_parquet,
    remove_owned,
)

PUBLISH = sniff.PUBLISH  # in a staging folder: what its publish removes and moves in
NOT_PARQUET = {"shards": "a shards folder (the output of `prep shards`)", "run": "a run"}


class ParquetOut(FolderClaim):
    """``--out`` of a command that writes parquet files, a folder, held by this run; made
    by prep.jobs.claim.claim."""

    def __init__(self, path: Path, **kw):
        super().__init__(path, **kw)
        self._stage_re = re.compile(rf"\.tmp-{re.escape(self.runner)}-(\d+)-([0-9a-f]{{12}})")
        self.old: list[str] = []  # parquet files already there (replaced with --overwrite)

    def _check_kind(self) -> None:
        k = sniff.kind(self.path) if self.path.is_dir() else None
        if k in NOT_PARQUET:
            raise not_for_parquet(self.path, NOT_PARQUET[k], self.command)

    def _check(self) -> None:
        out = self.path
        dead = []
        for e in sorted(out.iterdir()):
            if e.name == LOCK_NAME and e.is_file() and not e.is_symlink():
                continue
            if (m := self._stage_re.fullmatch(e.name)) and is_owned(e, "staging", m[1], m[2]):
                dead.append(e)
                continue
            if e.name.endswith(".parquet") and e.is_file() and not e.is_symlink():
                self.old.append(e.name)
                continue
            raise foreign(out, e.name, self.command)
        for d in dead:  # a dead run's (we hold the lock): finish its publish, or remove it
            if (d / PUBLISH).is_file():
                _finish_publish(out, d)
                self.old = sorted(p.name for p in out.glob("*.parquet"))
            with contextlib.suppress(OSError):  # what stays is removed next time
                remove_owned(d)
        if self.old and not self.overwrite:
            raise holds_parquet(out, self.old)

    def publish(self, names: list[str]) -> None:
        """Replace the folder's parquet files with ``names`` from the staging folder."""
        plan = publish_plan(self.old, names)
        self.guard.defer = True  # SIGINT/SIGTERM wait for the end of the publish
        write_atomic(self.stage / PUBLISH, json.dumps(plan))  # from here on, the next run finishes it
        _finish_publish(self.path, self.stage)
        self._published()


def publish_plan(old: list[str], names: list[str]) -> dict:
    """What a publish does: remove the ``old`` files not among ``names``, move ``names`` in."""
    keep = set(names)
    return {"remove": [n for n in old if n not in keep], "move": list(names)}


def _finish_publish(out: Path, stage: Path) -> None:
    """The publish from the staging folder's ``.publish`` list; idempotent, so that a run
    killed half-way is finished by the next one with the same code."""
    plan = json.loads((stage / PUBLISH).read_text())
    for name in plan["remove"]:
        (out / name).unlink(missing_ok=True)
    for name in plan["move"]:
        if (stage / name).exists():
            os.replace(stage / name, out / name)
