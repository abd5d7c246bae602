"""The one lock of a folder that a run writes: ``folder/.lock``, an exclusive ``flock`` held
for the run, the holder's pid written in it.

A second run fails at once, in one line naming that pid. Forked workers inherit the lock,
so a folder whose lock is free has no live writer; the kernel drops it however the run
ends. The output folders of prep (prep.jobs.outdir) and train's run folder lock through
here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from pathlib import Path

from prep.base.errors import InputError

LOCK_NAME = ".lock"
_LOCK_WAIT_S = 5.0  # a dead run's workers may hold its lock that long while they die


def lock_folder(folder: Path, command: str, *, doing: str = "is writing this folder",
                stop: str = "stop it, then run again", wait: str | None = None) -> int:
    """Lock ``folder/.lock`` (flock, exclusive) for this run and write its pid there; the
    open descriptor (``release`` gives it back). Another live run holding it is an
    InputError naming its pid (``command`` says what it runs, ``doing`` what it does there,
    ``stop`` how to get past it), or, given ``wait`` (a line for stderr), waited for; a dead
    run's lock, which its dying workers may hold a moment longer, is waited for up to a few
    seconds. The folder is made again if a run that ended meanwhile removed it (an empty
    folder it had made)."""
    path = folder / LOCK_NAME
    deadline, said = time.monotonic() + _LOCK_WAIT_S, False
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            folder.mkdir(parents=True, exist_ok=True)
            continue
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise InputError(f"{folder}: {LOCK_NAME} is a symlink, which `{command}` did "
                                 "not write; move it away") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if wait is not None:
                if not said:
                    print(wait, file=sys.stderr)
                    said = True
                fcntl.flock(fd, fcntl.LOCK_EX)
                with contextlib.suppress(FileNotFoundError):
                    if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                        break
                os.close(fd)
                continue
            holder = _read_pid(fd)
            os.close(fd)
            if (holder is None or not pid_alive(holder)) and time.monotonic() < deadline:
                # Dead: its workers are dying with it and drop the lock soon. None: a
                # run that has just locked it and not yet written its pid.
                time.sleep(0.05)
                continue
            who = f"pid {holder}" if holder is not None else "pid unknown"
            if holder is not None and not pid_alive(holder):
                raise InputError(f"{folder}: the workers of an earlier `{command}` "
                                 f"({who}, gone) still hold {LOCK_NAME}; try again in "
                                 "a few seconds") from None
            raise InputError(f"{folder}: another `{command}` ({who}) {doing}; wait for it "
                             f"to end, or {stop}") from None
        # Locked; but if the file was removed (and maybe re-created) by a run that
        # ended meanwhile, ours is a stale inode: lock the one at the path instead.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(folder: Path, fd: int, made: bool = False) -> None:
    """Unlock and remove ``folder/.lock`` (``fd`` from ``lock_folder``); then, if this run
    ``made`` the folder and it is empty, remove the folder too: a failed run into a new
    folder leaves nothing behind."""
    with contextlib.suppress(OSError):
        path = folder / LOCK_NAME
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            path.unlink()  # still locked: a run waiting on it re-checks the inode
    os.close(fd)
    if made:
        with contextlib.suppress(OSError):
            folder.rmdir()  # fails, as it should, unless the folder is empty


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FolderLock:
    """``lock_folder`` and ``release`` as one object: ``acquire`` (once), ``held``,
    ``release`` (``made``: remove the folder too, if empty)."""

    def __init__(self, folder: Path, command: str, **words):
        self.folder, self.command, self.words, self.fd = folder, command, words, None

    def acquire(self) -> None:
        if self.fd is None:
            self.fd = lock_folder(self.folder, self.command, **self.words)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self, made: bool = False) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            release(self.folder, fd, made)
