"""The one worker pool of `prep shards`, `prep verify` and `prep import-atlas`.

A ProcessPoolExecutor underneath: unlike multiprocessing.Pool it notices a worker that
dies (SIGKILL from the OOM killer, a signal, a crash), which here becomes ``WorkerDied``
within seconds, naming the worker, how it died and the task it was on (its label: the
file or bucket), never a hang. Workers ignore SIGINT (Ctrl-C reaches the whole process
group; the driver decides), die of SIGTERM, and die with the driver if it is killed
(PR_SET_PDEATHSIG); ``close`` after a failure terminates them and waits until none writes
any more. ``cores()`` counts the cores this process may run on (``os.sched_getaffinity``:
a container's or taskset's share, not the machine's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from prep.base.errors import InputError
from prep.base.lifetime import die_with_parent
from prep.base.signals import signals_blocked


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def mp_context(preload: tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    """Fork (cheap: inherits imports and loaded kernels) unless this process runs Python
    threads or has imported JAX, whose threads may hold locks at fork time (a deadlock);
    then a fork server, which loads the modules ``preload`` once for all its workers."""
    if threading.active_count() == 1 and "jax" not in sys.modules:
        return multiprocessing.get_context("fork")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


class WorkerDied(InputError):
    """A worker process died: ``what`` says how (and on which task), ``oom`` whether it
    was most likely the kernel's out-of-memory killer. Each command adds its own fix."""

    def __init__(self, what: str, oom: bool):
        super().__init__(what)
        self.what, self.oom = what, oom


