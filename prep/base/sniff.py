"""What a path holds, read from its first bytes, so a wrong input gets the right command.

``kind(path)`` is one of:

    parquet      a file starting with PAR1              -> prep shards
    atlas        JSON (array or lines), .bz2 or .gz     -> prep import-atlas
    csv          text whose first line has commas       -> convert to parquet (polars)
    matrix       text whose first line is 2+ numbers    -> prep import-matrix (a latency matrix)
    shards       a folder with manifest.json / train/   -> train --data, prep inspect/verify
    run          a folder with config.json and checkpoints/  -> train eval / train predict
    folder:K     a folder whose files are mostly of kind K
    empty        an empty file or folder
    unknown      anything else

``advice(path, kind, command)`` is the one-line fix for giving ``path`` to ``command``
(``"prep shards"``, ``"prep import-atlas"``, ``"prep import-matrix"``, ``"train"``), or
None when that is the right command for it. ``broken_link(path)`` says why a symbolic
link leads nowhere: a target that does not exist, or a loop of links. Commands call it where they would otherwise
fail with a message about their own format ("not a readable parquet file") and leave the
user guessing.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from pathlib import Path

# In a writer's staging folder ``.tmp-…/`` (prep.jobs.parquet_out, prep.jobs.remote_out): the
# list of files its publish removes and moves in, there from the publish's start to its end
PUBLISH = ".publish"
_MAGIC = ((b"PAR1", "parquet"), (b"BZh", "atlas"), (b"\x1f\x8b", "atlas"))
_SCAN = 200  # files looked at in a folder


def broken_link(path: str | Path) -> str:
    """Why the symbolic link ``path`` leads nowhere, as a phrase: "its target T does not
    exist", or, when following it comes back round, "a loop of symbolic links: ..."."""
    target = os.readlink(path)
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return (f"a loop of symbolic links: {path} -> {target} -> … never reaches a "
                    "file or folder")
    return f"its target {target} does not exist"


def kind(path: str | Path) -> str:
    p = Path(path)
    if p.is_dir():
        if (p / "manifest.json").is_file() or any((p / s).is_dir() and any((p / s).glob(
                "*.array_record")) for s in ("train", "test")):
            return "shards"
        if (p / "config.json").is_file() and (p / "checkpoints").is_dir():
            return "run"
        counts = Counter()
        for i, f in enumerate(_visible_files(p)):
            if i >= _SCAN:
                break
            counts[kind(f)] += 1
        counts.pop("empty", None)
        return f"folder:{counts.most_common(1)[0][0]}" if counts else "empty"
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError:
        return "unknown"
    if not head:
        return "empty"
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if text[:1] in (b"[", b"{"):
        return "atlas"
    first = text.split(b"\n", 1)[0]
    if b"," in first and all(32 <= c < 127 or c == 9 for c in first.rstrip(b"\r")):
        return "csv"
    words = first.split()[:-1] if b"\n" not in text else first.split()  # the last may be cut
    if len(words) >= 2 and all(_number(w) for w in words):
        return "matrix"
    return "unknown"


def unfinished_publish(where, rels) -> str | None:
    """The refusal to read a folder or prefix ``where`` whose paths (relative to it) ``rels``
    hold a ``.tmp-…/.publish``: a writer (`prep import-atlas`, `prep synth`) was replacing
    its files and did not finish, so they are part old, part new. None when there is none."""
    rel = next((r for r in sorted(rels) if (parts := r.split("/"))[0].startswith(".tmp-")
                and parts[1:] == [PUBLISH]), None)
    if rel is None:
        return None
    return (f"{where}: holds an unfinished publish ({rel}): the run writing it stopped while "
            "replacing its files, so they are part old, part new; run it again (the same "
            f"command with --out {where} --overwrite) to finish, then read it")


def _visible_files(p: Path) -> list[Path]:
    """The files under ``p`` (sorted), none under a dot-named folder or dot-named; a folder
    that cannot be read, or that vanishes during the walk (another program's temporary
    files), is passed over."""
    out = []
    for root, dirs, files in os.walk(p, onerror=lambda e: None):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [Path(root, f) for f in files if not f.startswith(".")]
    return sorted(x for x in out if x.is_file())


def _number(word: bytes) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


# What a command reads, for the advice on a file of no kind it takes
_PARQUET = ("parquet measurements (make some with `prep synth`, or from RIPE Atlas results with "
            "`prep import-atlas`)")
READS = {"prep shards": _PARQUET,
         "prep analyze-padding": f"{_PARQUET} or a shards folder (made by `prep shards`)"}


def advice(path: str | Path, k: str, command: str) -> str | None:
    """The one-line fix for giving ``path`` (of kind ``k``) to ``command``; None if right."""
    base = k.removeprefix("folder:")
    what = {"parquet": "parquet measurements", "atlas": "RIPE Atlas JSON results",
            "csv": "CSV", "matrix": "latency matrices (one N×N RTT matrix per file)",
            "shards": "a shards folder (the output of `prep shards`)",
            "run": "a training run folder", "empty": "empty", "unknown": "of an unknown format"}
    if k == "folder:unknown":
        what["unknown"] = "files of an unknown format"
    holds = f"{path} holds {what.get(base, base)}" if k.startswith("folder:") or base in (
        "parquet", "atlas", "matrix") else f"{path} is {what.get(base, base)}"
    if base == "parquet" and command != "prep shards":
        return f"{holds}; `prep shards {path} --out shards` makes training shards of it"
    if base == "atlas" and command != "prep import-atlas":
        return (f"{holds}; convert them first: `prep import-atlas {path} --out data/atlas`, "
                "then `prep shards data/atlas --out shards`")
    if base == "matrix" and command != "prep import-matrix":
        # the file says neither how long a frame lasts nor the RTTs' unit: the user sets both
        return (f"{holds}; convert them first: `prep import-matrix {path} --out data/matrix "
                "--interval SECONDS --unit UNIT` (SECONDS: the time a frame covers; UNIT: the "
                "matrices' RTT unit, s, ms or us), then `prep shards data/matrix --out shards`")
    if base == "csv":
        stem = Path(path).with_suffix(".parquet") if not k.startswith("folder:") else "out.parquet"
        return (f"{holds}; convert it to parquet with the input columns first, e.g. `python -c "
                f"\"import polars as pl; pl.read_csv('{path}', try_parse_dates=True)"
                f".write_parquet('{stem}')\"`")
    if base == "shards" and command != "train":
        return f"{holds}; train on it with `train --data {path}` (or `prep inspect {path}`)"
    if base == "run":
        return f"{holds}; evaluate it with `train eval {path}` or query it with `train predict`"
    if base in ("empty", "unknown"):
        return f"{holds}" + (f"; `{command}` reads {READS[command]}" if command in READS else "")
    return None
