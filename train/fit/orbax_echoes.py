"""Orbax's late echoes of a checkpoint failure that the Checkpointer reports in one line.

Orbax and TensorStore read and write a checkpoint's arrays concurrently; when one read or
write fails, the others fail later, with no one awaiting them:

- a read's coroutine is finalized with its error after restore() has raised, some only
  once the run is over ("Exception ignored in <coroutine ...>" and a page of TensorStore
  spec, through sys.unraisablehook), or its event loop is closed under it;
- a write that Orbax gave up is a task whose error asyncio logs when it is collected, up to
  the interpreter's exit ("Task exception was never retrieved");
- Orbax logs a failed background save itself as pages of tracebacks (absl ERROR).

``drop_late_echoes`` drops the first two for the rest of the process, since they come at
any time; they are told by their frames (Orbax's or TensorStore's), and everything else
reaches the hook and the handlers that were there. It is idempotent and is called again
where a failure may echo (a test runner may have swapped sys.unraisablehook meanwhile).
``AbslErrors`` drops the third: each Checkpointer adds one to the absl logger while it is
open.
"""

from __future__ import annotations

import inspect
import logging
import sys

_SOURCES = ("orbax", "tensorstore")


def _from_orbax(text: str, tb) -> bool:
    """Whether ``text`` or a frame of traceback ``tb`` is Orbax's or TensorStore's."""
    places = [text]
    while tb is not None:
        places.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return any(k in x for x in places for k in _SOURCES)


def _read_echo(u) -> bool:
    """An unraisable exception that echoes a failed read: an Orbax or TensorStore
    coroutine finalized with its error, or its event loop closed under it."""
    if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
        return True
    if not inspect.iscoroutine(u.object):
        return False
    code = getattr(u.object, "cr_code", None)
    return _from_orbax(f"{getattr(code, 'co_filename', '')} {u.object!r}", u.exc_traceback)


class _TaskEchoes(logging.Filter):
    """asyncio's record of an Orbax or TensorStore task that failed unawaited."""

    def filter(self, record):
        text = record.getMessage()
        return not ("exception was never retrieved" in text
                    and _from_orbax(text, record.exc_info[2] if record.exc_info else None))


class AbslErrors(logging.Filter):
    """Orbax's ERROR records (a failed background save's pages of tracebacks)."""

    def filter(self, record):
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


_TASKS = _TaskEchoes()
_hook = None  # the unraisablehook installed here


def drop_late_echoes() -> None:
    """From now on, drop Orbax's late echoes of failed reads and writes (the module
    docstring); every other unraisable exception and asyncio record passes."""
    global _hook
    log = logging.getLogger("asyncio")
    if _TASKS not in log.filters:
        log.addFilter(_TASKS)
    if _hook is not None and sys.unraisablehook is _hook:
        return
    prev = sys.unraisablehook

    def hook(u):
        if not _read_echo(u):
            prev(u)

    _hook = sys.unraisablehook = hook
