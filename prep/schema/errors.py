"""The one error type a user sees: a single line naming the file and the fix (exit code 2);
a disk full, read-only or not writable, as one (``fs_failure``)."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path


class InputError(Exception):
    """Bad input (missing column, unreadable file, damaged shard). ``str(e)`` is the whole message."""


def first_line(e: BaseException) -> str:
    """An exception as a short phrase: its message's first line (at most 200 characters),
    or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


_FS_ERRORS = {  # errno: (the words some libraries print instead of an errno, what it means, fix)
    errno.ENOSPC: ("No space left on device", "no space left on the device",
                   "free some space or use --out on another disk"),
    errno.EDQUOT: ("Disk quota exceeded", "disk quota exceeded",
                   "free some space or use --out on another disk"),
    errno.EROFS: ("Read-only file system", "read-only file system",
                  "use --out on a writable disk"),
    errno.EACCES: ("Permission denied", "permission denied",
                   "use a folder you can write, or fix its permissions"),
    errno.EPERM: ("Operation not permitted", "operation not permitted",
                  "use a folder you can write, or fix its permissions"),
}

FS_PROBLEMS = tuple(what for _, what, _ in _FS_ERRORS.values())  # as fs_failure words them


def fs_failure(e: BaseException, out: Path) -> InputError | None:
    """A one-line InputError for a disk full, read-only or not writable ``out``, or None.
    ArrayRecord and Arrow report these as RuntimeError/OSError text without an errno."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    text = str(e)
    for n, (words, what, fix) in _FS_ERRORS.items():
        if code == n or (code is None and words in text):
            where = getattr(e, "filename", None) if isinstance(e, OSError) else None
            if where is None and (m := re.search(r"writing (\S+?);", text)):
                where = m.group(1)  # ArrayRecord: "…; writing /path; at byte 0; …"
            if where is not None and not _is_under(Path(where), out):
                return InputError(f"{where}: {what}")  # e.g. an input file we may not read
            at = f" (writing {where})" if where else ""
            return InputError(f"{out}: {what}{at}; {fix}; nothing of this run was published")
    return None


def _is_under(p: Path, folder: Path) -> bool:
    a, b = os.path.abspath(p), os.path.abspath(folder)
    try:
        return os.path.commonpath([a, b]) == b
    except ValueError:
        return False
