"""A helper process dies with the process that started it.

A parent killed by SIGKILL (the out-of-memory killer, `kill -9`) runs no cleanup, so its
workers would go on: holding memory, writing into a run nobody finishes, and holding
the parent's pipes open (a supervisor reading them never sees the end). Every worker
that prep and train start (prep.jobs.pool's, train.fit.reader's Grain workers) calls
``die_with_parent`` first. It lives this low because both layers need it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time


def die_with_parent(parent: int | None, *, any_thread: bool = False) -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG on Linux), else end it
    from a thread that watches the parent pid (every 0.5 s); ``parent``: the pid it must
    have (exit at once if it is gone already). PR_SET_PDEATHSIG fires when the *thread*
    that started this process ends, so a worker that a short-lived thread of its parent
    may have started (Grain starts its workers from a pool of threads) passes
    ``any_thread`` and is watched by pid only."""
    ppid = os.getppid()
    watched = False
    if sys.platform.startswith("linux") and not any_thread:
        with contextlib.suppress(OSError, AttributeError):
            watched = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) == 0
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent died before the line above
    if not watched:
        def watch():
            while os.getppid() == ppid:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True, name="die-with-parent").start()
