"""prep verify: a sound dataset passes; each kind of damage is named, exit 1; no manifest, exit 2."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import probe_data, write_parquet

from prep.base.errors import InputError
from prep.cli import main
from prep.schema import manifest as mf
from prep.shards.bucket import ShardsConfig
from prep.shards.local_runner import run_shards
from prep.tools.verify import check_counts, verify_dir


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


def rewrite_shard(d: Path, name: str, damage) -> Path:
    """Rewrite one shard with ``damage(records)`` applied and its sha256 fixed in the
    manifest, so that only the rows' contents are wrong."""
    import hashlib

    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    shard = d / name
    r = ArrayRecordReader(str(shard))
    records = [bytearray(x) for x in r.read_all()]
    r.close()
    damage(records)
    w = ArrayRecordWriter(str(shard), "group_size:1")
    for rec in records:
        w.write(bytes(rec))
    w.close()
    m = json.loads((d / mf.MANIFEST_NAME).read_text())
    for e in m["splits"]["train"]["shards"]:
        if e["path"] == name:
            e["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (d / mf.MANIFEST_NAME).write_text(json.dumps(m))
    return shard


def test_damaged_rows_are_named_by_record_and_segment(dataset, tmp_path):
    d = copy_of(dataset, tmp_path)
    row_len = mf.load_manifest(d)["row_len"]

    def damage(records):
        records[1][:4] = b"XXXX"  # header: decode_row's message
        records[2][16 + 2] = 9  # token 1 of segment 1: THROUGHPUT_START where a block starts
        # nonzero padding (the last token) in the first row after #2 that ends in padding
        padded[0] = next(i for i in range(3, len(records) - 1)
                         if records[i][16 + 2 * row_len + row_len - 1] == 0)
        records[padded[0]][16 + 2 * row_len - 2] = 7
        records[-1] = records[-1][:-1]  # a short record
        padded.append(len(records) - 1)

    padded = [0]

    shard = rewrite_shard(d, "train/shard-b00000-e0.array_record", damage)
    problems = verify_dir(d)
    assert problems[0] == f"{shard}#1: not a ping-pack row (magic b'XXXX'); re-run `prep shards` to rebuild the dataset"
    assert problems[1] == f"{shard}#2 segment 1: token 1: unexpected THROUGHPUT_START"
    assert problems[2] == f"{shard}#{padded[0]}: nonzero padding (token {row_len - 1})"
    assert problems[3].startswith(
        f"{shard}#{padded[1]}: {3 * row_len + 15} bytes, expected {3 * row_len + 16}")
    assert [p.split(": ")[1].split()[1:3] for p in problems[4:]] == [
        ["measurements", "decoded,"], ["tokens", "decoded,"], ["segments", "decoded,"]]


def test_a_duplicated_block_is_refused_though_decode_context_takes_it(dataset, tmp_path):
    from prep.schema import vocab as V

    d = copy_of(dataset, tmp_path)
    row_len = mf.load_manifest(d)["row_len"]
    tok_at = lambda i: slice(16 + 2 * i, 18 + 2 * i)  # noqa: E731

    def damage(records):
        rec = records[0]
        tok = np.frombuffer(bytes(rec[16:16 + 2 * row_len]), "<u2")
        i = int(np.flatnonzero(tok == V.RTT_START)[0])  # RTT_START b b -> FAILED × 3
        for k in range(i, i + 3):
            rec[tok_at(k)] = np.array([V.FAILED], "<u2").tobytes()

    shard = rewrite_shard(d, "train/shard-b00000-e0.array_record", damage)
    problems = verify_dir(d)
    assert problems[0].startswith(f"{shard}#0 segment ")
    assert problems[0].endswith(": a measurement holds the same block twice")
    assert any("measurements decoded, the manifest lists" in p for p in problems)


def test_half_truncated_and_empty_shards_are_problem_lines(dataset, tmp_path):
    d = copy_of(dataset, tmp_path)
    half = d / "train" / "shard-b00000-e0.array_record"
    half.write_bytes(half.read_bytes()[:half.stat().st_size // 2])
    empty = d / "test" / "shard-b00001-e0.array_record"
    empty.write_bytes(b"")
    r = CliRunner().invoke(main, ["verify", str(d)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert r.stdout.splitlines() == [
        f"{half}: sha256 {mf.file_sha256(half)[:16]}… differs from the manifest's "
        f"{mf.load_manifest(dataset)['splits']['train']['shards'][0]['sha256'][:16]}…",
        f"{half}: not a readable ArrayRecord file (damaged or truncated)",
        f"{empty}: sha256 {mf.file_sha256(empty)[:16]}… differs from the manifest's "
        f"{mf.load_manifest(dataset)['splits']['test']['shards'][1]['sha256'][:16]}…",
        f"{empty}: not a readable ArrayRecord file (ArrayRecord file should be at least 64KB big)"]
    assert r.stderr.splitlines()[-1] == f"{d}: 4 problems; re-run `prep shards` to rebuild it"


def test_a_shard_path_outside_the_folder_is_not_opened(dataset, tmp_path):
    d = copy_of(dataset, tmp_path)
    m = json.loads((d / mf.MANIFEST_NAME).read_text())
    m["splits"]["train"]["shards"][0]["path"] = "../../../../etc/passwd"
    (d / mf.MANIFEST_NAME).write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", str(d)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == (f"error: {d / mf.MANIFEST_NAME}: shard path '../../../../etc/passwd' "
                        f"leads outside {d}; a manifest names only files in its own folder: "
                        "re-run `prep shards` to rebuild the dataset\n")
