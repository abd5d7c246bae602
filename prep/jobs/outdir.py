"""The output folder of `prep shards`: claim, staging, publish, replace, clean up.

Both runners write ``--out`` through this module alone. What it may hold::

    out/manifest.json, out/train/, out/test/   the finished dataset (manifest.json makes it one)
    out/.lock                                  locked (flock) by the run writing the folder
    out/.tmp-shards-<pid>-<token>/             a run's staging folder (.tmp-beam-… for Beam)
    out/.old-<pid>-<token>/                    the dataset being replaced, during the swap

The dot-folders are ours by name AND marker (``.ping-pack-owner``: role, pid, token);
anything else that is not a shard file is not ours, and the run refuses the folder rather
than delete it. A run, step by step:

1. Lock ``.lock`` (flock, exclusive, non-blocking) for the whole run, pid written in it; a
   second run fails at once naming that pid. Forked workers inherit the lock, so a folder
   whose lock is free has no live writer.
2. Check before touching anything: ``out`` is a folder, every entry is ours, ``train/`` and
   ``test/`` are real folders of shard files. Else one line, exit 2.
3. Recover and clean: a dead run killed inside the swap (7b to 7d) is finished first; dead
   runs' staging and ``.old-*`` folders are removed, their marker last.
4. A dataset (``manifest.json`` or any shard) needs ``--overwrite``.
5. Stage ``.tmp-<runner>-<pid>-<token>/``: everything the run writes goes there.
6. Build: the runner writes every shard, then the manifest, into the staging folder; its
   file list is checked against the manifest.
7. Swap, by renames, SIGINT and SIGTERM held. What a reader sees if killed after:

   a. ``mkdir .old-<pid>-<token>/`` (+ marker)          the old dataset (or none)
   b. ``manifest.json`` → ``.old-*/``                   no dataset (no manifest.json)
   c. per split: old ``train/`` → ``.old-*/``, the      no dataset; train/ and test/ absent
      staging ``train/`` → ``out``; same for test        or the old or new complete shards
   d. the staging ``manifest.json`` → ``out``           the new dataset
   e. remove ``.old-*/``, then the staging folder       the new dataset

   Killed between b and d (SIGKILL only), the next run into the folder finishes c and d
   from the staging folder, which still holds the complete new dataset.
8. Release: on failure the staging folder is removed; ``.lock`` is removed and unlocked, and
   a folder the run made is removed again. A disk failure anywhere is one line naming the
   folder and the fix, exit 2 (prep.base.errors.fs_failure).

So the folder is the old dataset, the new one or none, never a mix. A reader that loaded
the old manifest before the swap may find its shards gone or replaced (the manifest's
sha256 per shard tells). Kill-safe, not power-loss-safe: shards are not fsynced (the
manifest and the folder are).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

from prep.base import sniff
from prep.base.atomic import fsync_dir
from prep.base.errors import InputError, fs_failure
from prep.base.lock import LOCK_NAME, lock_folder, release
from prep.base.signals import Guard, stop_on_signals
from prep.schema.manifest import SPLITS

MARKER = ".ping-pack-owner"
MANIFEST = "manifest.json"  # == prep.schema.manifest.MANIFEST_NAME (not imported: it pulls in numpy)
SHARD_FILE = re.compile(r"shard-b\d+-e\d+\.array_record(\.tmp)?")
_STAGE = re.compile(r"\.tmp-(shards|beam)-(\d+)-([0-9a-f]{12})")
_OLD = re.compile(r"\.old-(\d+)-([0-9a-f]{12})")


class OutDir:
    """``--out`` held by this run (see the module docstring); made by ``claim``."""

    def __init__(self, path: Path, *, overwrite: bool, runner: str, guard: Guard):
        self.path, self.overwrite, self.runner, self._guard = path, overwrite, runner, guard
        self.stage: Path | None = None
        self.published = False
        self.made = False  # this run made ``path``: removed again if the run fails
        self._lock_fd: int | None = None
        self._token = secrets.token_hex(6)

    # steps 1-5 ------------------------------------------------------------------------
    def _open(self) -> None:
        out = self.path
        if out.is_symlink() and not out.exists():
            raise InputError(f"{out}: a broken symbolic link ({sniff.broken_link(out)}); "
                             "create that folder or use another --out")
        if out.exists() and not out.is_dir():
            raise InputError(f"{out}: is a file; --out must name a folder")
        self.made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        self._lock()
        stages, olds, dataset = self._check()
        if not (out / MANIFEST).exists():
            self._recover(stages, olds)
            dataset = (out / MANIFEST).exists() or dataset
        for d in stages + olds:  # dead runs' (we hold the lock): never a live run's
            with contextlib.suppress(OSError):  # what stays is removed next time
                remove_owned(d)
        (out / (MANIFEST + ".tmp")).unlink(missing_ok=True)  # earlier versions wrote it here
        if dataset and not self.overwrite:
            what = ("a finished dataset (manifest.json)" if (out / MANIFEST).exists()
                    else "shards of an unfinished dataset (train/, test/ without manifest.json)")
            raise InputError(f"{out}: holds {what}; pass --overwrite to replace it (the old "
                             "one stays intact until the new one is complete), or use "
                             "another --out")
        self.stage = out / f".tmp-{self.runner}-{os.getpid()}-{self._token}"
        make_owned_dir(self.stage, "staging", os.getpid(), self._token)

    def _lock(self) -> None:
        self._lock_fd = lock_folder(self.path, "prep shards")

    def _check(self) -> tuple[list[Path], list[Path], bool]:
        """Our dead folders and whether a dataset (or its shards) is there; refuse the rest."""
        out, stages, olds, dataset = self.path, [], [], False
        for entry in sorted(out.iterdir()):
            name = entry.name
            if name == LOCK_NAME and entry.is_file() and not entry.is_symlink():
                continue
            if name in (MANIFEST, MANIFEST + ".tmp") and entry.is_file() and not entry.is_symlink():
                dataset |= name == MANIFEST
                continue
            if name in SPLITS:
                if entry.is_symlink():
                    raise InputError(f"{out}: {name}/ is a symlink (to {os.readlink(entry)}); "
                                     f"`prep shards` replaces {name}/ and would not follow "
                                     "it: use a folder without symlinks, or another --out")
                if entry.is_dir():
                    for f in sorted(entry.iterdir()):
                        if not (SHARD_FILE.fullmatch(f.name) and f.is_file()
                                and not f.is_symlink()):
                            raise InputError(f"{out}: {f} was not written by `prep shards`; "
                                             "use an empty or new --out folder, or move "
                                             "that file away")
                        dataset = True
                    continue
            if (m := _STAGE.fullmatch(name)) and is_owned(entry, "staging", m[2], m[3]):
                stages.append(entry)
                continue
            if (m := _OLD.fullmatch(name)) and is_owned(entry, "old", m[1], m[2]):
                olds.append(entry)
                continue
            raise InputError(f"{out}: holds {name}, which `prep shards` did not write; use "
                             "an empty or new --out folder, or move it away")
        return stages, olds, dataset

    def _recover(self, stages: list[Path], olds: list[Path]) -> None:
        """A dead run got past step 7b (its ``.old-*`` exists, ``out`` has no manifest, its
        staging folder still holds the new one): finish its swap."""
        for old in olds:
            pid, token = _OLD.fullmatch(old.name).groups()
            for stage in stages:
                if stage.name.endswith(f"-{pid}-{token}") and (stage / MANIFEST).is_file():
                    _swap(self.path, stage, old)
                    print(f"prep shards: {self.path}: finished publishing the dataset of an "
                          f"interrupted run (pid {pid})", file=sys.stderr)
                    return

    # step 7 ---------------------------------------------------------------------------
    def publish(self, manifest: dict) -> None:
        """Write ``manifest`` into the staging folder, check the staged files against it,
        and swap it in (step 7)."""
        from prep.schema import manifest as mf

        stage = self.stage
        check_staged(stage, manifest)
        mf.write_manifest(stage, manifest)
        self._guard.defer = True  # SIGINT/SIGTERM wait for the end of the swap
        old = self.path / f".old-{os.getpid()}-{self._token}"
        make_owned_dir(old, "old", os.getpid(), self._token)
        try:
            _swap(self.path, stage, old, undo_on_error=True)
        except OSError:
            if set(os.listdir(old)) <= {MARKER}:  # undone: the old dataset is back in place
                remove_owned(old)
            raise
        self.published = self._guard.published = True
        fsync_dir(self.path)
        with contextlib.suppress(OSError):
            remove_owned(old)

    @property
    def guard(self) -> Guard:
        """The run's signal guard: set ``guard.defer`` to hold SIGINT/SIGTERM a while."""
        return self._guard

    # step 8 ---------------------------------------------------------------------------
    def _close(self) -> None:
        close_claimed(self)


