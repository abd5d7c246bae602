"""A dataset in a bucket, read through a local copy checked by the manifest's sha256.

`train --data s3://b/p`, `prep verify s3://b/p` and `prep inspect s3://b/p` call
``local_dataset``, which returns a local folder that every reader reads as it reads the
output of `prep shards` (Grain and ArrayRecord read local files only):

    $PING_PACK_CACHE (default ~/.cache/ping-pack)/s3/<bucket>-<prefix>-<hash of the URI>/
        manifest.json                 the bucket's, byte for byte (written last)
        <shard paths of the manifest> the shards (e.g. g…/train/shard-b00000-e0.array_record)
        .sha256.json                  per shard: size, mtime and sha256 as last checked
        .lock                         held (flock) while a process fills the folder

It takes as much disk as the shards of the chosen splits (the manifest's sizes). Each call
reads the bucket's manifest again, lists the prefix and makes the folder match both: a
cached shard is reused without reading it when its size, mtime and recorded sha256 match
the manifest and the bucket still holds the very object it was downloaded from (the size
listed, the ETag answered now equal to the one downloaded); any other is downloaded (to
``.part``, hashed on the way, renamed when whole); files the manifest no longer lists (an
older generation's) are removed. A shard listed in the manifest but not in the bucket, or
downloaded with a sha256 other than the manifest's, is an error naming it (``strict``), or
is left missing / kept unrecorded for `prep verify` to report (``strict=False``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import re
import sys
from pathlib import Path

from prep.schema import manifest as mf
from prep.schema import storage
from prep.schema.errors import InputError
from prep.schema.storage import Remote
from prep.schema.words import count

STAMPS = ".sha256.json"
LOCK = ".lock"


def cache_root() -> Path:
    env = os.environ.get("PING_PACK_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ping-pack"


def cache_dir(uri: str) -> Path:
    """One folder per dataset URI, side by side (a prefix's copy never holds another's)."""
    loc = Remote.parse(uri)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{loc.bucket}/{loc.key}".strip("/"))[:100]
    return cache_root() / loc.scheme / f"{name}-{hashlib.sha256(loc.uri.encode()).hexdigest()[:8]}"


def local_dataset(path, *, splits=None, strict: bool = True, progress: bool = True) -> Path:
    """``path`` itself when it is local; for a bucket path, the local copy of the dataset
    there (the shards of ``splits``, all by default), made to match its manifest."""
    if not storage.is_remote(path):
        return Path(path)
    loc = Remote.parse(path)
    d = cache_dir(path)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{d}: cannot make the dataset cache ({mf.first_line(e)}); set "
                         "PING_PACK_CACHE to a folder you can write") from None
    with _locked(d):
        return _refresh(loc, d, splits, strict, progress)


@contextlib.contextmanager
def _locked(d: Path):
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{d}: another process is filling this cache; waiting for it",
                  file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _refresh(loc: Remote, d: Path, splits, strict: bool, progress: bool) -> Path:
    body = storage.read_bytes(loc.child(mf.MANIFEST_NAME))
    if body is None:
        raise InputError(f"{loc}: no {mf.MANIFEST_NAME}, so not a finished dataset; run "
                         f"`prep shards INPUT --out {loc}` to build it")
    (d / mf.MANIFEST_NAME).unlink(missing_ok=True)  # a reader never sees it half filled
    tmp = d / (mf.MANIFEST_NAME + ".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, d / mf.MANIFEST_NAME)
    try:
        m = mf.load_manifest(d)  # format, vocabulary, every shard path inside the folder
    except InputError as e:
        (d / mf.MANIFEST_NAME).unlink(missing_ok=True)
        raise InputError(str(e).replace(str(d), loc.uri)) from None
    os.unlink(d / mf.MANIFEST_NAME)
    chosen = [s for s in mf.SPLITS if s in m["splits"] and (splits is None or s in splits)]
    entries = [e for s in chosen for e in mf.split_entries(m, d, s)]
    stamps = _read_stamps(d)
    listed = {e["path"] for s in m["splits"] for e in mf.split_entries(m, d, s)}
    _prune(d, listed, stamps)
    have = storage.list_files(loc)  # every time: the cache vouches for no object by itself
    gone = [e for e in entries if e["path"] not in have]
    if gone and strict:
        raise InputError(f"{loc}/{gone[0]['path']}: listed in {mf.MANIFEST_NAME} but not in "
                         f"the bucket ({count(len(gone), 'shard')} missing); the dataset there "
                         f"is damaged or being replaced: run `prep verify {loc}`, or `prep "
                         "shards` to rebuild it")
    for e in gone:  # prep verify: what is not there is not here either, for it to say
        (d / e["path"]).unlink(missing_ok=True)
        stamps.pop(e["path"], None)
    entries_there = [e for e in entries if e["path"] in have]
    todo = _stale(loc, d, entries_there, stamps, have)
    jobs = [(loc.child(e["path"]), d / e["path"]) for e in todo]
    digests = storage.transfer(jobs, storage.download, desc="download shards",
                               total=sum(have[e["path"]] for e in todo),
                               progress=progress) if jobs else []
    bad = []
    for e, (digest, tag) in zip(todo, digests):
        p = d / e["path"]
        if digest == e["sha256"]:
            st = p.stat()
            stamps[e["path"]] = {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                 "etag": tag}
        else:
            stamps.pop(e["path"], None)
            bad.append(e)
    _write_stamps(d, stamps)
    if bad and strict:
        e = bad[0]
        raise InputError(f"{loc}/{e['path']}: sha256 differs from {mf.MANIFEST_NAME}'s "
                         f"{e['sha256'][:16]}…; the dataset in the bucket is damaged or being "
                         f"replaced: run `prep verify {loc}`, or `prep shards` to rebuild it")
    tmp.write_bytes(body)
    os.replace(tmp, d / mf.MANIFEST_NAME)  # last: the folder is now the bucket's dataset
    size = sum((d / e["path"]).stat().st_size for e in entries if (d / e["path"]).is_file())
    print(f"{loc}: {count(len(entries), 'shard')} ({size / 1e6:,.1f} MB) in the local cache "
          f"{d} ({len(todo):,} downloaded, {len(entries_there) - len(todo):,} reused"
          + (f", {len(gone):,} missing from the bucket" if gone else "") + ")",
          file=sys.stderr)
    return d


def _stale(loc: Remote, d: Path, entries: list[dict], stamps: dict,
           have: dict[str, int]) -> list[dict]:
    """The entries whose cached copy is not, or no longer, the bucket's object: checked
    here against the manifest (``_valid``), and in the bucket by the size it lists and the
    ETag it answers now (one HEAD each, several at once), which must be the ETag of the
    version downloaded."""
    kept = [e for e in entries if _valid(d, e, stamps.get(e["path"]))
            and have[e["path"]] == stamps[e["path"]]["size"]]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(storage.THREADS, len(kept)))) as pool:
        tags = list(pool.map(lambda e: storage.etag(loc.child(e["path"])), kept))
    fresh = {e["path"] for e, tag in zip(kept, tags) if tag == stamps[e["path"]].get("etag")}
    return [e for e in entries if e["path"] not in fresh]


def _valid(d: Path, entry: dict, stamp: dict | None) -> bool:
    """The cached shard is the manifest's: its size and mtime as when its sha256 was
    checked, and that sha256 the manifest's."""
    if stamp is None or stamp.get("sha256") != entry["sha256"]:
        return False
    try:
        st = (d / entry["path"]).stat()
    except OSError:
        return False
    return (st.st_size == stamp.get("size") == entry.get("size", st.st_size)
            and st.st_mtime_ns == stamp.get("mtime_ns"))


def _read_stamps(d: Path) -> dict:
    try:
        stamps = json.loads((d / STAMPS).read_text())
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def _write_stamps(d: Path, stamps: dict) -> None:
    tmp = d / (STAMPS + ".tmp")
    tmp.write_text(json.dumps(stamps, sort_keys=True))
    os.replace(tmp, d / STAMPS)


def _prune(d: Path, listed: set[str], stamps: dict) -> None:
    """Remove what the manifest no longer lists (an older generation's shards, ``.part``
    files of an interrupted download), and the folders left empty."""
    for root, dirs, files in os.walk(d, topdown=False):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), d)
            if rel in (STAMPS, LOCK) or rel in listed:
                continue
            os.unlink(os.path.join(root, f))
            stamps.pop(rel, None)
        for sub in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, sub))
    for rel in [r for r in stamps if r not in listed]:
        stamps.pop(rel)
