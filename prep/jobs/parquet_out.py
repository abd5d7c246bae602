"""The output folder of `prep import-atlas` and `prep synth`: a folder of parquet files,
claimed, staged and published as prep.jobs.outdir does for `prep shards`. What it holds::

    out/*.parquet                              the output (of this run, or the one before)
    out/.lock                                  locked (flock) by the run writing the folder
    out/.tmp-<runner>-<pid>-<token>/           a run's staging folder (marker ``.ping-pack-owner``)

A run, step by step (``claim``):
1. Lock ``.lock`` for the whole run (prep.jobs.outdir.lock_folder): a second run into the
   folder fails at once (exit 2) naming the first one's pid. Forked workers inherit it.
2. Check before touching anything: ``out`` is a folder; a shards or run folder is refused
   always, anything but parquet files and our own folders too (named); parquet files
   already there are replaced only with ``--overwrite``.
3. Clean up: dead runs' staging folders are removed (the lock is ours, so their runs are
   gone); one killed while publishing (it holds a ``.publish`` list) is finished first.
4. Stage ``.tmp-<runner>-<pid>-<token>/``: every file of the run is written there.
5. Publish (``publish``), with SIGINT/SIGTERM held: the list of the files to remove and
   to move in is written to the staging folder (``.publish``), then the old parquet
   files not in the new output are removed and the new ones moved in by renames. A
   SIGKILL in between leaves that list, and the next run finishes the publish.
6. Release: the staging folder is removed, ``.lock`` removed and unlocked, and a folder
   this run made is removed again unless it was published. A disk failure anywhere is one
   line naming the folder and the fix, exit 2 (prep.base.errors.fs_failure).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from pathlib import Path

from prep.base import sniff
from prep.base.atomic import write_atomic
from prep.base.errors import InputError, fs_failure
from prep.base.lock import LOCK_NAME, lock_folder
from prep.base.signals import stop_on_signals
from prep.jobs.outdir import close_claimed, is_owned, make_owned_dir, remove_owned

PUBLISH = sniff.PUBLISH  # in a staging folder: what its publish removes and moves in


class ParquetOut:
    """``--out`` held by this run; made by ``claim``: write into ``stage``, then ``publish``."""

    def __init__(self, path: Path, command: str, runner: str, overwrite: bool, guard):
        self.path, self.command, self.runner, self.overwrite = path, command, runner, overwrite
        self._guard = guard
        self._token = secrets.token_hex(6)
        self._stage_re = re.compile(rf"\.tmp-{re.escape(runner)}-(\d+)-([0-9a-f]{{12}})")
        self.stage: Path | None = None
        self.old: list[str] = []  # parquet files already there (replaced with --overwrite)
        self.made = self.published = False
        self._lock_fd: int | None = None

    def _open(self) -> None:
        out = self.path
        if out.is_symlink() and not out.exists():
            raise InputError(f"{out}: a broken symbolic link ({sniff.broken_link(out)}); "
                             "create that folder or use another --out")
        if out.exists() and not out.is_dir():
            raise InputError(f"{out}: is a file; --out must name a folder")
        k = sniff.kind(out) if out.is_dir() else None
        if k in ("shards", "run"):
            what = "a shards folder (the output of `prep shards`)" if k == "shards" else "a run"
            raise InputError(f"{out}: is {what}; {self.command} writes parquet measurements "
                             "and never into a dataset: use a new --out folder")
        self.made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_folder(out, self.command)
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
            raise InputError(f"{out}: holds {e.name}, which `{self.command}` did not write; "
                             "use an empty or new --out folder, or move it away")
        for d in dead:  # a dead run's (we hold the lock): finish its publish, or remove it
            if (d / PUBLISH).is_file():
                _finish_publish(out, d)
                self.old = sorted(p.name for p in out.glob("*.parquet"))
            with contextlib.suppress(OSError):  # what stays is removed next time
                remove_owned(d)
        if self.old and not self.overwrite:
            n = len(self.old)
            raise InputError(f"{out}: not empty (holds {n:,} parquet file{'s' if n > 1 else ''}: "
                             f"{self.old[0]}{', …' if n > 1 else ''}); pass --overwrite to "
                             "replace them (they stay until the new output is complete), or "
                             "use another --out")
        self.stage = out / f".tmp-{self.runner}-{os.getpid()}-{self._token}"
        make_owned_dir(self.stage, "staging", os.getpid(), self._token)

    def publish(self, names: list[str]) -> None:
        """Replace the folder's parquet files with ``names`` from the staging folder."""
        plan = {"remove": [n for n in self.old if n not in set(names)], "move": list(names)}
        self._guard.defer = True  # SIGINT/SIGTERM wait for the end of the publish
        write_atomic(self.stage / PUBLISH, json.dumps(plan))  # from here on, the next run finishes it
        _finish_publish(self.path, self.stage)
        self.published = self._guard.published = True

    @property
    def guard(self):
        """The run's signal guard: set ``guard.defer`` to hold SIGINT/SIGTERM a while."""
        return self._guard

    def _close(self) -> None:
        close_claimed(self)


def _finish_publish(out: Path, stage: Path) -> None:
    """Step 5 from the staging folder's ``.publish`` list; idempotent, so that a run killed
    half-way is finished by the next one with the same code."""
    plan = json.loads((stage / PUBLISH).read_text())
    for name in plan["remove"]:
        (out / name).unlink(missing_ok=True)
    for name in plan["move"]:
        if (stage / name).exists():
            os.replace(stage / name, out / name)


@contextlib.contextmanager
def claim(out: str | os.PathLike, *, command: str, runner: str, overwrite: bool = False):
    """Steps 1-4 on entry, 6 on exit; yields the ParquetOut (``.stage``, ``.publish``).
    Within the block SIGINT/SIGTERM raise Interrupted, and a full, read-only or not
    writable disk becomes a one-line InputError naming the folder."""
    out = Path(out)
    with stop_on_signals(out, command) as guard:
        po = ParquetOut(out, command, runner, overwrite, guard)
        try:
            po._open()
            yield po
        except OSError as e:
            err = fs_failure(e, out)
            if err is None:
                raise
            raise err from None
        finally:
            po._close()
