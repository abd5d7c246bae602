"""The shards layout of an output folder (prep.jobs.claim describes the protocol): what
`prep shards` writes into ``--out``, and its publish by renames. What the folder may hold::

    out/manifest.json, out/train/, out/test/   the finished dataset (manifest.json makes it one)
    out/.lock                                  locked by the run writing the folder
    out/.tmp-shards-<pid>-<token>/             a run's staging folder (.tmp-beam-… for Beam)
    out/.old-<pid>-<token>/                    the dataset being replaced, during the swap

``train/`` and ``test/`` must be real folders of shard files. The runner writes every shard,
then the manifest, into the staging folder; its file list is checked against the manifest.
Then the swap, by renames, SIGINT and SIGTERM held. What a reader sees if killed after:

   a. ``mkdir .old-<pid>-<token>/`` (+ marker)          the old dataset (or none)
   b. ``manifest.json`` → ``.old-*/``                   no dataset (no manifest.json)
   c. per split: old ``train/`` → ``.old-*/``, the      no dataset; train/ and test/ absent
      staging ``train/`` → ``out``; same for test        or the old or new complete shards
   d. the staging ``manifest.json`` → ``out``           the new dataset
   e. remove ``.old-*/``, then the staging folder       the new dataset

Killed between b and d (SIGKILL only), the next run into the folder finishes c and d from
the staging folder, which still holds the complete new dataset. So the folder is the old
dataset, the new one or none, never a mix. A reader that loaded the old manifest before the
swap may find its shards gone or replaced (the manifest's sha256 per shard tells).
Kill-safe, not power-loss-safe: shards are not fsynced (the manifest and the folder are).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

from prep.base.atomic import fsync_dir
from prep.base.errors import InputError
from prep.base.lock import LOCK_NAME
from prep.jobs.owned import (
    MARKER,
    FolderClaim,
    foreign,
    holds_dataset,
    is_owned,
    make_owned_dir,
    remove_owned,
)
from prep.schema.manifest import SPLITS

MANIFEST = "manifest.json"  # == prep.schema.manifest.MANIFEST_NAME (not imported: it pulls in numpy)
SHARD_FILE = re.compile(r"shard-b\d+-e\d+\.array_record(\.tmp)?")
_STAGE = re.compile(r"\.tmp-(shards|beam)-(\d+)-([0-9a-f]{12})")
_OLD = re.compile(r"\.old-(\d+)-([0-9a-f]{12})")


class OutDir(FolderClaim):
    """``--out`` of `prep shards`, a folder, held by this run; made by prep.jobs.claim.claim."""

    def _check(self) -> None:
        out = self.path
        stages, olds, dataset = self._scan()
        if not (out / MANIFEST).exists():
            self._recover(stages, olds)
            dataset = (out / MANIFEST).exists() or dataset
        for d in stages + olds:  # dead runs' (we hold the lock): never a live run's
            with contextlib.suppress(OSError):  # what stays is removed next time
                remove_owned(d)
        (out / (MANIFEST + ".tmp")).unlink(missing_ok=True)  # earlier versions wrote it here
        if dataset and not self.overwrite:
            raise holds_dataset(out, (out / MANIFEST).exists())

    def _scan(self) -> tuple[list[Path], list[Path], bool]:
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
                            raise foreign(out, f"{name}/{f.name}", "prep shards")
                        dataset = True
                    continue
            if (m := _STAGE.fullmatch(name)) and is_owned(entry, "staging", m[2], m[3]):
                stages.append(entry)
                continue
            if (m := _OLD.fullmatch(name)) and is_owned(entry, "old", m[1], m[2]):
                olds.append(entry)
                continue
            raise foreign(out, name, "prep shards")
        return stages, olds, dataset

    def _recover(self, stages: list[Path], olds: list[Path]) -> None:
        """A dead run got past the swap's step b (its ``.old-*`` exists, ``out`` has no manifest, its
        staging folder still holds the new one): finish its swap."""
        for old in olds:
            pid, token = _OLD.fullmatch(old.name).groups()
            for stage in stages:
                if stage.name.endswith(f"-{pid}-{token}") and (stage / MANIFEST).is_file():
                    _swap(self.path, stage, old)
                    print(f"prep shards: {self.path}: finished publishing the dataset of an "
                          f"interrupted run (pid {pid})", file=sys.stderr)
                    return

    def publish(self, manifest: dict) -> None:
        """Write ``manifest`` into the staging folder, check the staged files against it,
        and swap it in (steps a-e)."""
        from prep.schema import manifest as mf

        stage = self.stage
        check_staged(stage, manifest)
        mf.write_manifest(stage, manifest)
        self.guard.defer = True  # SIGINT/SIGTERM wait for the end of the swap
        old = self.path / f".old-{os.getpid()}-{self._token}"
        make_owned_dir(old, "old", os.getpid(), self._token)
        try:
            _swap(self.path, stage, old, undo_on_error=True)
        except OSError:
            if set(os.listdir(old)) <= {MARKER}:  # undone: the old dataset is back in place
                remove_owned(old)
            raise
        self._published()
        fsync_dir(self.path)
        with contextlib.suppress(OSError):
            remove_owned(old)


def check_staged(stage: Path, manifest: dict) -> list[str]:
    """The staged shards (``split/name``) if they are exactly those the manifest lists;
    RuntimeError otherwise (a bug, never a user's mistake: it stops a run before it
    publishes anything)."""
    for split in SPLITS:
        (stage / split).mkdir(exist_ok=True)
    listed = shard_paths(manifest)
    staged = {f"{split}/{f.name}" for split in SPLITS for f in (stage / split).iterdir()}
    if staged != listed:
        raise RuntimeError(f"{stage}: staged shards {sorted(staged ^ listed)[:3]} do not "
                           "match the manifest")
    return sorted(staged)


def shard_paths(manifest: dict) -> set:
    """The shards a manifest lists, as paths relative to the dataset (``split/name``)."""
    return {e["path"] for sp in manifest["splits"].values() for e in sp["shards"]}


def _swap(out: Path, stage: Path, old: Path, undo_on_error: bool = False) -> None:
    """Steps b-d; idempotent per split, so a dead run's half-done swap is finished by
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