def check_staged(stage: Path, manifest: dict) -> list[str]:
    """The staged shards (``split/name``) if they are exactly those the manifest lists;
    RuntimeError otherwise (a bug, never a user's mistake: it stops a run before it
    publishes anything)."""
    for split in SPLITS:
        (stage / split).mkdir(exist_ok=True)
    listed = {s["path"] for split in SPLITS for s in manifest["splits"][split]["shards"]}
    staged = {f"{split}/{f.name}" for split in SPLITS for f in (stage / split).iterdir()}
    if staged != listed:
        raise RuntimeError(f"{stage}: staged shards {sorted(staged ^ listed)[:3]} do not "
                           "match the manifest")
    return sorted(staged)


def close_claimed(od) -> None:
    """Step 8 for a claimed folder (an OutDir here, a prep.jobs.parquet_out.ParquetOut):
    remove its staging folder and release the lock (and the folder, if the run made it and
    published nothing). A second Ctrl-C does not cut it short."""
    od._guard.defer = True
    if od.stage is not None:
        with contextlib.suppress(OSError):
            remove_owned(od.stage)
    if od._lock_fd is not None:
        release(od.path, od._lock_fd, od.made and not od.published)
        od._lock_fd = None


@contextlib.contextmanager
def claim(out: str | os.PathLike, *, overwrite: bool = False, runner: str = "shards"):
    """Steps 1-5 on entry, 8 on exit; yields the OutDir (``.stage``, ``.publish``).
    Within the block SIGINT/SIGTERM raise Interrupted, and a full, read-only or not
    writable disk becomes a one-line InputError naming the folder."""
    out = Path(out)
    with stop_on_signals(out) as guard:
        od = OutDir(out, overwrite=overwrite, runner=runner, guard=guard)
        try:
            od._open()
            yield od
        except (OSError, RuntimeError) as e:
            err = fs_failure(e, out)
            if err is None:
                raise
            raise err from None
        finally:
            od._close()


