"""What a claim of an output is made of (prep.jobs.claim describes the protocol): ``Claim``,
the base both backends extend, with ``held``, its life as a ``with`` block; ``FolderClaim``,
the local backend its folder layouts extend; the ownership markers of our dot-folders; and
the refusals, one wording each."""

from __future__ import annotations

import abc
import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path

from prep.base import sniff
from prep.base.errors import InputError, fs_failure
from prep.base.lock import FolderLock
from prep.base.signals import Guard, stop_on_signals

MARKER = ".ping-pack-owner"


# The refusals, one wording each, for a folder (``noun="folder"``) or a bucket prefix.
def foreign(where, name: str, command: str, noun: str = "folder") -> InputError:
    """``where`` holds ``name``, which no run of ``command`` wrote."""
    return InputError(f"{where}: holds {name}, which `{command}` did not write; use an empty "
                      f"or new --out {noun}, or move it away")


def holds_dataset(where, finished: bool) -> InputError:
    """A dataset (or its shards) is there, and --overwrite was not given."""
    what = ("a finished dataset (manifest.json)" if finished
            else "shards of an unfinished dataset (train/, test/ without manifest.json)")
    return InputError(f"{where}: holds {what}; pass --overwrite to replace it (the old one "
                      "stays intact until the new one is complete), or use another --out")


def holds_parquet(where, names: list[str]) -> InputError:
    """Parquet files are there, and --overwrite was not given."""
    n = len(names)
    return InputError(f"{where}: not empty (holds {n:,} parquet file{'s' if n > 1 else ''}: "
                      f"{names[0]}{', …' if n > 1 else ''}); pass --overwrite to replace "
                      "them (they stay until the new output is complete), or use another --out")


def not_for_parquet(where, what: str, command: str, noun: str = "folder") -> InputError:
    """A dataset or a run given as the --out of a command that writes parquet files."""
    return InputError(f"{where}: is {what}; {command} writes parquet measurements and never "
                      f"into a dataset: use a new --out {noun}")


class Claim(abc.ABC):
    """An output held by one run, through the steps of prep.jobs.claim: ``acquire`` (1-4),
    the run writes into ``stage``, ``publish`` (5), ``release`` (6); ``held`` is that life
    as a ``with`` block. A backend (FolderClaim, remote_out.BucketClaim) acquires and
    releases; a layout on it (outdir.OutDir, parquet_out.ParquetOut, remote_out's
    RemoteDataset and RemoteParquet) checks what it finds there and publishes."""

    def __init__(self, path, *, command: str, runner: str, overwrite: bool = False,
                 progress: bool = True):
        self.path, self.command, self.runner, self.overwrite = path, command, runner, overwrite
        self.progress = progress  # a bar for what takes long (an upload)
        self.guard: Guard | None = None  # set ``guard.defer`` to hold SIGINT/SIGTERM a while
        self.stage: Path | None = None
        self.published = False
        self._token = secrets.token_hex(6)

    @abc.abstractmethod
    def acquire(self, guard: Guard) -> None:
        """Steps 1-4 under ``guard``: lock, check, recover, make ``stage``."""

    @abc.abstractmethod
    def publish(self, content) -> None:
        """Step 5: make what is staged the output (``content``: what the layout lists)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Step 6: remove what this run staged and did not publish; unlock."""

    def failure(self, e: BaseException) -> InputError | None:
        """The one line a user sees for ``e``, raised within the block, or None to let it go
        as it is: a full, read-only or not writable disk names ``path`` and the fix."""
        return None if isinstance(e, InputError) else fs_failure(e, self.path)

    def _published(self) -> None:
        self.published = self.guard.published = True

    @contextlib.contextmanager
    def held(self):
        """Acquired on entry, released on exit, whatever ends the block; within it
        SIGINT/SIGTERM raise Interrupted, and ``failure`` words what goes wrong."""
        with stop_on_signals(self.path, self.command) as guard:
            try:
                self.acquire(guard)
                yield self
            except (OSError, RuntimeError, InputError) as e:
                err = self.failure(e)
                if err is None:
                    raise
                raise err from None
            finally:
                self.release()


class FolderClaim(Claim):
    """The local backend: ``--out`` a folder, locked, staged in a dot-folder of ours and
    published by renames. A layout adds ``_check`` (steps 2-3) and ``publish``."""

    def __init__(self, out: str | os.PathLike, **kw):
        super().__init__(Path(out), **kw)
        self.made = False  # the run made the folder: removed again unless it publishes
        self.lock = FolderLock(self.path, self.command)

    def acquire(self, guard: Guard) -> None:
        self.guard, out = guard, self.path
        if out.is_symlink() and not out.exists():
            raise InputError(f"{out}: a broken symbolic link ({sniff.broken_link(out)}); "
                             "create that folder or use another --out")
        if out.exists() and not out.is_dir():
            raise InputError(f"{out}: is a file; --out must name a folder")
        self._check_kind()
        self.made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        self._check()
        self.stage = out / f".tmp-{self.runner}-{os.getpid()}-{self._token}"
        make_owned_dir(self.stage, "staging", os.getpid(), self._token)

    def _check_kind(self) -> None:
        """Refuse a folder this layout never writes into (before it is locked)."""

    @abc.abstractmethod
    def _check(self) -> None:
        """Refuse what the locked folder holds that this layout may not replace (each
        layout says what: outdir.OutDir, parquet_out.ParquetOut)."""

    def release(self) -> None:
        self.guard.defer = True  # a second Ctrl-C does not cut the clean-up short
        if self.stage is not None:
            with contextlib.suppress(OSError):
                remove_owned(self.stage)
        self.lock.release(self.made and not self.published)


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