class Pool:
    """``workers`` processes; ``imap_unordered`` and ``imap`` like multiprocessing.Pool's,
    each task with a label for the error if its worker dies. Use as a context manager:
    leaving it by an exception (a dead worker, Ctrl-C, bad input) stops every worker.
    ``preload``: the modules of the functions it runs (see ``mp_context``)."""

    def __init__(self, workers: int, *, preload: tuple[str, ...] = ()):
        ctx = mp_context(preload)
        parent = os.getpid() if ctx.get_start_method() == "fork" else None
        # Each worker writes the label of the task it starts to a file named by its pid.
        self._labels = Path(tempfile.mkdtemp(prefix="prep-pool-"))
        self._procs: dict[int, multiprocessing.Process] = {}
        # Workers start with SIGINT/SIGTERM blocked: they reach the driver, which decides.
        with signals_blocked():
            self._ex = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=ctx, initializer=_worker_init, initargs=(parent,))
            if parent is not None:  # fork every worker now, before any thread exists
                self._ex.submit(os.getpid)
                self._procs.update(self._ex._processes)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def _submit(self, fn, tasks, labels, order=None) -> list:
        labels = list(labels) if labels is not None else [f"task {i}" for i in range(len(tasks))]
        futures = [None] * len(tasks)
        for i in order if order is not None else range(len(tasks)):
            futures[i] = self._ex.submit(_labelled, fn, tasks[i], labels[i], str(self._labels))
        self._procs.update(self._ex._processes)  # a fork server starts them on demand
        return futures

    def imap_unordered(self, fn, tasks, labels=None):
        """``fn(task)`` of every task, as each finishes."""
        pending = set(self._submit(fn, list(tasks), labels))
        while pending:
            # A timeout, so that SIGINT/SIGTERM are handled promptly in this thread.
            done, pending = concurrent.futures.wait(
                pending, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                yield self._result(f)

    def imap(self, fn, tasks, labels=None, order=None):
        """``fn(task)`` of every task, in the tasks' order; ``order`` is the order they
        are started in (e.g. the biggest first)."""
        for f in self._submit(fn, list(tasks), labels, order):
            while True:
                try:
                    yield self._result(f, timeout=0.5)
                    break
                except concurrent.futures.TimeoutError:
                    continue

    def _result(self, f, timeout=None):
        try:
            return f.result(timeout=timeout)
        except BrokenProcessPool:
            raise self._death() from None

    def _death(self) -> WorkerDied:
        """What happened to the worker that broke the pool."""
        procs = list(self._procs.values())
        _wait([p.sentinel for p in procs], 5)
        # The executor's thread reaps the workers of a broken pool, then ends. Reading an
        # exit code beside it races: under a fork server, a status read twice at once gives
        # one reader the status and the other an empty pipe, which multiprocessing reports
        # as exit code 255 (and keeps): "exited with code 255" for a worker that a signal
        # stopped. So read them once it is done.
        manager = getattr(self._ex, "_executor_manager_thread", None)
        if manager is not None and manager is not threading.current_thread():
            manager.join(timeout=5)
        deadline = time.monotonic() + 2
        while True:  # the executor's thread may be reaping them right now: None until then
            codes = [(p.pid, p.exitcode) for p in procs]
            if all(c is not None for _, c in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # The executor terminates (SIGTERM) the others once one has died: a SIGTERM is the
        # cause only when nothing else is, and then the one that was on a task.
        dead = ([c for c in codes if c[1] not in (None, 0, -signal.SIGTERM)]
                or sorted((c for c in codes if c[1] == -signal.SIGTERM),
                          key=lambda c: self._label_of(c[0]) is None))
        if not dead:
            return WorkerDied("a worker process stopped unexpectedly", False)
        pid, code = dead[0]
        on = self._label_of(pid)
        on = f" while on {on}" if on else ""
        if code > 0:
            return WorkerDied(f"a worker process (pid {pid}) exited with code {code}{on}", False)
        name = signal.Signals(-code).name
        if -code == signal.SIGKILL:
            return WorkerDied(f"a worker process (pid {pid}) was killed by {name}{on}, most "
                              "likely by the kernel's out-of-memory killer", True)
        return WorkerDied(f"a worker process (pid {pid}) was stopped by {name}{on}", False)

    def _label_of(self, pid: int) -> str | None:
        with contextlib.suppress(OSError):
            return (self._labels / str(pid)).read_text() or None
        return None

    def close(self, failed: bool) -> None:
        """Wait for the workers to finish (``failed`` False), or stop them all now."""
        try:
            if not failed:
                self._ex.shutdown(wait=True)
                return
            self._procs.update(self._ex._processes)
            procs = list(self._procs.values())
            self._ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:  # SIGTERM: a worker keeps its default action (_worker_init)
                with contextlib.suppress(Exception):
                    p.terminate()
            # The caller removes what they wrote next: wait until no worker writes.
            alive = [p.sentinel for p in procs]
            _wait(alive, 5)
            for p in procs:
                with contextlib.suppress(Exception):
                    if p.exitcode is None:
                        p.kill()
            _wait(alive, 5)
        finally:
            shutil.rmtree(self._labels, ignore_errors=True)


def _wait(sentinels: list, timeout: float) -> None:
    """multiprocessing.connection.wait, but at once when there is nothing to wait for: on
    an empty list it sleeps the whole timeout (a fork server's pool that failed before it
    started a worker took 10 s to close)."""
    if sentinels:
        multiprocessing.connection.wait(sentinels, timeout=timeout)


def _labelled(fn, task, label: str, labels: str):
    """``fn(task)``, with ``label`` in a file named by this worker's pid meanwhile."""
    mine = Path(labels, str(os.getpid()))
    with contextlib.suppress(OSError):  # the label only names the task in an error
        mine.write_text(label)
    try:
        return fn(task)
    finally:
        with contextlib.suppress(OSError):
            mine.unlink()


def _worker_init(parent: int | None) -> None:
    """A worker's signals: it starts with SIGINT and SIGTERM blocked (they are, while the
    driver forks it: prep.base.signals.signals_blocked) and with the driver's handlers; it
    ignores SIGINT, dies of SIGTERM, and dies with the driver (``parent`` is its pid when
    forked from it). The objects it starts with (the driver's modules, when forked) go to
    the garbage collector's permanent generation: its collections then skip them (they
    were 2 % of `prep shards`' CPU) and leave their pages shared with the driver."""
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))
