"""`prep verify DIR`: does a shards folder hold exactly what its manifest says?

Checks, each failure one line naming the file (and record) at fault:

1. The manifest is finished and of this format and vocabulary
   (prep.schema.manifest.load_manifest; a folder without one is refused, exit code 2).
2. Its counts add up: rows in = accepted + rejected; per split, rows, measurements, tokens,
   contexts and segments equal the sums over its shards; tokenized = (accepted -
   measurements_excluded_by_split) × epochs; the segments-per-row histogram covers every
   row; padding = rows × row_len - tokens; the split rule is known, a time split's cutoff
   an int.
3. The folder holds the listed shards and no other shard files, every path inside it
   (prep.schema.manifest.shard_path: else exit 2, nothing is opened).
4. Per shard, in parallel: size, sha256 and record count as listed; every record a row of
   this format and row_len (prep.schema.rows.decode_row), segment ids 1, 2, … with padding
   (token 0) only at the end, every segment opening with MEASUREMENT_START and holding
   whole measurements as the tokenizer writes them
   (prep.tokens.grammar.check_rows, one Numba pass per shard); the counts add up.
5. For ``--split time`` and ``time+probe``: every timestamped measurement of a train shard
   has time < test_from, of a test shard time >= test_from (prep.tokens.rowdecode).

What the rows cannot show: measurements encoded without a timestamp carry no time, so the
time rule holds for the timestamped ones only; "no probe in both splits" is not checked,
since the probe key is not tokenized and probes behind a NAT share source addresses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from prep.base.errors import InputError, first_line
from prep.jobs.pool import Pool, WorkerDied
from prep.schema import manifest as mf
from prep.schema import rows
from prep.schema.manifest import SPLITS
from prep.schema.splits import SPLIT_RULES, TIME_RULES, format_time
from prep.tokens import grammar
from prep.tokens.decode import DecodeError, decode_context

_MAX_PER_SHARD = 5  # problems reported per shard before "…and more"


def verify_dir(shards_dir: str | Path, *, workers: int = 1) -> list[str]:
    """Every problem found, one line each; empty when the folder is a sound dataset."""
    d = Path(shards_dir)
    m = mf.load_manifest(d)  # also: every shard path inside d, row_len an int, splits listed
    try:
        problems = check_counts(m)
    except KeyError as e:
        problems = [f"{mf.MANIFEST_NAME}: no field {e}; re-run `prep shards` to rebuild it"]
    except (TypeError, ValueError, AttributeError) as e:
        problems = [f"{mf.MANIFEST_NAME}: a malformed field ({first_line(e)}); re-run "
                    "`prep shards` to rebuild it"]
    entries = [e for s in SPLITS for e in m.get("splits", {}).get(s, {}).get("shards", [])]
    listed = {e["path"] for e in entries}
    for split in SPLITS:
        for f in sorted((d / split).glob("*")) if (d / split).is_dir() else []:
            if f"{split}/{f.name}" not in listed:
                problems.append(f"{f}: not listed in the manifest")
    cfg = m.get("config", {})
    rule = cfg.get("split", "probe")
    cutoff = cfg.get("test_from") if rule in TIME_RULES and _is_int(cfg.get("test_from")) else None
    tasks = [(str(d), e, m["row_len"], cutoff) for e in entries]
    if workers > 1 and len(tasks) > 1:
        try:
            with Pool(workers, preload=(__name__,)) as pool:
                per_shard = list(pool.imap(check_shard, tasks, [str(d / e["path"]) for e in entries]))
        except WorkerDied as e:
            raise InputError(f"prep verify: {e.what}; nothing was checked to the end; run again"
                             + (" with fewer --workers" if e.oom else "")) from None
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
    cfg = m["config"]
    epochs = cfg["epochs"]
    rule, test_from = cfg.get("split", "probe"), cfg.get("test_from")
    if rule not in SPLIT_RULES:
        out.append(f"{where}: config split {rule!r} is none of {', '.join(SPLIT_RULES)}")
    elif rule in TIME_RULES and not _is_int(test_from):
        out.append(f"{where}: config split {rule!r} without an int cutoff test_from "
                   f"({test_from!r})")
    elif rule not in TIME_RULES and test_from is not None:
        out.append(f"{where}: config split {rule!r} with a cutoff test_from ({test_from!r})")
    excluded = c.get("measurements_excluded_by_split", 0)
    if rule != "time+probe":
        expect("measurements_excluded_by_split", excluded, 0)
    expect("measurements_tokenized", c["measurements_tokenized"],
           (c["measurements_accepted"] - excluded) * epochs)
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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_shard(task: tuple[str, dict, int, int | None]) -> list[str]:
    """Problems of one shard file (a plain list of lines, so it crosses processes cheaply).

    The records are joined into one [rows, record_size] block: headers are checked as
    columns, tokens and segment ids go through prep.tokens.grammar.check_rows in one call, and
    only rows it flags are looked at again, one by one, for their message. With a time
    split's cutoff (the task's last item, None for ``probe``), the sound rows are decoded
    (prep.tokens.rowdecode.decode_rows) and every timestamped measurement is held to the rule of
    the shard's split.
    """
    shards_dir, entry, row_len, cutoff = task
    path = mf.shard_path(shards_dir, entry["path"])  # inside the folder (load_manifest checked)
    if not path.is_file():
        return [f"{path}: missing (listed in the manifest)"]
    out = []
    if "size" in entry and path.stat().st_size != entry["size"]:
        out.append(f"{path}: {path.stat().st_size:,} bytes, the manifest lists {entry['size']:,}")
    digest = mf.file_sha256(path)
    if digest != entry["sha256"]:
        out.append(f"{path}: sha256 {digest[:16]}… differs from the manifest's "
                   f"{entry['sha256'][:16]}…")
    try:
        mf.record_count(path)  # a truncated file opens "fine" with 0 records: ask its status
        reader = ArrayRecordReader(str(path))
        records = reader.read_all()
        reader.close()
    except InputError as e:
        return out + [str(e)]
    except Exception as e:  # array_record raises plain RuntimeError/ValueError on damage
        return out + [f"{path}: not a readable ArrayRecord file ({first_line(e)})"]
    if len(records) != entry["records"]:
        out.append(f"{path}: {len(records):,} records, the manifest lists {entry['records']:,}")

    block = rows.decode_block(records, row_len)
    fits, idx, head_ok, n_head = block.fits, block.index, block.header_ok, block.n_segments
    tok, seg = np.ascontiguousarray(block.tokens), np.ascontiguousarray(block.segment_ids)
    n_meas, n_tok, n_seg, error, error_pos = grammar.check_rows(tok, seg)
    sound = head_ok & (error == 0) & (n_head == n_seg)

    row_of = np.cumsum(fits) - 1  # record i is row row_of[i] of the block where it fits
    for i in np.union1d(np.flatnonzero(~fits), idx[~sound]).tolist():  # in record order
        where, k = f"{path}#{i}", row_of[i]
        if not fits[i] or not head_ok[k]:
            out.append(_header_problem(records[i], where, row_len))
        elif error[k]:
            out.append(_row_problem(tok[k], seg[k], int(error[k]), int(error_pos[k]), where))
        else:
            out.append(f"{where}: the header says {n_head[k]} segments, "
                       f"the row has {n_seg[k]}")
        if len(out) >= _MAX_PER_SHARD:
            return out + [f"{path}: …and possibly more problems"]
    for what, got in (("measurements", n_meas), ("tokens", n_tok), ("segments", n_seg)):
        got = int(got[sound].sum())
        if what in entry and got != entry[what]:
            out.append(f"{path}: {got:,} {what} decoded, the manifest lists {entry[what]:,}")
    if cutoff is not None and sound.any():
        out.extend(_time_problems(tok[sound], seg[sound], idx[sound], entry["split"], cutoff,
                                  path, _MAX_PER_SHARD - len(out)))
    return out


def _time_problems(tok, seg, records, split: str, cutoff: int, path: Path,
                   room: int) -> list[str]:
    """One line per record of a ``split`` shard holding a timestamped measurement on the
    wrong side of ``cutoff`` (train: time < cutoff; test: time >= cutoff), at most ``room``."""
    from prep.tokens.rowdecode import decode_rows

    ms = decode_rows(tok, seg, where=str(path))
    late = ms.time >= cutoff
    bad = ms.has_time & (late if split == "train" else ~late)
    if not bad.any() or room <= 0:
        return []
    first = np.flatnonzero(bad)
    first = first[np.unique(ms.row[first], return_index=True)[1]]  # each record's first
    side = ("at or after", "before")[split != "train"]
    out = []
    for i in first[:room].tolist():
        t = int(ms.time[i])
        out.append(f"{path}#{int(records[ms.row[i]])} segment {int(ms.segment[i])}: a "
                   f"measurement at {format_time(t)} ({t}) is {side} the test cutoff "
                   f"{format_time(cutoff)} ({cutoff}), in the {split} split")
    if len(first) > room:
        out.append(f"{path}: …and {len(first) - room:,} more records like these")
    return out


def _header_problem(record: bytes, where: str, row_len: int) -> str:
    """What is wrong with a record whose header or size is not a row of this row_len."""
    try:
        rows.check_record(record, row_len, where=where)
    except rows.RowFormatError as e:
        return str(e)
    raise AssertionError(f"{where}: flagged, but a sound row")


def _row_problem(tok: np.ndarray, seg: np.ndarray, error: int, pos: int, where: str) -> str:
    """One line for a row that grammar.check_rows flagged; a grammar error gets
    decode_context's own message for its segment where decode_context rejects it too."""
    message = grammar.MESSAGES[error]
    if error == grammar.EMPTY_ROW:
        return f"{where}: {message}"
    if error in grammar.LAYOUT_CODES:
        return f"{where}: {message} (token {pos})"
    s = seg[pos - 1]  # the segment at fault (see prep.tokens.grammar)
    a = int(np.argmax(seg == s))
    b = a + int(np.count_nonzero(seg == s))
    try:
        decode_context(tok[a:b].tolist())
    except DecodeError as e:
        return f"{where} segment {s}: {e}"
    return f"{where} segment {s}: token {pos - a}: {message}"
