"""What two or more test modules use: the checkout's paths, the one-line error every command
ends with, a read-only file system faked below one folder, the processes a run leaves, small
measurement inputs whose contents you can predict, the tiny training run of
tests/test_train.py and tests/test_run_*.py, and the dataset and commands of the latter.

Test modules import it as ``from helpers import ...`` (pytest puts tests/ on sys.path);
no test module imports another. Fixtures shared the same way live in tests/conftest.py.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordReader
from click.testing import CliRunner

from prep.pack.contexts import ContextConfig, plan_contexts
from prep.pack.packing import pack
from prep.schema import manifest as mf
from prep.schema import rows
from prep.schema.measurements import Measurements
from prep.shards.bucket import ShardsConfig, assemble_rows
from prep.tokens.decode import decode_context
from prep.tokens.kernel import encode_pieces
from prep.tools import synthetic_shards as synthetic

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


# --- one line, exit 2 ---------------------------------------------------------------------

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


# --- a read-only file system --------------------------------------------------------------

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


# --- processes ----------------------------------------------------------------------------

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


def python_c(script: str, *args, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """``python -c SCRIPT ARGS`` on the checkout, JAX on the CPU (``env``: more variables);
    its output captured."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --- small datasets: measurements, rows, a dataset's bytes --------------------------------

T0 = 1_767_225_600  # 2026-01-01: probe_data and tiny_input start here


def write_parquet(path: Path, recs: list[dict]) -> Path:
    cols = {k: [r[k] for r in recs] for k in recs[0]}
    table = pa.table({"event_time": pa.array(cols["event_time"], pa.int64()),
                      "prb_id": pa.array(cols["prb_id"], pa.int64()),
                      "src_addr": cols["src_addr"], "dst_addr": cols["dst_addr"],
                      "ip_version": pa.array(cols["ip_version"], pa.int8()),
                      "rtt": pa.array(cols["rtt"], pa.float64())})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=4096)
    return path


def probe_data(n_probes: int, per_probe: int, seed: int) -> list[dict]:
    """Each probe has its own source address, so a decoded segment names its probe."""
    rng = np.random.default_rng(seed)
    recs = []
    for p in range(1, n_probes + 1):
        v6 = p % 3 == 0
        src = f"2001:db8::{p:x}" if v6 else f"10.0.{p // 256}.{p % 256}"
        t = T0 + int(rng.integers(0, 3600))
        for _ in range(per_probe):
            t += int(rng.choice([60, 240, 300, 4000]))
            dst = f"2001:500::{rng.integers(1, 6)}" if v6 else f"193.0.14.{rng.integers(1, 6)}"
            rtt = -1.0 if rng.random() < 0.2 else float(rng.uniform(1, 300))
            recs.append({"event_time": t, "prb_id": p, "src_addr": src, "dst_addr": dst,
                         "ip_version": 6 if v6 else 4, "rtt": rtt})
    return recs


