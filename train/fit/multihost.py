"""`train` on several hosts: one JAX process per host (or per GPU), training one model.

    host A:  train --distributed --coordinator 10.0.0.1:5555 --num-processes 2 --process-id 0
    host B:  train --distributed --coordinator 10.0.0.1:5555 --num-processes 2 --process-id 1

(or none where jax.distributed finds them: SLURM, Open MPI, Kubernetes, JAX_*; ``Hosts``).

What changes with several processes (train.fit.loop, runfolder, reader, checkpoint):

1. The mesh spans every device of every process; each process reads its own contiguous
   slice of each global batch (reader.EpochKeys) and puts it on its own devices, so the
   run is the one a single process with as many devices would make.
2. Process 0 alone writes the run folder's files of its own (RUN_DIR/.lock, config.json,
   metrics.jsonl, checkpoint digests) and logs; Orbax saves the checkpoint with every
   process (the folder must be one every host sees: a shared file system). A refusal that
   only one process can see (the run lock) reaches every process (``check_all``), and
   the processes hold their settings and their dataset's fingerprint to process 0's
   (``gather``, train.fit.runfolder.check_agree) before anything else.
3. A signal (Ctrl-C, a scheduler's SIGTERM) on any process stops every process after the
   same step, with one checkpoint (``StopVote``).
4. A process that dies, or is silent for ``--heartbeat-timeout`` seconds, stops the others.
   jax's coordination client then aborts them with a C++ stack trace, so the trainer runs
   as the child of a supervisor (``supervise``) that makes that one line and exit 2,
   forwards SIGINT/SIGTERM, and takes the trainer with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading

from prep.base.errors import InputError, first_line

CHILD_ENV = "PING_PACK_TRAINER"  # "PID:FD" (the supervisor, its log pipe) for the trainer
KEY = "ping-pack"  # prefix of this program's keys in the coordinator's key-value store


@dataclasses.dataclass(frozen=True)
class Hosts:
    """Where this process stands among the run's processes. None: jax.distributed detects
    it (cluster environments); the flags win over ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``."""

    coordinator: str | None = None  # HOST:PORT of process 0's coordination service
    num_processes: int | None = None
    process_id: int | None = None
    join_timeout: int = 300  # seconds to wait for every process to join (jax's default)
    heartbeat_timeout: int = 100  # seconds without a heartbeat before a process counts as dead

    @property
    def who(self) -> str:
        if self.process_id is None:
            return "this process"
        return f"process {self.process_id}" + (f" of {self.num_processes}"
                                               if self.num_processes else "")


ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
FLAG = {"coordinator": "--coordinator", "num_processes": "--num-processes",
        "process_id": "--process-id"}


def resolve(*, coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, join_timeout: int = 300,
            heartbeat_timeout: int = 100, environ=None) -> Hosts:
    """The flags, else the environment variables; InputError (one line) for values that
    cannot work."""
    environ = os.environ if environ is None else environ
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    for k, v in given.items():
        if v is None and environ.get(ENV[k], "").strip():
            v = environ[ENV[k]].strip()
            if k != "coordinator":
                try:
                    v = int(v)
                except ValueError:
                    raise InputError(f"{ENV[k]}={v!r}: not a whole number") from None
            given[k] = v
    c, n, i = given["coordinator"], given["num_processes"], given["process_id"]
    if c is not None:
        host, sep, port = c.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(f"--coordinator {c}: not HOST:PORT (process 0's address and a "
                             "free port every process can reach, e.g. 10.0.0.1:5555)")
    if n is not None and n < 1:
        raise InputError(f"--num-processes {n}: at least 1")
    if i is not None and (i < 0 or (n is not None and i >= n)):
        raise InputError(f"--process-id {i}: one of 0..{n - 1} for {n} processes"
                         if n is not None else f"--process-id {i}: 0 or more")
    for name, t in (("--join-timeout", join_timeout), ("--heartbeat-timeout", heartbeat_timeout)):
        if t < 1:
            raise InputError(f"{name} {t}: at least 1 second")
    return Hosts(c, n, i, join_timeout, heartbeat_timeout)


def initialize(hosts: Hosts) -> None:
    """jax.distributed.initialize with these settings (before anything asks jax for
    devices); InputError (one line) if the processes do not come together."""
    import jax

    # jax's CPU collectives across processes (its default since 0.4.3x; named so that an
    # older default of none does not turn a CPU run into one that cannot all-reduce)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    global _WAIT_MS, _joined
    _WAIT_MS = 1000 * hosts.join_timeout
    try:
        jax.distributed.initialize(hosts.coordinator, hosts.num_processes, hosts.process_id,
                                   initialization_timeout=hosts.join_timeout,
                                   heartbeat_timeout_seconds=hosts.heartbeat_timeout)
    except (ValueError, TypeError):  # not given, and no cluster environment to read
        missing = [k for k in ENV if getattr(hosts, k) is None]
        raise InputError(f"--distributed: no {', no '.join(FLAG[k] for k in missing)} given, "
                         "and jax found no cluster environment (SLURM, Open MPI, Kubernetes, "
                         f"Cloud TPU) to read them from; pass them (or set "
                         f"{', '.join(ENV[k] for k in missing)})") from None
    except Exception as e:  # the coordinator unreachable, a process that never came
        raise InputError(join_message(hosts, short_reason(e))) from None
    _joined = True


def join_message(hosts: Hosts, detail: str) -> str:
    """The one line of a process that could not join the others."""
    return (f"--distributed: {hosts.who} could not join the run at "
            f"{hosts.coordinator or 'the detected coordinator'} within {hosts.join_timeout} s "
            f"({detail}); start `train --distributed` on every host with the same "
            "--coordinator and --num-processes, or raise --join-timeout")


def count() -> int:
    import jax

    return jax.process_count()


def index() -> int:
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """Process 0: the one that writes the run folder's own files and logs."""
    return index() == 0


