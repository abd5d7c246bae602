"""`manifest.json`: what makes a shards folder a dataset. Written last, atomically (temp file
+ rename), after every shard is in place; a folder without it, or with one that is not
``finished``, is not a dataset. Fields readers rely on::

    {"format": "ping-pack-shards", "format_version": 1,  # == prep.schema.rows.ROW_FORMAT_VERSION
     "vocab_version": 1, "vocab_fingerprint": "…", "vocab_size": 267, "row_len": 1024,
     "finished": true, "seed": 0,
     "config": {…},     # the resolved ShardsConfig (prep.shards.config), with "split": probe |
                        # time | time+probe and "test_from": a time split's cutoff, Unix seconds
     "inputs": [{"name", "size", "sha256"}],
     "counts": {"rows_in", "rows_rejected": {reason: n}, "measurements_accepted",
                "time_out_of_range_as": {"ms" | "us": n},  # prep.schema.validate.misread_times
                "measurements_excluded_by_split",  # accepted, in neither split (time+probe)
                "measurements_tokenized",          # (accepted - excluded) x epochs
                "contexts", "segments", "rows": {"train", "test"}, "tokens", "padding_tokens"},
     "padding_fraction": …, "lower_bound_rows": …, "segments_per_row": {"1": n, …},
     "splits": {"train": {"rows": n, "shards": [{"path": "train/…array_record", "records": n,
                                                "sha256": "…", "size": bytes (optional)}]},
                "test": {…}},
     "elapsed_s": …}

Every shard ``path`` must lie inside the folder (``shard_path``: relative, no ``..``, no
symlink out of it), or the manifest is refused. Readers check each shard they open against
its entry (``check_shard``: present, the size if listed, a readable ArrayRecord file of the
listed record count; the sha256 where they read the whole file anyway or can afford it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from prep.base.atomic import write_atomic
from prep.base.errors import InputError, first_line
from prep.schema import rows, vocab

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "ping-pack-shards"
SPLITS = ("train", "test")  # the splits of a dataset, in manifest order
# the silence (seconds) after which `prep shards` cuts a context unless --max-gap says
# otherwise (config "max_gap_s"); `train predict` cuts a query's history alike where the
# run's manifest is not at hand
MAX_GAP_S = 86_400


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
    data = dict(manifest, finished=True)
    return write_atomic(Path(out_dir) / MANIFEST_NAME,
                        json.dumps(data, indent=2, sort_keys=True) + "\n", fsync=True)


def load_manifest(shards_dir: str | os.PathLike) -> dict:
    """The finished manifest of a shards folder, or InputError saying what to run.

    Besides format and vocabulary, the fields readers rely on are checked here, once:
    ``row_len`` a positive int, ``splits`` a dict of ``{"shards": [...]}`` whose entries
    have ``path``, ``records`` and ``sha256``, and every ``path`` inside the folder
    (relative, no ``..``, no symlink leading out of it; see ``shard_path``).
    """
    d = Path(shards_dir)
    path = d / MANIFEST_NAME
    fix = f"run `prep shards INPUT --out {d}` to build it"
    if not d.is_dir():
        raise InputError(f"{d}: no such folder; {fix}")
    if not path.is_file():
        from prep.base import sniff  # a folder of something else: name the command that takes it

        kind = sniff.kind(d)
        hint = sniff.advice(d, kind, "train") if kind.startswith("folder:") or kind == "run" else None
        raise InputError(hint or f"{d}: no {MANIFEST_NAME}, so not a finished dataset; {fix}")
    try:
        m = json.loads(path.read_text())
    except RecursionError:  # e.g. 100,000 nested arrays: no manifest is that deep
        raise InputError(f"{path}: unreadable manifest (nested too deeply); {fix}") from None
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
    _check_structure(m, d)
    return m


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_structure(m: dict, d: Path) -> None:
    """InputError (one line) unless the fields every reader uses are there and sound."""
    where = d / MANIFEST_NAME

    def bad(what: str):
        raise InputError(f"{where}: {what}; the manifest is damaged: re-run `prep shards` "
                         "to rebuild the dataset")

    row_len = m.get("row_len")
    if not _is_int(row_len) or not 0 < row_len < 1 << 16:
        bad(f"row_len is {row_len!r}, not a positive int")
    splits = m.get("splits")
    if not isinstance(splits, dict) or not splits:
        bad("no 'splits'" if splits is None else f"'splits' is {type(splits).__name__}, not a dict")
    for name, sp in splits.items():
        shards = sp.get("shards") if isinstance(sp, dict) else None
        if not isinstance(shards, list):
            bad(f"split {name!r} has no list of 'shards'")
        for i, e in enumerate(shards):
            if not isinstance(e, dict):
                bad(f"split {name!r} shard {i} is not an object")
            if not isinstance(e.get("path"), str) or not e["path"]:
                bad(f"split {name!r} shard {i} has no 'path'")
            if not _is_int(e.get("records")) or e["records"] < 0:
                bad(f"{e['path']}: 'records' is {e.get('records')!r}, not a count")
            if not isinstance(e.get("sha256"), str) or len(e["sha256"]) != 64:
                bad(f"{e['path']}: 'sha256' is {e.get('sha256')!r}, not a sha256 digest")
            if "size" in e and (not _is_int(e["size"]) or e["size"] < 0):
                bad(f"{e['path']}: 'size' is {e['size']!r}, not a byte count")
            shard_path(d, e["path"])


def shard_path(shards_dir: str | os.PathLike, rel: str) -> Path:
    """``shards_dir / rel`` if it lies inside the folder, else InputError (one line).

    The one owner of "which files may a manifest name": a relative path without ``..``
    whose target, symlinks followed, is inside the dataset folder (followed too). So a
    manifest cannot make a reader open (or `prep verify` hash) ``/etc/passwd``, a file of
    another dataset beside it, or one a symlink points to elsewhere.
    """
    d = Path(shards_dir)
    pure = PurePosixPath(rel)
    outside = (pure.is_absolute() or PureWindowsPath(rel).is_absolute() or "\\" in rel
               or ".." in pure.parts)
    if not outside:
        try:
            outside = not (d / rel).resolve().is_relative_to(d.resolve())
        except (OSError, RuntimeError):  # a symlink loop
            outside = True
    if outside:
        raise InputError(f"{d / MANIFEST_NAME}: shard path {rel!r} leads outside {d}; a "
                         "manifest names only files in its own folder: re-run `prep shards` "
                         "to rebuild the dataset")
    return d / rel


def split_entries(manifest: dict, shards_dir: str | os.PathLike, split: str) -> list[dict]:
    """A split's shard entries, in manifest order; InputError if the split is not there."""
    try:
        return manifest["splits"][split]["shards"]
    except (KeyError, TypeError):
        raise InputError(f"{Path(shards_dir) / MANIFEST_NAME}: no split {split!r}; re-run "
                         "`prep shards` to rebuild the dataset") from None


