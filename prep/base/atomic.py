"""Whole or not at all: every file that a reader may open while it is being replaced is
written under a temporary name beside it (``name.tmp``, or ``name.part`` for a download)
and renamed onto its name when complete (``os.replace``, atomic within a file system).

A kill leaves the old file or the new one, never a torn one; the temporary file a failure
leaves is removed, one a kill leaves is overwritten by the next write.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = ".tmp"):
    """Yields the temporary path beside ``path``; the block writes it, and it is renamed
    onto ``path`` when the block ends (removed instead when the block fails)."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, fsync: bool = False) -> Path:
    """Write ``data`` to ``path`` whole (``fsync``: flushed to the disk before the rename)."""
    path = Path(path)
    with replacing(path) as tmp:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    return path


def fsync_dir(d: Path) -> None:
    """Flush a folder's entries (the renames into it) to the disk, where the OS allows."""
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