def _client():
    from jax._src.distributed import global_state

    return global_state.client


_WAIT_MS = 300_000  # how long an exchange waits for the other processes (--join-timeout)
_joined = False  # jax.distributed.initialize succeeded


def check_all(name: str, error: str | None) -> None:
    """Raise on every process when ``error`` (a refusal, or None) is set on any: the
    process's own, else "process P: ERROR" of the first process that had one. ``name``
    keys this one exchange (use each name once per run)."""
    n = count()
    if n == 1:
        if error:
            raise InputError(error)
        return
    client, me = _client(), index()
    client.key_value_set(f"{KEY}/{name}/{me}", "!" + error if error else "ok")
    said = [client.blocking_key_value_get(f"{KEY}/{name}/{p}", _WAIT_MS) for p in range(n)]
    if error:
        raise InputError(error)
    for p, v in enumerate(said):
        if v != "ok":
            raise InputError(f"process {p}: {v[1:]}")


def gather(name: str, value: str) -> list[str]:
    """Every process's ``value``, in process order (``[value]`` with one process); ``name``
    keys this one exchange (use each name once per run)."""
    n = count()
    if n == 1:
        return [value]
    client = _client()
    client.key_value_set(f"{KEY}/{name}/{index()}", value)
    return [client.blocking_key_value_get(f"{KEY}/{name}/{p}", _WAIT_MS) for p in range(n)]


_barriers = 0


def sync(name: str) -> None:
    """Wait until every process is here (nothing with one process)."""
    global _barriers
    if count() > 1:
        _barriers += 1
        _client().wait_at_barrier(f"{KEY}/{name}/{_barriers}", _WAIT_MS)


class StopVote:
    """Where every process stops after a signal on any one.

    A process stopped at loop step k (k steps dispatched, k-1 finished) posts "stop after
    step k + 2"; every process reads the posts at every step. No process can be past step
    k + 1 by then (each step's all-reduce waits for every process, and a process runs at
    most one step ahead of its device), so all of them reach k + 2 and stop there, the
    earliest post winning. One process: stop at once."""

    def __init__(self):
        self.n = count()
        self.target, self.signum, self._posted = None, None, False

    def target_for(self, step: int, requested: bool, signum: int | None) -> int | None:
        """The step to stop after, or None to go on."""
        if self.n == 1:
            if requested:
                self.target, self.signum = step, signum
            return self.target
        client = _client()
        if requested and not self._posted:
            client.key_value_set(f"{KEY}/stop/{index()}", f"{step + 2} {signum}")
            self._posted = True
        posts = client.key_value_dir_get(f"{KEY}/stop/")
        if posts:
            self.target, self.signum = min(tuple(map(int, v.split())) for _, v in posts)
        return self.target


