"""SIGINT and SIGTERM, the one guard every command stands under: one line and exit
128 + the signal, never a traceback.

``stop_on_signals`` turns them into ``Interrupted`` within a block (the whole command, in
prep/cli.py; the run's output folder, in prep.jobs.claim.claim, whose swap and clean-up hold
them until they end; the answers file of train.predict.queries); ``StopSoftly`` only notes
the first (train's loop finishes its step and saves), a second aborts; ``signals_blocked``
blocks them while workers and threads start; ``exit_on_interrupt`` is the commands' end of
it, the one line and the exit status.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the run; ``str(e)`` is the one line the CLI prints."""

    def __init__(self, signum: int, out: Path | None = None, published: bool = False,
                 command: str = "prep shards"):
        super().__init__(signum)
        self.signum, self.out, self.published, self.command = signum, out, published, command

    def __str__(self) -> str:
        name, cmd = signal.Signals(self.signum).name, self.command
        if self.out is None:
            return f"{cmd}: stopped by {name}"
        if self.published:
            return f"{cmd}: stopped by {name} just after publishing {self.out}"
        return (f"{cmd}: stopped by {name}; the unfinished output was removed and "
                f"{self.out} holds what it held before")


@contextlib.contextmanager
def exit_on_interrupt(command: str = "prep shards"):
    """A command's body: Interrupted (or a KeyboardInterrupt that came before or after the
    handlers) is its one line on stderr and exit status 128 + the signal."""
    try:
        yield
    except KeyboardInterrupt as e:
        if not isinstance(e, Interrupted):
            e = Interrupted(signal.SIGINT, command=command)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)


class Guard:
    """SIGINT/SIGTERM → Interrupted, once; later ones, and those while ``defer`` is set
    (the swap, the clean-up), wait in ``pending`` for the end of the guarded block."""

    def __init__(self, out: Path | None, command: str = "prep shards"):
        self.out, self.defer, self.pending, self.published = out, False, 0, False
        self.command = command

    def handler(self, signum, frame):
        if self.defer:
            self.pending = self.pending or signum
            return
        self.defer = True  # the clean-up that follows runs undisturbed
        raise Interrupted(signum, self.out, command=self.command)


@contextlib.contextmanager
def stop_on_signals(out: Path | None = None, command: str = "prep shards"):
    """Within the block SIGINT and SIGTERM raise Interrupted (in the main thread only:
    elsewhere Python cannot set handlers, and the block runs as it is)."""
    guard = Guard(out, command)
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    old = {s: signal.signal(s, guard.handler) for s in _STOP_SIGNALS}
    try:
        yield guard
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if guard.pending:  # held during the swap or the clean-up: honoured now
        raise Interrupted(guard.pending, out, guard.published, command)


class StopSoftly:
    """Within the block the first SIGINT or SIGTERM sets ``requested`` and ``signum`` (the
    code looks at them when it can stop cleanly); a second raises KeyboardInterrupt."""

    def __enter__(self):
        self.requested, self.signum = False, None
        self._prev = {}
        if threading.current_thread() is threading.main_thread():
            self._prev = {s: signal.signal(s, self._handle) for s in _STOP_SIGNALS}
        return self

    def _handle(self, signum, _frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    def __exit__(self, *exc):
        for s, prev in self._prev.items():
            signal.signal(s, prev)


@contextlib.contextmanager
def signals_blocked():
    """SIGINT and SIGTERM blocked in this thread: processes forked and threads started
    meanwhile inherit the mask (workers unblock them once their own handlers are set; a
    helper thread keeps it, so these signals wake the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
