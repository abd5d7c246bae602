"""prep inspect: readable rows and JSON lines, by split and row range."""

import json

import pytest
from click.testing import CliRunner
from helpers import T0, TINY_CFG, probe_data, tiny_input, write_parquet

from prep.base.errors import InputError
from prep.cli import main
from prep.schema import manifest as mf
from prep.shards.bucket import ShardsConfig
from prep.shards.local_runner import run_shards
from prep.tools.inspect_rows import parse_range


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    run_shards([str(tiny_input(d))], str(d / "out"), TINY_CFG, progress=False)
    return d / "out"


def test_json_rows_of_the_tiny_dataset(tiny):
    r = CliRunner().invoke(main, ["inspect", str(tiny), "--json"])
    assert r.exit_code == 0, r.output
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(o["split"], o["shard"], o["record"], o["row"]) for o in objs] == [
        ("train", "train/shard-b00000-e0.array_record", 0, 0),
        ("train", "train/shard-b00000-e0.array_record", 1, 1)]
    assert objs[1]["segment_ids"] == [1] * 39 + [2] * 21 + [0] * 4
    assert len(objs[1]["tokens"]) == 64 and objs[1]["tokens"][60:] == [0, 0, 0, 0]
    seg2 = objs[1]["segments"][1]
    assert seg2 == [{"time": T0, "family": 4, "src": "192.0.2.2", "dst": "193.0.14.129",
                     "rtt_ms": -1.0, "failed": True}]
    assert [x["src"] for x in objs[0]["segments"][0]] == ["192.0.2.3"] * 3


def test_readable_rows(tiny):
    r = CliRunner().invoke(main, ["inspect", str(tiny), "--rows", "1:2"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == ("train row 1 (train/shard-b00000-e0.array_record #1): "
                        "2 segments, 60 tokens, 4 padding")
    assert lines[1] == "  segment 1: 2 measurements, 39 tokens"
    # 10 ms = 1250 << 3 µs and 20 ms = 1250 << 4 µs: both exact in the RTT code.
    assert lines[2].split() == ["2026-01-01", "00:00:00", "192.0.2.1", "->", "193.0.14.129",
                                "10.000", "ms"]
    assert lines[3].split() == ["+60", "s", "192.0.2.1", "->", "193.0.14.129", "20.000", "ms"]
    assert lines[4] == "  segment 2: 1 measurement, 21 tokens"
    assert lines[5].split()[-1] == "FAILED"


def test_a_segment_without_timestamps_says_so(tmp_path):
    cfg = ShardsConfig(row_len=64, n_buckets=1, test_fraction=0.0, mode_weights=(0.0, 0.0, 1.0))
    run_shards([str(tiny_input(tmp_path))], str(tmp_path / "out"), cfg, progress=False)
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "out"), "--rows", "1:2"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    # 39 tokens with timestamps (test_readable_rows) less an absolute one (9) and a delta (2)
    assert lines[1] == "  segment 1: 2 measurements, 28 tokens, no timestamps (its timestamp mode)"
    assert lines[2].split() == ["-", "192.0.2.1", "->", "193.0.14.129", "10.000", "ms"]
    assert lines[3].split() == ["-", "192.0.2.1", "->", "193.0.14.129", "20.000", "ms"]


def test_split_and_range_select_rows(tmp_path):
    inp = write_parquet(tmp_path / "in" / "a.parquet", probe_data(n_probes=40, per_probe=80, seed=6))
    run_shards([str(inp)], str(tmp_path / "out"), ShardsConfig(n_buckets=3, test_fraction=0.3),
               progress=False)
    m = mf.load_manifest(tmp_path / "out")
    n_train, n_test = m["counts"]["rows"]["train"], m["counts"]["rows"]["test"]
    every = CliRunner().invoke(main, ["inspect", str(tmp_path / "out"), "--json"]).stdout.splitlines()
    assert len(every) == n_train + n_test
    objs = [json.loads(x) for x in every]
    assert [o["row"] for o in objs] == list(range(n_train)) + list(range(n_test))
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "out"), "--split", "test",
                                  "--rows", f"1:{n_test - 1}", "--json"])
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert [o["row"] for o in got] == list(range(1, n_test - 1))
    assert got == objs[n_train + 1:n_train + n_test - 1]  # across shard boundaries too


def test_bad_range_and_missing_dataset(tmp_path):
    assert parse_range("3:") == (3, None) and parse_range(":5") == (0, 5) and parse_range(None) == (0, None)
    with pytest.raises(InputError, match="--rows 5:2"):
        parse_range("5:2")
    r = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert r.exit_code == 2 and "no manifest.json" in r.output


def test_rows_past_the_end_are_an_error_naming_the_rows_there(tmp_path):
    # a user trial: --rows past the end, or --split test of a dataset without test rows,
    # printed nothing and exited 0
    from helpers import exit_2_one_line

    inp = write_parquet(tmp_path / "in" / "a.parquet",
                        probe_data(n_probes=40, per_probe=80, seed=6))
    run_shards([str(inp)], str(tmp_path / "out"), ShardsConfig(n_buckets=3, test_fraction=0.3),
               progress=False)
    rows = mf.load_manifest(tmp_path / "out")["counts"]["rows"]
    n_train, n_test = rows["train"], rows["test"]
    assert n_train > n_test > 0

    def inspect(*args):
        return CliRunner().invoke(main, ["inspect", str(tmp_path / "out"), *args])

    assert exit_2_one_line(inspect("--rows", f"{n_train}:{n_train + 2}")) == (
        f"error: --rows {n_train}:{n_train + 2} is past the end of the dataset: its rows are "
        f"train 0:{n_train}, test 0:{n_test}")
    assert exit_2_one_line(inspect("--split", "test", "--rows", f"{n_test}:")) == (
        f"error: --rows {n_test}: is past the end of the dataset: its rows are test 0:{n_test}")
    # a range past one split's end but not the other's gives the rows there
    r = inspect("--rows", f"{n_test}:{n_test + 1}", "--json")
    assert r.exit_code == 0, r.output
    assert [(o["split"], o["row"]) for o in map(json.loads, r.stdout.splitlines())] == [
        ("train", n_test)]


def test_a_split_without_rows_is_an_error_saying_how_to_give_it_some(tiny):
    from helpers import exit_2_one_line

    assert mf.load_manifest(tiny)["counts"]["rows"]["test"] == 0
    for rows in ([], ["--rows", "0:1"], ["--rows", "3:"]):
        r = CliRunner().invoke(main, ["inspect", str(tiny), "--split", "test", *rows])
        assert exit_2_one_line(r) == ("error: the dataset's test split holds no rows; rebuild "
                                      "with `prep shards --test-fraction` above 0")
