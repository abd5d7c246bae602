"""A local copy of objects in a bucket, checked by sha256: the mechanism under the dataset
cache (prep.schema.cache says which objects a dataset is, and what a missing or damaged
one means).

    $PING_PACK_CACHE (default ~/.cache/ping-pack)/s3/<bucket>-<prefix>-<hash of the URI>/
        <paths of the objects>    the copies
        .sha256.json              per copy: size, mtime, sha256 and ETag as last checked
        .lock                     held (prep.base.lock) while a process fills the folder

A copy is reused without reading it when its size, mtime and recorded sha256 are the
wanted ones and the bucket still holds the very object it was downloaded from (the size
listed, the ETag answered now equal to the one downloaded); any other is downloaded (to
``.part``, hashed on the way, renamed when whole); files no longer wanted are removed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import re
from pathlib import Path

from prep.base import storage
from prep.base.atomic import write_atomic
from prep.base.lock import LOCK_NAME, lock_folder, release
from prep.base.storage import Remote

STAMPS = ".sha256.json"


def cache_root() -> Path:
    env = os.environ.get("PING_PACK_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ping-pack"


def cache_dir(uri: str) -> Path:
    """One folder per URI, side by side (a prefix's copy never holds another's)."""
    loc = Remote.parse(uri)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{loc.bucket}/{loc.key}".strip("/"))[:100]
    return cache_root() / loc.scheme / f"{name}-{hashlib.sha256(loc.uri.encode()).hexdigest()[:8]}"


@contextlib.contextmanager
def filling(d: Path):
    """``d`` locked for this process to fill; another one filling it is waited for."""
    fd = lock_folder(d, "fill the cache",
                     wait=f"{d}: another process is filling this cache; waiting for it")
    try:
        yield
    finally:
        release(d, fd)


def sync(loc: Remote, d: Path, entries: list[dict], keep: set[str], have: dict[str, int], *,
         progress: bool) -> tuple[list[dict], list[dict]]:
    """Make ``d`` hold the objects ``entries`` (``path`` under ``loc``, ``sha256``, maybe
    ``size``) that the bucket ``have``s (path: size, from storage.list_files): files
    outside ``keep`` and copies of entries no longer in the bucket are removed, fresh copies
    reused, the rest downloaded. The entries downloaded, and those among them whose sha256
    was not the wanted one (kept on disk, unrecorded)."""
    stamps = _read_stamps(d)
    _prune(d, keep, stamps)
    for e in entries:
        if e["path"] not in have:
            (d / e["path"]).unlink(missing_ok=True)
            stamps.pop(e["path"], None)
    there = [e for e in entries if e["path"] in have]
    todo = _stale(loc, d, there, stamps, have)
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
    write_atomic(d / STAMPS, json.dumps(stamps, sort_keys=True))
    return todo, bad


def _stale(loc: Remote, d: Path, entries: list[dict], stamps: dict,
           have: dict[str, int]) -> list[dict]:
    """The entries whose copy is not, or no longer, the bucket's object: checked here
    (``_valid``), and in the bucket by the size it lists and the ETag it answers now (one
    HEAD each, several at once), which must be the ETag of the version downloaded."""
    kept = [e for e in entries if _valid(d, e, stamps.get(e["path"]))
            and have[e["path"]] == stamps[e["path"]]["size"]]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(storage.THREADS, len(kept)))) as pool:
        tags = list(pool.map(lambda e: storage.etag(loc.child(e["path"])), kept))
    fresh = {e["path"] for e, tag in zip(kept, tags) if tag == stamps[e["path"]].get("etag")}
    return [e for e in entries if e["path"] not in fresh]


def _valid(d: Path, entry: dict, stamp: dict | None) -> bool:
    """The copy is the wanted object: its size and mtime as when its sha256 was checked,
    and that sha256 the wanted one."""
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


def _prune(d: Path, keep: set[str], stamps: dict) -> None:
    """Remove what is not to be kept (an older generation's shards, ``.part`` files of an
    interrupted download), and the folders left empty."""
    for root, dirs, files in os.walk(d, topdown=False):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), d)
            if rel in (STAMPS, LOCK_NAME) or rel in keep:
                continue
            os.unlink(os.path.join(root, f))
            stamps.pop(rel, None)
        for sub in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, sub))
    for rel in [r for r in stamps if r not in keep]:
        stamps.pop(rel)
