"""The one error type a user sees: a single line naming the file and the fix (exit code 2);
``first_line`` for quoting another error in it; and the one table of disk failures (full,
read-only, not writable), which prep's outputs and train's run folder (``fs_failure``)
and train's checkpoints (train.fit.checkpoint) word with fixes of their own."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path


class InputError(Exception):
    """Bad input (missing column, unreadable file, damaged shard). ``str(e)`` is the whole message."""


def first_line(e: BaseException, width: int | None = 200) -> str:
    """An exception as a short phrase: its message's first line (at most ``width``
    characters), or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0][:width] if text else type(e).__name__


# errno: (what it means, what kind of fix it wants). Some libraries (ArrayRecord, Arrow,
# TensorStore) report these as text without an errno: DISK_WORDS are the words they print.
DISK = {
    errno.ENOSPC: ("no space left on the device", "space"),
    errno.EDQUOT: ("disk quota exceeded", "space"),
    errno.EROFS: ("read-only file system", "read-only"),
    errno.EACCES: ("permission denied", "permission"),
    errno.EPERM: ("operation not permitted", "permission"),
}
DISK_WORDS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
              "Read-only file system": errno.EROFS, "Permission denied": errno.EACCES,
              "Operation not permitted": errno.EPERM}

FS_PROBLEMS = tuple(what for what, _ in DISK.values())  # as fs_failure words them
_OUT_FIX = {"space": "free some space or use {flag} on another disk",
            "read-only": "use {flag} on a writable disk",
            "permission": "use a folder you can write, or fix its permissions"}


def disk_errno(e: BaseException, words: dict[str, int] = DISK_WORDS) -> int | None:
    """The errno of ``DISK`` that ``e`` stands for: its own, or, without one, the first of
    ``words`` in its text (in the table's order); None for any other error."""
    code = getattr(e, "errno", None) if isinstance(e, OSError) else None
    if code is not None:
        return code if code in DISK else None
    text = str(e)
    found = [n for w, n in words.items() if w in text]
    return next((n for n in DISK if n in found), None)


def fs_failure(e: BaseException, out: Path, *, flag: str = "--out",
               then: str | None = "nothing of this run was published") -> InputError | None:
    """A one-line InputError for a disk full, read-only or not writable ``out`` (given as
    ``flag``; ``then``: what became of the run), or None."""
    code = disk_errno(e)
    if code is None:
        return None
    what, kind = DISK[code]
    text = str(e)
    where = getattr(e, "filename", None) if isinstance(e, OSError) else None
    if where is None and (m := re.search(r"writing (\S+?);", text)):
        where = m.group(1)  # ArrayRecord: "…; writing /path; at byte 0; …"
    # ours: ``out``, what is in it, or a folder above it that making it makes
    if where is not None and not (_is_under(Path(where), out) or _is_under(out, Path(where))):
        return InputError(f"{where}: {what}")  # e.g. an input file we may not read
    at = f" (writing {where})" if where and os.path.abspath(where) != os.path.abspath(out) else ""
    then = f"; {then}" if then else ""
    return InputError(f"{out}: {what}{at}; {_OUT_FIX[kind].format(flag=flag)}{then}")


def _is_under(p: Path, folder: Path) -> bool:
    a, b = os.path.abspath(p), os.path.abspath(folder)
    try:
        return os.path.commonpath([a, b]) == b
    except ValueError:
        return False