def leave(code: int, error: str | None = None, *, together: bool = False) -> None:
    """End this trainer now (flushed), without jax's shutdown barrier: after an error the
    other processes may never reach it, and would hold this one there for minutes. (`train
    eval` and `train predict` stopped by a signal end here too: an XLA compile the signal
    cut short goes on in its thread, and Python's shutdown under it crashes.)
    ``error`` goes to stderr as "error: ..." in one write (the supervisor reads it whole
    even when the coordination client's abort is writing beside it). ``together``: an
    error the other processes meet too (a refusal, ``check_all``) waits up to a few
    seconds for them to get here, so that none is cut off by process 0's coordinator
    going away before it has said its own line."""
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    if error is not None:
        os.write(sys.stderr.fileno(), f"error: {error}\n".encode())
    if together and _joined:
        with contextlib.suppress(Exception):  # gone already, or not leaving: go on
            _client().wait_at_barrier(f"{KEY}/leave", 5000)
    os._exit(code)


# Peer trouble as the collectives and the coordination client word it
_LOST = re.compile(r"gloo|connection (closed|reset|refused)|heartbeat|coordination service|"
                   r"barrier|UNAVAILABLE|DEADLINE_EXCEEDED|socket closed|peer", re.IGNORECASE)


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective or coordination failure (another process gone)."""
    return bool(_LOST.search(str(e)))


def short_reason(e: BaseException) -> str:
    """A collective's or the coordination client's error in a few words: "Gloo all-reduce
    failed: Connection reset by peer" (no source locations, status codes or addresses)."""
    text = re.sub(r"\[[^\]]*\]:?\d*:?|\b[A-Z_]{6,}: ", "", first_line(e, width=None))
    parts = [p.strip() for p in text.split(":") if p.strip()]
    return re.sub(r"\s+", " ", ": ".join(parts[:1] + parts[-1:] if len(parts) > 1 else parts))[:160]


def lost_message(hosts: Hosts, detail: str = "") -> str:
    """The one line of a process whose peers are gone."""
    why = f" ({detail})" if detail else ""
    return (f"{hosts.who}: another process of the run died or stopped answering{why}; this "
            f"one stopped too. Resume from the last checkpoint: the same `train "
            f"--distributed ... --resume` on every host")


# ---- the supervisor (the `train` process the user started; no jax in it) -----------------

# a line of XLA's C++ log (absl/glog: severity, date, time, thread, file:line); F = fatal,
# after which the coordination client aborts the process
_CPP_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def supervised() -> bool:
    """True in the trainer that ``supervise`` started. From then on it dies with its
    supervisor (Linux: PR_SET_PDEATHSIG), so killing `train` kills the trainer too, and
    what is written to file descriptor 2 (XLA's C++ log) goes to the supervisor's filter
    while Python's ``sys.stderr`` keeps the stderr pipe of its own."""
    parent, _, log_fd = os.environ.get(CHILD_ENV, "").partition(":")
    if not (parent.isdigit() and log_fd.isdigit()):
        return False
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # it died before that
        os._exit(2)
    if sys.stderr is not None and sys.stderr.fileno() == 2:  # once
        sys.stderr.flush()
        sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, errors="backslashreplace")
        os.dup2(int(log_fd), 2)
        os.close(int(log_fd))
    return True


def _fatal_reason(text: str, hosts: Hosts) -> str:
    if "Failed to send RPC to coordination service" in text or "Socket closed" in text:
        return f"the coordinator{' ' + hosts.coordinator if hosts.coordinator else ''} " \
               "(process 0) is gone"
    m = re.search(r"following tasks are unhealthy[^\n]*\n\s*([\d,\s]+)", text)
    if m:
        ids = ", ".join(x for x in re.split(r"[\s,]+", m.group(1)) if x)
        return f"process {ids} sent no heartbeat for {hosts.heartbeat_timeout} s"
    if "heartbeat" in text:
        return f"a process sent no heartbeat for {hosts.heartbeat_timeout} s"
    return "the coordination service reported a failed process"


