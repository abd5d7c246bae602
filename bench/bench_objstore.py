"""`make bench` part "objstore": a shards folder through object storage and back, beside a
plain local copy of the same folder.

- ``objstore.upload_mb_per_s``: the folder's files uploaded (prep.base.storage.transfer,
  the calls `prep shards --out s3://…` makes) to a local S3-compatible server (moto's, on
  127.0.0.1: prep/tools/s3_server.py), manifest last.
- ``objstore.download_mb_per_s``: the dataset read back into an empty local cache as
  `train --data s3://…` does (prep.schema.cache.local_dataset: every shard hashed and
  checked against the manifest's sha256).
- ``objstore.round_trip_mb_per_s``: the bytes over upload + download time.
- ``objstore.local_copy_mb_per_s``: ``shutil.copytree`` of the same folder (warm page cache).
- ``objstore.round_trip_vs_local_copy``: how many times longer the round trip takes.
- ``objstore.identical``: 1.0 when the cached copy equals the folder byte for byte.

The server is a Python process on the same machine, so this measures our transfer code and
the S3 protocol through it (signing, multipart, the server's own CPU), not a network.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from prep.schema import vocab
from prep.tools import s3_server
from prep.tools import synthetic_shards as synthetic

ROWS, ROW_LEN, SHARDS = 16_384, 1024, 16


def _folder(d: Path) -> int:
    tokens, segs = synthetic.counting_rows(ROWS, ROW_LEN, seed=0, max_segments=12, pad=2)
    rng = np.random.default_rng(0)
    tokens = np.where(segs > 0, rng.integers(0, vocab.VOCAB_SIZE, tokens.shape), 0)
    synthetic.write_shards(d, {"train": (tokens.astype(np.uint16), segs)},
                           rows_per_shard=ROWS // SHARDS)
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def run() -> dict[str, float]:
    if s3_server.available() is not None:
        print(f"[bench] objstore skipped: {s3_server.available()}", file=sys.stderr)
        return {}
    from prep.base import storage
    from prep.base.storage import Remote
    from prep.schema import cache

    saved = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp, s3_server.S3Server() as s3:
        src = Path(tmp) / "shards"
        size = _folder(src)
        s3.make_bucket("bench")
        os.environ.update(s3.env(PING_PACK_CACHE=str(Path(tmp) / "cache")))
        try:
            uri = "s3://bench/shards"
            files = sorted(src.rglob("*.array_record"))
            t = time.perf_counter()
            storage.transfer([(p, Remote.parse(uri).child(str(p.relative_to(src)))) for p in files],
                             storage.upload, total=size, desc="upload", progress=False)
            storage.upload(src / "manifest.json", Remote.parse(uri).child("manifest.json"))
            up = time.perf_counter() - t
            t = time.perf_counter()
            got = cache.local_dataset(uri, progress=False)
            down = time.perf_counter() - t
            same = all((got / p.relative_to(src)).read_bytes() == p.read_bytes()
                       for p in [src / "manifest.json", *files])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        t = time.perf_counter()
        shutil.copytree(src, Path(tmp) / "copy")
        local = time.perf_counter() - t
    mb = size / 1e6
    print(f"[bench] objstore {mb:,.1f} MB: upload {mb / up:,.1f} MB/s, download + sha256 "
          f"{mb / down:,.1f} MB/s, local copy {mb / local:,.1f} MB/s", file=sys.stderr)
    return {"objstore.megabytes": mb, "objstore.upload_mb_per_s": mb / up,
            "objstore.download_mb_per_s": mb / down,
            "objstore.round_trip_mb_per_s": mb / (up + down),
            "objstore.local_copy_mb_per_s": mb / local,
            "objstore.round_trip_vs_local_copy": (up + down) / local,
            "objstore.identical": float(same)}


if __name__ == "__main__":
    print(run())
