"""What a claim of an output folder is made of (prep.jobs.claim describes the protocol): the
local ``Claim`` its layouts extend, ``claim_local``, the ownership markers of our
dot-folders, and the refusals, one wording each."""

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
    """A local ``--out`` held by this run (steps 1-4 in ``_open``, 6 in ``_close``); a
    layout adds ``_check`` (steps 2-3: what it finds there) and ``publish`` (step 5)."""

    def __init__(self, path: Path, *, command: str, runner: str, overwrite: bool,
                 guard: Guard):
        self.path, self.command, self.runner, self.overwrite = path, command, runner, overwrite
        self.guard = guard  # set ``guard.defer`` to hold SIGINT/SIGTERM a while
        self.stage: Path | None = None
        self.made = self.published = False  # made: removed again if the run fails
        self.lock = FolderLock(path, command)
        self._token = secrets.token_hex(6)

    def _open(self) -> None:
        out = self.path
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

    def _published(self) -> None:
        self.published = self.guard.published = True

    def _close(self) -> None:
        self.guard.defer = True  # a second Ctrl-C does not cut the clean-up short
        if self.stage is not None:
            with contextlib.suppress(OSError):
                remove_owned(self.stage)
        self.lock.release(self.made and not self.published)


@contextlib.contextmanager
def claim_local(kind, out: str | os.PathLike, *, command: str, runner: str,
                overwrite: bool = False):
    """Steps 1-4 on entry, 6 on exit, for a ``kind`` of Claim; yields it. Within the block
    SIGINT/SIGTERM raise Interrupted, and a full, read-only or not writable disk becomes a
    one-line InputError naming the folder."""
    out = Path(out)
    with stop_on_signals(out, command) as guard:
        od = kind(out, command=command, runner=runner, overwrite=overwrite, guard=guard)
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
