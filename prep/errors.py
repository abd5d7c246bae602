"""The one error type a user sees: a single line naming the file and the fix (exit code 2)."""


class InputError(Exception):
    """Bad input (missing column, unreadable file, damaged shard). ``str(e)`` is the whole message."""