def _write(stream, data: bytes) -> None:
    out = getattr(stream, "buffer", None)
    if out is None:
        stream.write(data.decode(errors="replace"))
    else:
        out.write(data)
    stream.flush()


def _pass_stdout(pipe) -> None:
    """The trainer's stdout, but for Gloo's "[Gloo] Rank 0 is connected to 1 peer ranks"."""
    for line in iter(pipe.readline, b""):
        if not line.startswith(b"[Gloo] "):
            _write(sys.stdout, line)


def _filter_log(fd: int, fatal: list[bytes], show_log: bool) -> None:
    """XLA's C++ log from the trainer's file descriptor 2: a message (one write, its
    continuation lines included) is dropped unless ``show_log``; a fatal one and all
    after it (the abort's stack trace) go to ``fatal``. Lines from other writers (a
    worker process's) pass."""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            in_log = False
            for line in chunk.splitlines(keepends=True):
                m = _CPP_LOG.match(line)
                if fatal or (m and line[:1] == b"F"):
                    fatal.append(line)
                    continue
                in_log = in_log or bool(m)
                if show_log or not in_log:
                    _write(sys.stderr, line)


def supervise(hosts: Hosts, args: list[str]) -> int:
    """Run this same command as the trainer, ``CHILD_ENV`` set, and return its exit code:
    this program again (``sys.orig_argv``) when ``args`` (what `train` was given) are its
    command line, else `python -m train.cli ARGS` (`train` called from Python).

    Its output passes through, but for Gloo's greeting and XLA's own C++ log (shown with
    ``TF_CPP_MIN_LOG_LEVEL=0``); the abort by jax's coordination client (a peer is
    gone) becomes one line and exit 2. SIGINT and SIGTERM go to it (once each: it runs in
    a session of its own, out of reach of the terminal's Ctrl-C)."""
    if sys.argv[1:] == args:
        argv = [sys.executable, *sys.orig_argv[1:]]
    else:
        argv = [sys.executable, "-m", "train.cli", *args]
    log_r, log_w = os.pipe()
    env = dict(os.environ, **{CHILD_ENV: f"{os.getpid()}:{log_w}", "PYTHONUNBUFFERED": "1"})
    child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             pass_fds=(log_w,), start_new_session=True)
    os.close(log_w)
    fatal: list[bytes] = []
    relays = [threading.Thread(target=_pass_stdout, args=(child.stdout,), daemon=True),
              threading.Thread(target=_filter_log, daemon=True,
                               args=(log_r, fatal, os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0"))]
    for t in relays:
        t.start()

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    said_error = False
    try:
        for line in iter(child.stderr.readline, b""):  # the trainer's Python stderr
            said_error = said_error or line.startswith(b"error: ")
            _write(sys.stderr, line)
        code = child.wait()
        for t in relays:
            t.join(timeout=10)
    finally:
        child.stderr.close()
        if not relays[0].is_alive():
            child.stdout.close()
        for s, h in previous.items():
            signal.signal(s, h)
    fatal = b"".join(fatal).decode(errors="replace")
    if said_error:  # the trainer said why (and may have been aborted on its way out)
        return code if code > 0 else 2
    if code >= 0 and not fatal:
        return code
    if "RegisterTask" in fatal:  # aborted in jax.distributed.initialize
        why = ("it runs the coordinator; not every other process joined it" if
               hosts.process_id == 0 else "no coordinator answered")
        print(f"error: {join_message(hosts, why)}", file=sys.stderr)
    elif fatal:
        print(f"error: {lost_message(hosts, _fatal_reason(fatal, hosts))}", file=sys.stderr)
    else:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        print(f"error: {hosts.who}: the trainer (pid {child.pid}) was killed by {name}; the "
              "other processes stop too. Resume from the last checkpoint: the same `train "
              "--distributed ... --resume` on every host", file=sys.stderr)
    return 2
