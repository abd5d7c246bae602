"""The Grain reader: exact rows, seeded global shuffle, per-process slices, resumable state."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import REPO, running

from prep.base.errors import InputError
from prep.schema import manifest as manifest_lib
from prep.schema.rows import RowFormatError
from prep.tools import synthetic_shards as synthetic
from train.cli import main
from train.fit import reader

N_ROWS, ROW_LEN, BATCH = 40, 32, 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("reader") / "shards"
    train = synthetic.counting_rows(N_ROWS, ROW_LEN, seed=0)
    test = synthetic.counting_rows(8, ROW_LEN, seed=1)
    synthetic.write_shards(d, {"train": train, "test": test}, rows_per_shard=15)  # 3 shards
    return d, train


def rows_of(batches):
    return [(t.tobytes(), s.tobytes()) for b in batches for t, s in zip(b["tokens"], b["segment_ids"])]


def take(it, n):
    return [next(it) for _ in range(n)]


def test_counting_rows_are_what_the_docstring_says():
    tokens, segs = synthetic.counting_rows(3, 16, seed=0, max_segments=3, pad=3)
    assert (segs[:, -3:] == 0).all() and (tokens[:, -3:] == 0).all()
    for r in range(3):
        for k in range(1, segs[r].max() + 1):
            seg = tokens[r][segs[r] == k]
            np.testing.assert_array_equal(seg, r * 7 + (k - 1) + np.arange(len(seg)))


def test_one_epoch_is_every_row_once_in_a_seeded_order(shards):
    d, (tokens, segs) = shards
    it = iter(reader.batches(d, "train", batch_size=BATCH, seed=0))
    epoch = take(it, N_ROWS // BATCH)
    b = epoch[0]
    assert b["tokens"].dtype == np.uint16 and b["segment_ids"].dtype == np.uint8
    assert b["tokens"].shape == b["segment_ids"].shape == (BATCH, ROW_LEN)
    got = rows_of(epoch)
    want = [(t.tobytes(), s.tobytes()) for t, s in zip(tokens, segs)]
    assert sorted(got) == sorted(want)
    assert got != want  # shuffled
    again = rows_of(take(iter(reader.batches(d, "train", batch_size=BATCH, seed=0)), 10))
    other = rows_of(take(iter(reader.batches(d, "train", batch_size=BATCH, seed=1)), 10))
    assert again == got and other != got
    second = rows_of(take(it, N_ROWS // BATCH))  # the next epoch: same rows, a new order
    assert sorted(second) == sorted(want) and second != got


def test_eval_reads_in_file_order_once(shards):
    d, _ = shards
    m = manifest_lib.load_manifest(d)
    test = synthetic.counting_rows(8, ROW_LEN, seed=1)
    got = list(reader.batches(d, "test", batch_size=4, seed=0, train=False))
    assert len(got) == 2
    np.testing.assert_array_equal(np.concatenate([b["tokens"] for b in got]), test[0])
    assert reader.max_segments(m) == int(max(test[1].max(), shards[1][1].max()))


def test_processes_read_their_half_of_each_global_batch(shards):
    d, _ = shards
    n = N_ROWS // BATCH + 3  # past the end of the first epoch
    parts = [take(iter(reader.batches(d, "train", batch_size=BATCH // 2, seed=0,
                                      process_index=p, process_count=2)), n)
             for p in range(2)]
    whole = take(iter(reader.batches(d, "train", batch_size=BATCH, seed=0)), n)
    for b in range(n):  # process p holds rows [p*B/2, (p+1)*B/2) of global batch b, in order:
        # what device p of a 2-device mesh holds, so the run does not depend on the split
        for k in ("tokens", "segment_ids"):
            np.testing.assert_array_equal(
                np.concatenate([parts[0][b][k], parts[1][b][k]]), whole[b][k])
    assert not set(rows_of(parts[0][:10])) & set(rows_of(parts[1][:10]))


def test_iterator_state_resumes_exactly(shards):
    d, _ = shards
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    it = iter(reader.to_device(reader.batches(d, "train", batch_size=BATCH, seed=3), sharding))
    assert isinstance(take(it, 7)[-1]["tokens"], jax.Array)
    state = json.loads(json.dumps(it.get_state()))  # what the checkpoint stores
    expect = [np.asarray(b["tokens"]) for b in take(it, 6)]
    it.close()
    it2 = iter(reader.to_device(reader.batches(d, "train", batch_size=BATCH, seed=3), sharding))
    it2.set_state(state)
    got = [np.asarray(b["tokens"]) for b in take(it2, 6)]
    it2.close()
    assert len(got) == 6
    for a, b in zip(got, expect):
        np.testing.assert_array_equal(a, b)


def test_mp_prefetch_gives_the_same_batches(shards):
    d, _ = shards
    base = rows_of(take(iter(reader.batches(d, "train", batch_size=BATCH, seed=0)), 6))
    it = iter(reader.batches(d, "train", batch_size=BATCH, seed=0, num_workers=1))
    try:
        assert rows_of(take(it, 6)) == base
    finally:
        it.close()


KEEP_READING = """
import os, sys, time
from train.fit import reader
it = iter(reader.batches(sys.argv[1], "train", batch_size=4, seed=0, num_workers=2))
next(it)
print("reading", flush=True)
time.sleep(300)
"""


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = {int(x) for x in (task / "children").read_text().split()}
                todo.extend(kids - out)
                out |= kids
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_grain_workers_die_with_a_killed_trainer(shards):
    """#36 item 19: SIGKILL (the OOM killer) left the Grain workers and the resource
    tracker running for minutes (~200 MB each)."""
    d, _ = shards
    p = subprocess.Popen([sys.executable, "-c", KEEP_READING, str(d)], stdout=subprocess.PIPE,
                         text=True, env=os.environ | {"JAX_PLATFORMS": "cpu",
                                                      "PYTHONPATH": str(REPO)})
    try:
        assert p.stdout.readline() == "reading\n"
        helpers = _descendants(p.pid)
        assert len(helpers) >= 3  # 2 workers and multiprocessing's resource tracker
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while any(map(running, helpers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [h for h in helpers if running(h)] == []
    finally:
        p.kill()
        for h in _descendants(p.pid) if p.poll() is None else ():
            os.kill(h, signal.SIGKILL)


def test_refuses_folder_without_manifest(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(InputError, match="no manifest.json.*run `prep shards"):
        reader.open_shards(tmp_path)


def test_refuses_other_format_version(shards, tmp_path):
    d, _ = shards
    m = json.loads((d / "manifest.json").read_text())
    m["format_version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError, match="format version 99.*re-run `prep shards`"):
        reader.open_shards(tmp_path)


def test_damaged_record_names_shard_and_record(tmp_path):
    tokens, segs = synthetic.counting_rows(6, ROW_LEN)
    synthetic.write_shards(tmp_path, {"train": (tokens, segs)}, rows_per_shard=3)
    r = reader.RowReader([tmp_path / "train/synthetic-00000.array_record",
                          tmp_path / "train/synthetic-00001.array_record"], ROW_LEN)
    records = r.source.__getitems__([1, 4])
    bad = records[1][:4] + b"\x09\x00" + records[1][6:]  # format version 9
    with pytest.raises(RowFormatError, match=r"synthetic-00001.array_record#1: row format version 9"):
        r.decode([records[0], bad], np.array([1, 4]))


def test_cli_refusal_is_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["--data", str(tmp_path / "nope"), "--run-dir",
                                       str(tmp_path / "run")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "prep shards" in lines[-1]
    assert "Traceback" not in result.output
