"""The one error type a user sees: a single line naming the file and the fix (exit code 2)."""


class InputError(Exception):
    """Bad input (missing column, unreadable file, damaged shard). ``str(e)`` is the whole message."""


def first_line(e: BaseException) -> str:
    """An exception as a short phrase: its message's first line (at most 200 characters),
    or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
