"""Wrong inputs get the right command: prep.base.sniff on each kind, and `prep shards` given
Atlas JSON, CSV, a shards folder or a run folder answers with one line naming the fix."""

import json
import shutil

import pytest
from click.testing import CliRunner

from prep.base import sniff
from prep.cli import main


@pytest.fixture
def kinds(tmp_path, atlas_dir):
    (tmp_path / "atlas").mkdir()
    shutil.copy(atlas_dir / "api" / "ping.json", tmp_path / "atlas" / "ping.json")
    shutil.copy(atlas_dir / "dump" / "ping-sample.jsonl.bz2", tmp_path / "dump.jsonl.bz2")
    (tmp_path / "m.csv").write_text("event_time,src_addr,dst_addr,ip_version,rtt\n1,a,b,4,1.0\n")
    (tmp_path / "lines.jsonl").write_text('\ufeff{"type": "ping"}\n')
    (tmp_path / "x.parquet").write_bytes(b"PAR1" + b"\0" * 10)
    (tmp_path / "shards" / "train").mkdir(parents=True)
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps({"format": "x"}))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01garbage")
    (tmp_path / "void.parquet").write_bytes(b"")
    return tmp_path


def test_kinds(kinds):
    got = {name: sniff.kind(kinds / name) for name in (
        "atlas", "atlas/ping.json", "dump.jsonl.bz2", "m.csv", "lines.jsonl", "x.parquet",
        "shards", "run", "empty", "blob.bin")}
    assert got == {"atlas": "folder:atlas", "atlas/ping.json": "atlas",
                   "dump.jsonl.bz2": "atlas", "m.csv": "csv", "lines.jsonl": "atlas",
                   "x.parquet": "parquet", "shards": "shards", "run": "run",
                   "empty": "empty", "blob.bin": "unknown"}


@pytest.mark.parametrize("name, message", [
    ("atlas", "{d}/atlas holds RIPE Atlas JSON results; convert them first: "
              "`prep import-atlas {d}/atlas --out data/atlas`, then `prep shards data/atlas --out shards`"),
    ("dump.jsonl.bz2", "{d}/dump.jsonl.bz2 holds RIPE Atlas JSON results; convert them first: "
                       "`prep import-atlas {d}/dump.jsonl.bz2 --out data/atlas`, then "
                       "`prep shards data/atlas --out shards`"),
    ("m.csv", "{d}/m.csv is CSV; convert it to parquet with the input columns first, e.g. "
              "`python -c \"import polars as pl; pl.read_csv('{d}/m.csv', try_parse_dates=True)"
              ".write_parquet('{d}/m.parquet')\"`"),
    ("shards", "{d}/shards is a shards folder (the output of `prep shards`); train on it with "
               "`train --data {d}/shards` (or `prep inspect {d}/shards`)"),
    ("run", "{d}/run is a training run folder; evaluate it with `train eval {d}/run` or query "
            "it with `train predict`"),
    ("blob.bin", "{d}/blob.bin is of an unknown format; `prep shards` reads parquet measurements "
                 "(make some with `prep synth`, or from RIPE Atlas results with `prep import-atlas`)"),
    ("void.parquet", "{d}/void.parquet is empty; `prep shards` reads parquet measurements (make "
                     "some with `prep synth`, or from RIPE Atlas results with `prep import-atlas`)"),
])
def test_prep_shards_names_the_command_that_takes_it(kinds, name, message):
    r = CliRunner().invoke(main, ["shards", str(kinds / name), "--out", str(kinds / "out")])
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == ["error: " + message.format(d=kinds)]
    assert not (kinds / "out" / "manifest.json").exists()
