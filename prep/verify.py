"""`prep verify DIR`: does a shards folder hold exactly what its manifest says?

Checks, each failure one line naming the file (and record) at fault:

1. The manifest is finished and of this format and vocabulary (prep.manifest.load_manifest;
   a folder without one is refused, exit code 2).
2. Its counts add up: rows in = accepted + rejected; per split, rows, measurements,
   tokens, contexts and segments equal the sums over its shards; every epoch encodes
   every accepted measurement once; the segments-per-row histogram covers every row;
   padding = rows × row_len - tokens.
3. The folder holds the listed shards and no other shard files.
4. Per shard (in parallel): sha256 and record count as listed; every record is a row of
   this format and row_len (prep.rows.decode_row); segment ids run 1, 2, … with padding
   only at the end, every segment opens with MEASUREMENT_START, padding is token 0; every
   segment decodes into whole measurements (prep.decode.decode_context); the row's
   measurements, tokens and segments add up to the shard's listed counts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from prep import manifest as mf
from prep import rows, vocab
from prep.decode import DecodeError, decode_context

SPLITS = ("train", "test")
_MAX_PER_SHARD = 5  # problems reported per shard before "…and more"


def verify_dir(shards_dir: str | Path, *, workers: int = 1) -> list[str]:
    """Every problem found, one line each; empty when the folder is a sound dataset."""
    d = Path(shards_dir)
    m = mf.load_manifest(d)
    problems = check_counts(m)
    entries = [e for s in SPLITS for e in m.get("splits", {}).get(s, {}).get("shards", [])]
    listed = {e["path"] for e in entries}
    for split in SPLITS:
        for f in sorted((d / split).glob("*")) if (d / split).is_dir() else []:
            if f"{split}/{f.name}" not in listed:
                problems.append(f"{f}: not listed in the manifest")
    tasks = [(str(d), e, m["row_len"]) for e in entries]
    if workers > 1 and len(tasks) > 1:
        from prep.shards import process_pool

        with process_pool(workers) as pool:
            per_shard = pool.map(check_shard, tasks, chunksize=1)
    else:
        per_shard = [check_shard(t) for t in tasks]
    for p in per_shard:
        problems.extend(p)
    return problems


def check_counts(m: dict) -> list[str]:
    """The manifest's own arithmetic (no file is read)."""
    where = mf.MANIFEST_NAME
    c, row_len, out = m["counts"], m["row_len"], []

    def expect(what: str, got, want):
        if got != want:
            out.append(f"{where}: {what} is {got:,}, expected {want:,}")

    expect("rows_in", c["rows_in"], c["measurements_accepted"] + sum(c["rows_rejected"].values()))
    epochs = m["config"]["epochs"]
    expect("measurements_tokenized", c["measurements_tokenized"], c["measurements_accepted"] * epochs)
    total = {"rows": 0, "tokens": 0, "contexts": 0, "segments": 0}
    for s in SPLITS:
        sp = m["splits"][s]
        expect(f"{s} rows", sp["rows"], sum(e["records"] for e in sp["shards"]))
        expect(f"counts.rows.{s}", c["rows"][s], sp["rows"])
        for k in ("measurements", "tokens", "contexts", "segments"):
            expect(f"{s} {k}", sp[k], sum(e[k] for e in sp["shards"]))
        for k in total:
            total[k] += sp[k]
    expect("tokens", c["tokens"], total["tokens"])
    expect("contexts", c["contexts"], total["contexts"])
    expect("segments", c["segments"], total["segments"])
    expect("padding_tokens", c["padding_tokens"], total["rows"] * row_len - total["tokens"])
    hist = {int(k): v for k, v in m["segments_per_row"].items()}
    expect("rows in segments_per_row", sum(hist.values()), total["rows"])
    expect("segments in segments_per_row", sum(k * v for k, v in hist.items()), total["segments"])
    return out


def check_shard(task: tuple[str, dict, int]) -> list[str]:
    """Problems of one shard file (a plain list of lines, so it crosses processes cheaply)."""
    shards_dir, entry, row_len = task
    path = Path(shards_dir) / entry["path"]
    if not path.is_file():
        return [f"{path}: missing (listed in the manifest)"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    out = []
    if h.hexdigest() != entry["sha256"]:
        out.append(f"{path}: sha256 {h.hexdigest()[:16]}… differs from the manifest's "
                   f"{entry['sha256'][:16]}…")
    try:
        reader = ArrayRecordReader(str(path))
        records = reader.read_all()
        reader.close()
    except Exception as e:  # array_record raises plain RuntimeError/ValueError on damage
        return out + [f"{path}: not a readable ArrayRecord file ({str(e).splitlines()[0]})"]
    if len(records) != entry["records"]:
        out.append(f"{path}: {len(records):,} records, the manifest lists {entry['records']:,}")
    n_meas = n_tok = n_seg = 0
    for i, rec in enumerate(records):
        where = f"{path}#{i}"
        try:
            tok, seg = rows.decode_row(rec, where=where)
            if len(tok) != row_len:
                raise ValueError(f"{where}: row_len {len(tok)}, the manifest says {row_len}")
            n_tok_row, starts = _check_layout(tok, seg, where)
            toks = tok[:n_tok_row].tolist()
            for j, (a, b) in enumerate(zip(starts.tolist(), starts[1:].tolist() + [n_tok_row])):
                try:
                    n_meas += len(decode_context(toks[a:b]))
                except DecodeError as e:
                    raise ValueError(f"{where} segment {j + 1}: {e}") from None
            n_tok += n_tok_row
            n_seg += len(starts)
        except ValueError as e:  # RowFormatError is a ValueError
            out.append(str(e))
            if len(out) >= _MAX_PER_SHARD:
                return out + [f"{path}: …and possibly more problems"]
    for what, got in (("measurements", n_meas), ("tokens", n_tok), ("segments", n_seg)):
        if got != entry[what]:
            out.append(f"{path}: {got:,} {what} decoded, the manifest lists {entry[what]:,}")
    return out


def _check_layout(tok: np.ndarray, seg: np.ndarray, where: str) -> tuple[int, np.ndarray]:
    """(real tokens, segment start positions) of a well-formed row, else ValueError."""
    real = seg > 0
    n = int(real.sum())
    if n == 0:
        raise ValueError(f"{where}: an empty row")
    if not real[:n].all():
        raise ValueError(f"{where}: padding before the last segment")
    d = np.diff(seg[:n].astype(np.int16))
    if seg[0] != 1 or d.min(initial=0) < 0 or d.max(initial=0) > 1:
        raise ValueError(f"{where}: segment ids do not run 1, 2, 3, …")
    starts = np.concatenate([[0], np.flatnonzero(d) + 1])
    if np.any(tok[starts] != vocab.MEASUREMENT_START):
        raise ValueError(f"{where}: a segment does not open with MEASUREMENT_START")
    if np.any(tok[n:] != 0) or int(tok.max()) >= vocab.VOCAB_SIZE:
        raise ValueError(f"{where}: nonzero padding or a token id past the vocabulary")
    return n, starts