def read_split(d: Path, split: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    m = mf.load_manifest(d)
    out = []
    for path in mf.shard_paths(m, d, split):
        r = ArrayRecordReader(str(path))
        for rec in r.read_all():
            tok, seg = rows.decode_row(rec)
            out.append((path.name, tok, seg))
        r.close()
    return out


def decoded_segments(d: Path, split: str):
    for name, tok, seg in read_split(d, split):
        for sid in range(1, int(seg.max()) + 1):
            yield name, decode_context(tok[seg == sid].tolist())


# tiny_input's rows you can count by hand, in one bucket, all in train
TINY_CFG = ShardsConfig(row_len=64, n_buckets=1, test_fraction=0.0, mode_weights=(1.0, 0.0, 0.0))


def tiny_input(tmp_path: Path) -> Path:
    def rec(t, prb, src, rtt, dst="193.0.14.129", v=4):
        return {"event_time": T0 + t, "prb_id": prb, "src_addr": src, "dst_addr": dst,
                "ip_version": v, "rtt": rtt}
    return write_parquet(tmp_path / "in" / "tiny.parquet", [
        # IPv4 ping: START + 2 x (4 bytes + tag) + RTT (3) = 14 tokens, FAILED instead: 12;
        # full timestamps: the first absolute (+9), later ones 1-byte deltas (+2).
        rec(0, 3, "192.0.2.3", 5.0), rec(60, 3, "192.0.2.3", 6.0),
        rec(120, 3, "192.0.2.3", 7.0),  # 23 + 16 + 16 = 55
        rec(0, 1, "192.0.2.1", 10.0), rec(60, 1, "192.0.2.1", 20.0),  # 23 + 16 = 39
        rec(0, 2, "192.0.2.2", -1.0),  # 12 + 9 = 21
        rec(0, 4, "", 1.0),  # rejected: empty_src_addr
        rec(0, 4, "192.0.2.4", float("nan")),  # rejected: bad_rtt
        rec(0, 4, "192.0.2.4", 1.0, dst="2001:db8::1"),  # rejected: family_mismatch
    ])


def tree_bytes(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != mf.MANIFEST_NAME}


def manifest_sans_timing(d: Path) -> dict:
    m = json.loads((d / mf.MANIFEST_NAME).read_text())
    return {k: v for k, v in m.items() if k not in ("elapsed_s", "timing")}


def dataset_bytes(d: Path) -> dict[str, bytes]:
    """manifest.json, train/*, test/*: what a reader reads."""
    files = [d / mf.MANIFEST_NAME] + sorted(d.glob("train/*")) + sorted(d.glob("test/*"))
    return {str(p.relative_to(d)): p.read_bytes() for p in files if p.is_file()}


# a short row keeps grammar's plain-Python twin fast and still packs several contexts a row
PIPELINE_L = 256


def pipeline_rows(seed: int, n: int = 3000, probes: int = 12):
    """(tokens, segment_ids, measurements) of rows written by the real tokenizer and packer."""
    rng = np.random.default_rng(seed)
    probe = rng.integers(1, probes + 1, n).astype(np.uint64)
    v6 = (probe % 3 == 0)
    m = Measurements(
        probe=probe, time=(1_767_225_600 + rng.integers(0, 3 * 86_400, n)).astype(np.int64),
        family=np.where(v6, 6, 4).astype(np.uint8),
        src_hi=np.where(v6, rng.integers(0, 2**63, n), 0).astype(np.uint64),
        src_lo=rng.integers(0, 2**32, n).astype(np.uint64),
        dst_hi=np.where(v6, rng.integers(0, 2**63, n), 0).astype(np.uint64),
        dst_lo=rng.integers(0, 2**32, n).astype(np.uint64),
        rtt=np.where(rng.random(n) < 0.2, -1.0, rng.uniform(0.01, 900, n)))
    plan = plan_contexts(m, ContextConfig(row_len=PIPELINE_L, max_gap_s=3_600), seed)
    packing = pack(plan.ctx_start, plan.ctx_end, plan.cost, plan.has_ts, plan.abs_extra,
                   row_len=PIPELINE_L)
    tokens, offsets = encode_pieces(plan.sorted, plan, packing.piece_start, packing.piece_end, seed)
    block = assemble_rows(tokens, offsets, packing.piece_row, packing.n_rows, PIPELINE_L)
    tok = np.ascontiguousarray(block[:, 16:16 + 2 * PIPELINE_L]).view("<u2")
    seg = np.ascontiguousarray(block[:, 16 + 2 * PIPELINE_L:])
    return tok, seg, n


# --- the tiny training run ----------------------------------------------------------------

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


def assert_same_end(run_a, run_b) -> None:
    """The two runs' latest checkpoints hold the same data state and, bit for bit, the same
    parameters."""
    import jax

    (pa_, da), (pb, db) = final_params(run_a), final_params(run_b)
    assert da == db
    for x, y in zip(jax.tree.leaves(pa_), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y)


# --- a run's faults (tests/test_run_*.py): a tiny dataset, the commands in this process ---

def write_dataset(d: Path, seed: int = 0, *, test_rows: int = 8,
                  rows_per_shard: int = 24) -> Path:
    """64 train rows of 64 tokens in shards of ``rows_per_shard`` records (24: 24, 24 and
    16); ``test_rows`` test rows."""
    synthetic.write_shards(d, {"train": synthetic.counting_rows(64, 64, seed=seed),
                               "test": synthetic.counting_rows(test_rows, 64, seed=seed + 1)},
                           rows_per_shard=rows_per_shard)
    return d


def step_dirs(d: Path) -> list[int]:
    """Checkpoint steps on disk (step folders, intact or not)."""
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def stop_at(step, sig=signal.SIGINT):
    """An on_step for train(): the signal to this process at that step."""
    return lambda s: s == step and os.kill(os.getpid(), sig)


# a tiny run as `train` flags: small()'s model and optimizer (the step it compiles is
# shared), a log line every 5 steps, no eval, no checkpoint (the last flag's value)
FLAGS = ["--model", "tiny", "--steps", "20", "--batch-size", "4", "--lr", "3e-3",
         "--warmup", "3", "--log-every", "5", "--eval-every", "0", "--ckpt-every", "0"]


def fit(args):
    """`train ARGS`, run in this process (click's CliRunner)."""
    from train.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def prep(args):
    """`prep ARGS`, run in this process."""
    from prep.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])
