"""A dataset in a bucket, read through a local copy checked by the manifest's sha256.

`train --data s3://b/p`, `prep verify s3://b/p` and `prep inspect s3://b/p` call
``local_dataset``, which returns a local folder that every reader reads as it reads the
output of `prep shards` (Grain and ArrayRecord read local files only): the copy that
prep.base.mirror keeps of the shards the manifest lists, with the bucket's manifest.json
byte for byte, written last. It takes as much disk as the shards of the chosen splits.

Each call reads the bucket's manifest again, lists the prefix and makes the folder match
both; files the manifest no longer lists (an older generation's) are removed. A shard
listed in the manifest but not in the bucket, or downloaded with a sha256 other than the
manifest's, is an error naming it (``strict``), or is left missing / kept unrecorded for
`prep verify` to report (``strict=False``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prep.base import mirror, storage
from prep.base.atomic import write_atomic
from prep.base.errors import InputError, first_line
from prep.base.storage import Remote
from prep.base.words import count
from prep.schema import manifest as mf


def local_dataset(path, *, splits=None, strict: bool = True, progress: bool = True) -> Path:
    """``path`` itself when it is local; for a bucket path, the local copy of the dataset
    there (the shards of ``splits``, all by default), made to match its manifest."""
    if not storage.is_remote(path):
        return Path(path)
    loc = Remote.parse(path)
    d = mirror.cache_dir(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{d}: cannot make the dataset cache ({first_line(e)}); set "
                         "PING_PACK_CACHE to a folder you can write") from None
    with mirror.filling(d):
        return _refresh(loc, d, splits, strict, progress)


def _refresh(loc: Remote, d: Path, splits, strict: bool, progress: bool) -> Path:
    body = storage.read_bytes(loc.child(mf.MANIFEST_NAME))
    if body is None:
        raise InputError(f"{loc}: no {mf.MANIFEST_NAME}, so not a finished dataset; run "
                         f"`prep shards INPUT --out {loc}` to build it")
    (d / mf.MANIFEST_NAME).unlink(missing_ok=True)  # a reader never sees it half filled
    write_atomic(d / mf.MANIFEST_NAME, body)
    try:
        m = mf.load_manifest(d)  # format, vocabulary, every shard path inside the folder
    except InputError as e:
        (d / mf.MANIFEST_NAME).unlink(missing_ok=True)
        raise InputError(str(e).replace(str(d), loc.uri)) from None
    os.unlink(d / mf.MANIFEST_NAME)
    chosen = [s for s in mf.SPLITS if s in m["splits"] and (splits is None or s in splits)]
    entries = [e for s in chosen for e in mf.split_entries(m, d, s)]
    listed = {e["path"] for s in m["splits"] for e in mf.split_entries(m, d, s)}
    have = storage.list_files(loc)  # every time: the cache vouches for no object by itself
    gone = [e for e in entries if e["path"] not in have]
    if gone and strict:
        raise InputError(f"{loc}/{gone[0]['path']}: listed in {mf.MANIFEST_NAME} but not in "
                         f"the bucket ({count(len(gone), 'shard')} missing); the dataset there "
                         f"is damaged or being replaced: run `prep verify {loc}`, or `prep "
                         "shards` to rebuild it")
    # prep verify: what is not in the bucket is not here either, for it to say
    todo, bad = mirror.sync(loc, d, entries, listed, have, progress=progress)
    if bad and strict:
        e = bad[0]
        raise InputError(f"{loc}/{e['path']}: sha256 differs from {mf.MANIFEST_NAME}'s "
                         f"{e['sha256'][:16]}…; the dataset in the bucket is damaged or being "
                         f"replaced: run `prep verify {loc}`, or `prep shards` to rebuild it")
    write_atomic(d / mf.MANIFEST_NAME, body)  # last: the folder is now the bucket's dataset
    size = sum((d / e["path"]).stat().st_size for e in entries if (d / e["path"]).is_file())
    print(f"{loc}: {count(len(entries), 'shard')} ({size / 1e6:,.1f} MB) in the local cache "
          f"{d} ({len(todo):,} downloaded, {len(entries) - len(gone) - len(todo):,} reused"
          + (f", {len(gone):,} missing from the bucket" if gone else "") + ")",
          file=sys.stderr)
    return d
