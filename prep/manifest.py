"""`manifest.json`: what makes a shards folder a dataset (DESIGN section 5).

Written last, atomically (temp file + rename), after every shard is in place. A folder
without it, or with one that is not ``finished``, is not a dataset. Fields readers rely on:

    {
      "format": "ping-pack-shards",
      "format_version": 1,              # == prep.rows.ROW_FORMAT_VERSION
      "vocab_version": 1, "vocab_fingerprint": "…", "vocab_size": 267,
      "row_len": 1024,
      "finished": true,
      "config": {…, "test_fraction": 0.1,   # the resolved ShardsConfig (prep.bucket)
                 "split": "probe",            # probe | time | time+probe (prep.splits)
                 "test_from": null},          # time splits: the cutoff, int Unix seconds
                                              # (test = time >= it), given or the default
      "seed": 0,
      "inputs": [{"name", "size", "sha256"}],
      "counts": {"rows_in", "rows_rejected": {reason: n}, "measurements_accepted",
                 "measurements_excluded_by_split",   # accepted, in neither split
                                                     # (time+probe only; else 0)
                 "measurements_tokenized",           # (accepted - excluded) x epochs
                 "contexts", "segments", "rows": {"train", "test"}, "tokens",
                 "padding_tokens"},
      "padding_fraction": …, "lower_bound_rows": …,
      "segments_per_row": {"1": n, …},
      "splits": {"train": {"rows": n, "shards": [{"path": "train/…array_record",
                                                   "records": n, "sha256": "…"}]},
                 "test": {…}},
      "elapsed_s": …
    }
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prep import rows, vocab
from prep.errors import InputError

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "ping-pack-shards"


def header(row_len: int) -> dict:
    """The fields that say which format and vocabulary the shards use."""
    return {
        "format": FORMAT_NAME,
        "format_version": rows.ROW_FORMAT_VERSION,
        "vocab_version": vocab.VOCAB_VERSION,
        "vocab_fingerprint": vocab.fingerprint(),
        "vocab_size": vocab.VOCAB_SIZE,
        "row_len": row_len,
    }


def write_manifest(out_dir: str | os.PathLike, manifest: dict) -> Path:
    """Atomically write ``manifest`` (with ``finished: true``) as the folder's last file."""
    path = Path(out_dir) / MANIFEST_NAME
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    data = dict(manifest, finished=True)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_manifest(shards_dir: str | os.PathLike) -> dict:
    """The finished manifest of a shards folder, or InputError saying what to run."""
    d = Path(shards_dir)
    path = d / MANIFEST_NAME
    fix = f"run `prep shards INPUT --out {d}` to build it"
    if not d.is_dir():
        raise InputError(f"{d}: no such folder; {fix}")
    if not path.is_file():
        raise InputError(f"{d}: no {MANIFEST_NAME}, so not a finished dataset; {fix}")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable manifest ({e}); {fix}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME or not m.get("finished"):
        raise InputError(f"{path}: not a finished ping-pack manifest; {fix}")
    if m.get("format_version") != rows.ROW_FORMAT_VERSION:
        raise InputError(f"{path}: row format version {m.get('format_version')}, this code "
                         f"reads {rows.ROW_FORMAT_VERSION}; re-run `prep shards`")
    if m.get("vocab_fingerprint") != vocab.fingerprint():
        raise InputError(f"{path}: written with another vocabulary "
                         f"({m.get('vocab_fingerprint')}); re-run `prep shards`")
    return m


def shard_paths(manifest: dict, shards_dir: str | os.PathLike, split: str) -> list[Path]:
    """Paths of a split's shards, in manifest order."""
    d = Path(shards_dir)
    try:
        entries = manifest["splits"][split]["shards"]
    except KeyError:
        raise InputError(f"{d / MANIFEST_NAME}: no split {split!r}") from None
    return [d / e["path"] for e in entries]