def _swap(out: Path, stage: Path, old: Path, undo_on_error: bool = False) -> None:
    """Steps 7b-d; idempotent per split, so a dead run's half-done swap is finished by
    the same code (a split no longer in the staging folder was already moved in)."""
    done: list[tuple[Path, Path]] = []

    def move(src: Path, dst: Path) -> None:
        _rename(src, dst)
        done.append((src, dst))

    try:
        if (out / MANIFEST).exists():
            move(out / MANIFEST, old / MANIFEST)  # b: from here on, no dataset
        for split in SPLITS:  # c
            if (stage / split).exists():
                if (out / split).exists():
                    move(out / split, old / split)
                move(stage / split, out / split)
        move(stage / MANIFEST, out / MANIFEST)  # d: the new dataset
    except OSError:
        if undo_on_error:  # e.g. a permission on train/: put the old dataset back
            for src, dst in reversed(done):
                with contextlib.suppress(OSError):
                    os.rename(dst, src)
        raise


def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)  # one name for the tests to interrupt between renames


def make_owned_dir(d: Path, role: str, pid: int, token: str) -> None:
    os.mkdir(d)
    fd = os.open(d / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:  # one small write: a kill leaves it whole or empty, and an empty folder is ours
        os.write(fd, json.dumps({"tool": "ping-pack prep shards", "role": role,
                                 "pid": pid, "token": token}).encode())
    finally:
        os.close(fd)


def remove_owned(d: Path) -> None:
    """Remove one of our folders, its marker last: a kill half-way leaves it recognisable."""
    if not d.exists():
        return
    for entry in os.scandir(d):
        if entry.name != MARKER:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(d / MARKER)
    os.rmdir(d)


def is_owned(d: Path, role: str, pid: str, token: str) -> bool:
    """``d`` (named like ours) is ours: its marker says so, or it holds nothing but a
    marker not yet written (a kill between mkdir and write: nothing to lose)."""
    if d.is_symlink() or not d.is_dir():
        return False
    names = set(os.listdir(d))
    marker = d / MARKER
    if MARKER not in names or marker.is_symlink() or not marker.is_file():
        return not names
    try:
        data = json.loads(marker.read_text()[:4096] or "null")
    except (OSError, ValueError):
        return names == {MARKER} and marker.stat().st_size == 0
    if data is None:
        return names == {MARKER}
    return (isinstance(data, dict) and data.get("role") == role
            and str(data.get("pid")) == pid and data.get("token") == token)
