"""prep verify: a sound dataset passes; each kind of damage is named, exit 1; no manifest, exit 2."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from prep import manifest as mf
from prep.bucket import ShardsConfig
from prep.cli import main
from prep.errors import InputError
from prep.shards import run_shards
from prep.verify import check_counts, verify_dir
from test_shards import probe_data, write_parquet


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("verify")
    inp = write_parquet(d / "in" / "a.parquet", probe_data(n_probes=30, per_probe=60, seed=5))
    run_shards([str(inp)], str(d / "out"), ShardsConfig(n_buckets=2, test_fraction=0.3),
               progress=False)
    return d / "out"


def copy_of(dataset: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(dataset, tmp_path / "copy"))


def test_sound_dataset_passes(dataset):
    assert verify_dir(dataset) == [] and verify_dir(dataset, workers=2) == []
    r = CliRunner().invoke(main, ["verify", str(dataset)])
    assert r.exit_code == 0 and r.stdout == ""


def test_flipped_byte_is_found_and_named(dataset, tmp_path):
    d = copy_of(dataset, tmp_path)
    shard = d / "train" / "shard-b00000-e0.array_record"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify_dir(d)
    assert problems and all("shard-b00000-e0" in p for p in problems)
    assert "sha256" in problems[0]
    r = CliRunner().invoke(main, ["verify", str(d), "--workers", "1"])
    assert r.exit_code == 1 and "shard-b00000-e0" in r.stdout


def test_missing_extra_and_miscounted(dataset, tmp_path):
    d = copy_of(dataset, tmp_path)
    (d / "test" / "shard-b00001-e0.array_record").unlink()
    (d / "train" / "shard-b00099-e0.array_record").write_bytes(b"")
    m = json.loads((d / mf.MANIFEST_NAME).read_text())
    m["splits"]["train"]["shards"][0]["records"] += 1
    (d / mf.MANIFEST_NAME).write_text(json.dumps(m))
    problems = verify_dir(d)
    assert any("shard-b00001-e0.array_record: missing" in p for p in problems)
    assert any("shard-b00099-e0.array_record: not listed" in p for p in problems)
    assert any("train rows is" in p for p in problems)  # the manifest's own sums
    assert any("records, the manifest lists" in p for p in problems)


def test_counts_must_add_up(dataset):
    m = mf.load_manifest(dataset)
    assert check_counts(m) == []
    m["counts"]["rows_rejected"] = {"bad_rtt": 1}
    assert check_counts(m) == [f"manifest.json: rows_in is {m['counts']['rows_in']:,}, "
                               f"expected {m['counts']['rows_in'] + 1:,}"]


def test_refuses_a_folder_without_a_finished_manifest(dataset, tmp_path):
    d = copy_of(dataset, tmp_path)
    (d / mf.MANIFEST_NAME).unlink()
    with pytest.raises(InputError, match="no manifest.json.*run `prep shards"):
        verify_dir(d)
    r = CliRunner().invoke(main, ["verify", str(d)])
    assert r.exit_code == 2 and r.output.count("\n") == 1
