"""What two or more test modules use: the checkout's paths, the one-line error every command
ends with, a read-only file system faked below one folder, the processes a run leaves, and
the tiny training run of tests/test_train.py and tests/test_run_safety.py.

Test modules import it as ``from helpers import ...`` (pytest puts tests/ on sys.path);
no test module imports another. Fixtures shared the same way live in tests/conftest.py.
"""

import errno
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREP = REPO / ".venv" / "bin" / "prep"
# the real RIPE Atlas sample (38 files, 7,725 results; its README says where each came
# from), shipped with the tests so that a clone without ../shared runs the same suite
ATLAS = REPO / "tests" / "fixtures" / "ripe-atlas"
# XLA's CPU compiler without its costly LLVM passes: a third of the compile time, and the
# same flags for every run compared (the XLA_FLAGS of the `train` processes tests start)
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# Beam's local runner with worker processes: what a cluster runner does, on this machine
TWO_PROCESSES = ["direct_running_mode=multi_processing", "direct_num_workers=2"]


# --- one line, exit 2 ------------------------------------------------------------------

def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def one_line_error(r, *words: str) -> str:
    """A CliRunner result, a CompletedProcess or a stderr string: exactly one error line,
    holding ``words``, and no traceback. The exit code is the caller's to check."""
    err = r if isinstance(r, str) else r.stderr if hasattr(r, "stderr") else r.output
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def exit_2_one_line(result, *words: str) -> str:
    """A CliRunner result: exit code 2 and one_line_error's one line, the last on stderr."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    line = one_line_error(result, *words)
    assert [x for x in result.stderr.splitlines() if x.strip()][-1] == line, result.stderr
    return line


# --- a read-only file system -------------------------------------------------------------

@contextmanager
def read_only(monkeypatch, folder: Path):
    """Inside the block, ``folder`` and all below it are a read-only mount, as root sees it
    too: opening a file to write or making a folder fails with EROFS (EEXIST first where
    the path exists, as Linux answers)."""
    real_open, real_mkdir = os.open, os.mkdir
    inside = lambda p: str(Path(p).absolute()).startswith(str(folder))  # noqa: E731

    def ro_open(path, flags, *a, **k):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **k)

    def ro_mkdir(path, *a, **k):
        if inside(path):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "File exists", str(path))
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(os, "open", ro_open)
        m.setattr(os, "mkdir", ro_mkdir)
        yield


# --- processes ---------------------------------------------------------------------------

def wait_for(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        kids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(stat.parent.name))
        return kids


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --- datasets and tiny training runs -----------------------------------------------------

def dataset_bytes(d: Path) -> dict[str, bytes]:
    """manifest.json, train/*, test/*: what a reader reads."""
    from prep.schema import manifest as mf

    files = [d / mf.MANIFEST_NAME] + sorted(d.glob("train/*")) + sorted(d.glob("test/*"))
    return {str(p.relative_to(d)): p.read_bytes() for p in files if p.is_file()}


def small(data, run_dir, **kw):
    """A tiny run's config: 20 steps of 4 rows, a metrics line a step, no eval or checkpoint."""
    from train.fit.config import TrainConfig

    base = dict(data=str(data), run_dir=str(run_dir), steps=20, batch_size=4, lr=3e-3,
                warmup=3, log_every=1, eval_every=0, ckpt_every=0)
    return TrainConfig(**{**base, **kw})


def records(run_dir):
    """The run's metrics.jsonl, a dict a line."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def final_params(run_dir):
    """The params and data state of the run's latest checkpoint."""
    from train.fit.checkpoint import Checkpointer

    ck = Checkpointer(Path(run_dir) / "checkpoints")
    state, data = ck.restore(ck.latest_step())
    ck.close()
    return state["params"], data