def shard_paths(manifest: dict, shards_dir: str | os.PathLike, split: str) -> list[Path]:
    """Paths of a split's shards, in manifest order (each inside the folder: shard_path)."""
    return [shard_path(shards_dir, e["path"]) for e in split_entries(manifest, shards_dir, split)]


# --- does a shard hold what the manifest promises? ------------------------------------

HASH_CHUNK = 1 << 22


def _fix(d: Path) -> str:
    return f"run `prep verify {d}` to see what is wrong, `prep shards` to rebuild it"


def record_count(path: str | os.PathLike) -> int:
    """Records of an ArrayRecord file (from its footer: no record is read); InputError
    naming the file if it is not a readable ArrayRecord file (truncated, empty, not one)."""
    from array_record.python.array_record_module import ArrayRecordReader

    problem = None
    try:
        reader = ArrayRecordReader(str(path))
    except Exception as e:  # array_record raises plain RuntimeError/ValueError on damage
        raise InputError(f"{path}: not a readable ArrayRecord file ({first_line(e)})") from None
    ok, n = reader.ok(), reader.num_records()
    try:
        reader.close()
    except Exception as e:  # a damaged file reports its error on close
        problem = first_line(e)
    if not ok or problem is not None:
        raise InputError(f"{path}: not a readable ArrayRecord file "
                         f"({problem if problem and problem != 'RuntimeError' else 'damaged or truncated'})")
    return n


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_shard(shards_dir: str | os.PathLike, entry: dict, *, sha256: bool = False) -> Path:
    """The shard's path if the file is what ``entry`` promises, else InputError: one line
    naming the shard and the fix. Always (cheap: a stat and the footer): the file is there,
    its size (where the manifest records one), a readable ArrayRecord file with the listed
    record count; with ``sha256``, its digest too (reads the whole file)."""
    d = Path(shards_dir)
    path = shard_path(d, entry["path"])
    if not path.is_file():
        raise InputError(f"{path}: missing (listed in {MANIFEST_NAME}); {_fix(d)}")
    size = path.stat().st_size
    if "size" in entry and size != entry["size"]:
        raise InputError(f"{path}: {size:,} bytes, {MANIFEST_NAME} lists {entry['size']:,}; "
                         f"{_fix(d)}")
    try:
        n = record_count(path)
    except InputError as e:
        raise InputError(f"{e}; {_fix(d)}") from None
    if n != entry["records"]:
        raise InputError(f"{path}: {n:,} records, {MANIFEST_NAME} lists {entry['records']:,}; "
                         f"{_fix(d)}")
    if sha256:
        digest = file_sha256(path)
        if digest != entry["sha256"]:
            raise InputError(f"{path}: sha256 {digest[:16]}… differs from {MANIFEST_NAME}'s "
                             f"{entry['sha256'][:16]}…; {_fix(d)}")
    return path


def check_shards(manifest: dict, shards_dir: str | os.PathLike, splits, *,
                 sha256: bool = False, workers: int = 1) -> list[Path]:
    """``check_shard`` for every shard of ``splits`` (in threads if ``workers`` > 1: hashing
    releases the GIL); the paths, in manifest order."""
    entries = [e for s in splits for e in split_entries(manifest, shards_dir, s)]
    if workers > 1 and sha256 and len(entries) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda e: check_shard(shards_dir, e, sha256=True), entries))
    return [check_shard(shards_dir, e, sha256=sha256) for e in entries]
