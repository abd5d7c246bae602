"""Zero rows written is an error, never a finished-looking empty dataset, and every command
given another command's input names the right one: one line on stderr, exit code 2, no
output: a new --out folder is removed again (import-atlas, synth, prep shards)."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import exit_2_one_line

from prep.cli import main as prep
from prep.ingest.atlas_rows import SCHEMA
from prep.tools import synthetic_shards as synthetic
from train.cli import main as train

EMPTY = (np.zeros((0, 64), np.uint16), np.zeros((0, 64), np.uint8))


def fails(cli, *args):
    return exit_2_one_line(CliRunner().invoke(cli, [*map(str, args)]))


@pytest.fixture
def shards_dir(tmp_path):
    d = tmp_path / "shards"
    (d / "train").mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format": "x"}))
    return d


# --- import-atlas ----------------------------------------------------------------------

def test_import_atlas_given_shards_names_train(shards_dir, tmp_path):
    assert fails(prep, "import-atlas", shards_dir, "--out", tmp_path / "o") == (
        f"error: {shards_dir} is a shards folder (the output of `prep shards`); train on it "
        f"with `train --data {shards_dir}` (or `prep inspect {shards_dir}`)")
    assert not (tmp_path / "o").exists()


def test_import_atlas_given_parquet_names_prep_shards(tmp_path):
    pq.write_table(SCHEMA.empty_table(), tmp_path / "m.parquet")
    assert fails(prep, "import-atlas", tmp_path / "m.parquet", "--out", tmp_path / "o") == (
        f"error: {tmp_path}/m.parquet holds parquet measurements; `prep shards "
        f"{tmp_path}/m.parquet --out shards` makes training shards of it")
    (tmp_path / "pq").mkdir()
    shutil.move(tmp_path / "m.parquet", tmp_path / "pq" / "m.parquet")
    assert fails(prep, "import-atlas", tmp_path / "pq", "--out", tmp_path / "o") == (
        f"error: {tmp_path}/pq holds parquet measurements; `prep shards {tmp_path}/pq --out "
        "shards` makes training shards of it")
    assert not (tmp_path / "o").exists()


def test_import_atlas_with_nothing_to_write_fails(tmp_path):
    (tmp_path / "tr.jsonl").write_text('{"type": "traceroute", "prb_id": 1}\n' * 3)
    assert fails(prep, "import-atlas", tmp_path / "tr.jsonl", "--out", tmp_path / "o") == (
        f"error: import-atlas: no rows written: all 3 values read from {tmp_path}/tr.jsonl were "
        f"rejected (not_ping 3); only ping measurements are imported; nothing was written to "
        f"{tmp_path}/o")
    (tmp_path / "junk.json").write_text('{"a": 1}\n[1, 2]\n')
    assert fails(prep, "import-atlas", tmp_path / "junk.json", "--out", tmp_path / "o") == (
        f"error: import-atlas: no rows written: all 3 values read from {tmp_path}/junk.json were "
        "rejected (not_a_result 2, bad_result 1); are these RIPE Atlas ping results (JSON from "
        f"the results API or a daily dump)?; nothing was written to {tmp_path}/o")
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()  # a folder the user made stays
    fails(prep, "import-atlas", tmp_path / "tr.jsonl", "--out", tmp_path / "o")
    assert (tmp_path / "o").is_dir() and not list((tmp_path / "o").iterdir())


# --- prep shards -----------------------------------------------------------------------

def test_prep_shards_with_no_rows_fails(tmp_path):
    pq.write_table(SCHEMA.empty_table(), tmp_path / "e.parquet")
    assert fails(prep, "shards", tmp_path / "e.parquet", "--out", tmp_path / "s",
                 "--workers", "1", "--quiet") == (
        f"error: {tmp_path}/s: no training rows written: the inputs hold no rows; nothing was "
        "published")
    assert not (tmp_path / "s").exists()  # a new --out that failed is removed again


def test_prep_shards_with_every_row_rejected_fails(tmp_path):
    t = pa.table({"event_time": pa.array([1_600_000_000] * 4, pa.timestamp("s", tz="UTC")),
                  "src_addr": ["10.0.0.1", "x", "10.0.0.1", "10.0.0.1"],
                  "dst_addr": ["1.1.1.1", "1.1.1.1", "2001:db8::1", "1.1.1.1"],
                  "ip_version": pa.array([4, 4, 4, 5], pa.int8()),
                  "rtt": [float("nan"), 1.0, 1.0, 1.0]})
    pq.write_table(t, tmp_path / "bad.parquet")
    line = fails(prep, "shards", tmp_path / "bad.parquet", "--out", tmp_path / "s",
                 "--workers", "1", "--quiet")
    assert line.startswith(f"error: {tmp_path}/s: no training rows written: all 4 measurements "
                           "were rejected (")
    assert line.endswith("); `prep import-atlas` writes only rows that pass these checks; "
                         "nothing was published")
    assert not (tmp_path / "s").exists()  # a new --out that failed is removed again


@pytest.mark.parametrize("scale, unit, div", [(1_000, "milliseconds", "1,000"),
                                               (1_000_000, "microseconds", "1,000,000")])
def test_prep_shards_names_integer_times_in_milliseconds(tmp_path, scale, unit, div):
    """A user trial's event_time in integer milliseconds: every row time_out_of_range, and
    the hint was `prep import-atlas`; it says the unit is wrong and how to convert."""
    t = pa.table({"event_time": pa.array([1_600_000_000 * scale] * 3, pa.int64()),
                  "src_addr": ["10.0.0.1"] * 3, "dst_addr": ["1.1.1.1"] * 3,
                  "ip_version": pa.array([4] * 3, pa.int8()), "rtt": [1.0] * 3})
    pq.write_table(t, tmp_path / "ms.parquet")
    assert fails(prep, "shards", tmp_path / "ms.parquet", "--out", tmp_path / "s",
                 "--workers", "1", "--quiet") == (
        f"error: {tmp_path}/s: no training rows written: all 3 measurements were rejected "
        f"(time_out_of_range 3); 3 of the 3 time_out_of_range event_times are in range as "
        f"{unit}: an integer event_time is read as Unix seconds; divide it by {div} or store "
        "a timestamp; nothing was published")


def test_prep_shards_warns_of_some_integer_times_in_milliseconds(tmp_path):
    from helpers import probe_data, write_parquet

    recs = probe_data(4, 20, 0)
    for r in recs[::2]:
        r["event_time"] *= 1000
    write_parquet(tmp_path / "in" / "m.parquet", recs)
    r = CliRunner().invoke(prep, ["shards", str(tmp_path / "in"), "--out", str(tmp_path / "s"),
                                  "--workers", "1", "--test-fraction", "0", "--quiet", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["rejected_by_reason"] == {"time_out_of_range": 40}
    assert s["warnings"][0] == (  # then the tiny splits' warnings
        "40 of the 40 time_out_of_range event_times are in range as milliseconds: an integer "
        "event_time is read as Unix seconds; divide it by 1,000 or store a timestamp")
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["counts"][
        "time_out_of_range_as"] == {"ms": 40}


def test_prep_shards_with_every_row_in_test_fails(tmp_path):
    from prep.ingest.synth import SynthConfig, synth

    synth(SynthConfig(out=tmp_path / "raw", rows=2_000, probes=20, days=1))
    assert fails(prep, "shards", tmp_path / "raw", "--out", tmp_path / "s", "--workers", "1",
                 "--test-fraction", "1", "--quiet").startswith(
        f"error: {tmp_path}/s: no training rows written: all ")
    assert not (tmp_path / "s").exists()  # a new --out that failed is removed again


def test_prep_shards_refuses_one_file_given_twice_by_another_name(tmp_path):
    """A link to an input, or a copy of it, would put its measurements in twice (a user
    trial's `prep shards F alias` read 17,540 rows of F's 8,770): refused, nothing written."""
    from prep.ingest.synth import SynthConfig, synth

    synth(SynthConfig(out=tmp_path / "raw", rows=2_000, probes=20, days=1))
    f = sorted((tmp_path / "raw").glob("*.parquet"))[0]
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "alias.parquet").symlink_to(f)
    assert fails(prep, "shards", f, tmp_path / "more", "--out", tmp_path / "s", "--workers",
                 "1", "--quiet") == (f"error: {tmp_path}/more/alias.parquet and {f}: the same "
                                     "file (a link); give each file once")
    (tmp_path / "more" / "alias.parquet").unlink()
    shutil.copy(f, tmp_path / "more" / "copy.parquet")
    line = fails(prep, "shards", tmp_path / "raw", tmp_path / "more", "--out", tmp_path / "s",
                 "--workers", "1", "--quiet")
    assert line.startswith(f"error: {tmp_path}/more/copy.parquet and {f}: the same bytes "
                           "(sha256 ") and line.endswith(
        "…); each measurement would count twice; give each file once")
    assert not (tmp_path / "s").exists()  # a new --out that failed is removed again
    # the same path twice (a folder and a file in it) is one input, as before
    out = CliRunner().invoke(prep, ["shards", str(tmp_path / "raw"), str(f), "--out",
                                    str(tmp_path / "s"), "--workers", "1", "--quiet"])
    assert out.exit_code == 0, out.output


# --- train -----------------------------------------------------------------------------

def test_train_on_a_split_without_rows_is_one_line(tmp_path):
    d = tmp_path / "no-test"
    synthetic.write_shards(d, {"train": synthetic.counting_rows(8, 64, seed=0),
                               "test": EMPTY})
    assert fails(train, "--data", d, "--run-dir", tmp_path / "r", "--steps", "1") == (
        f"error: {d}: no test rows (its manifest.json lists none); pass --eval-every 0 to train "
        "without in-training eval, or rebuild with `prep shards --test-fraction` above 0")
    # a time split: the cutoff decides, which --test-fraction does not move (a user trial)
    m = json.loads((d / "manifest.json").read_text())
    m["config"] = {"split": "time", "test_fraction": 0.1, "test_from": 1_767_312_000}
    (d / "manifest.json").write_text(json.dumps(m))
    assert fails(train, "--data", d, "--run-dir", tmp_path / "r", "--steps", "1") == (
        f"error: {d}: no test rows (its manifest.json lists none); pass --eval-every 0 to train "
        "without in-training eval, or rebuild with `prep shards --split time --test-from` an "
        "earlier cutoff than its 2026-01-02T00:00:00Z")
    d = tmp_path / "no-train"
    synthetic.write_shards(d, {"train": EMPTY,
                               "test": synthetic.counting_rows(8, 64, seed=0)})
    assert fails(train, "--data", d, "--run-dir", tmp_path / "r", "--steps", "1") == (
        f"error: {d}: no train rows (its manifest.json lists none); rebuild the dataset with "
        "`prep shards` from more measurements")


def test_train_on_a_folder_of_parquet_names_prep_shards(tmp_path):
    (tmp_path / "pq").mkdir()
    pq.write_table(SCHEMA.empty_table(), tmp_path / "pq" / "m.parquet")
    assert fails(train, "--data", tmp_path / "pq", "--run-dir", tmp_path / "r", "--steps", "1") == (
        f"error: {tmp_path}/pq holds parquet measurements; `prep shards {tmp_path}/pq --out "
        "shards` makes training shards of it")
    (tmp_path / "new").mkdir()
    assert fails(train, "--data", tmp_path / "new", "--run-dir", tmp_path / "r", "--steps", "1") == (
        f"error: {tmp_path}/new: no manifest.json, so not a finished dataset; run `prep shards "
        f"INPUT --out {tmp_path}/new` to build it")
