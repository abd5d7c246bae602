"""A dataset as both runners of `prep shards` build it: the frame around their passes.

``build`` is the one run of `prep shards`: it lists the inputs, claims the output folder
(prep.jobs.claim, the shards layout, on a folder or a bucket prefix; inputs in a bucket are
downloaded into its staging folder, prep.base.storage, unless the runner's workers read
them in place, ``Passes.reads_buckets``), hashes the inputs on a helper thread, cuts them
into read units
(``read_units``), resolves the bucket count, prints the start line, calls the runner's
``Passes`` (prep.shards.local_runner's process pool, prep.shards.beam_runner's pipeline) and
ends with ``finish``. A runner brings only its passes: pass 1 (read, validate, route to
buckets) and pass 2 (``prep.shards.bucket.process_bucket`` per bucket); with a time split
and no ``--test-from`` it finds the cutoff between them and hands it to
``Passes.found_cutoff``.

Also shared: the pass-1 counts added up (``new_read_counts``, ``add_read_counts``), the
config in its JSON form, the input files' identities, and the ending: the manifest
assembled from the counts and the per-bucket results (``build_manifest``), refused when it
holds no training rows (``check_not_empty``), then published by the claim
(``finish``); the closing summary (``summary``, ``format_summary``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import hashlib
import json
import math
import resource
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path, PurePosixPath

from prep.base import storage
from prep.base.errors import InputError
from prep.base.signals import signals_blocked
from prep.base.words import count
from prep.jobs.claim import claim
from prep.jobs.owned import Claim
from prep.schema import manifest as mf
from prep.schema.manifest import SPLITS
from prep.schema.splits import TIME_RULES, format_time
from prep.schema.validate import format_rejected, list_inputs, open_parquet, time_unit_hint
from prep.shards.bucket import ShardsConfig, resolve_buckets
from prep.shards.kernels import compile_kernels
from prep.shards.stages import StageClock

UNIT_ROWS = 1 << 20  # rows per read task (whole row groups; small files share one)


class Passes(abc.ABC):
    """A runner's own part of `prep shards`; ``build`` calls, in this order: ``start``,
    ``describe``, ``run``, ``stop`` (always, once ``start`` was called), ``timing``."""

    runner = "shards"  # prep.jobs.claim.claim's runner (its staging folder's name)
    says = "prep shards"  # how the run's lines on stderr start
    # Whether the workers read bucket inputs (``s3://…``) in place; else ``build``
    # downloads them into the staging folder first, as the local pool needs.
    reads_buckets = False

    def start(self) -> None:
        """Start workers, if any: SIGINT/SIGTERM are blocked, no input has been read (so
        Arrow has started no threads of its own)."""

    def describe(self, n_files: int, rows: int) -> str:
        """The start line, up to its config."""
        return f"{self.says}: {count(n_files, 'input file')}, {count(rows, 'row')}"

    @abc.abstractmethod
    def run(self, od: Claim, units: list, rows_total: int, cfg: ShardsConfig,
            t0: float) -> tuple[ShardsConfig, dict, list[dict]]:
        """Both passes, writing the shards into ``od.stage``: the config (with the cutoff
        found, ``found_cutoff``), the read counts (``new_read_counts``) and the per-bucket
        results, ordered by bucket. ``t0``: when the run started (perf_counter)."""

    def stop(self, failed: bool) -> None:
        """Stop the workers; ``failed``: the run is raising."""

    def timing(self) -> dict:
        """The manifest's ``timing`` (after ``stop``)."""
        return {}

    def found_cutoff(self, cfg: ShardsConfig, test_from: int) -> ShardsConfig:
        """A time split's default cutoff (prep.schema.splits.default_cutoff) into the
        config, and a line on stderr that says it."""
        cfg = replace(cfg, test_from=test_from)
        print(f"{self.says}: test from {format_time(test_from)} ({test_from}), the earliest "
              f"whole minute with at most {100 * cfg.test_fraction:g} % of the accepted "
              "measurements at or after it", file=sys.stderr)
        return cfg


def build(inputs: list[str], out: str, cfg: ShardsConfig, passes: Passes, *,
          overwrite: bool = False) -> dict:
    """Build the dataset in ``out`` with ``passes``; return the closing summary (also in
    the manifest). A dataset already in ``out`` is replaced only with ``overwrite``
    (prep.jobs.claim)."""
    t0 = time.perf_counter()
    clock = StageClock()  # the driver's own stages (prep.shards.stages)
    start = clock.now()
    # Inputs in a bucket are listed here (a wrong path or credentials fail before --out is
    # touched) and downloaded into the run's staging folder once it is claimed.
    remote = storage.remote_inputs(inputs, (".parquet",), "prep shards")
    local = [p for p in inputs if not storage.is_remote(p)]
    paths = list_inputs(local) if local or not remote else []
    progress = getattr(passes, "progress", True)
    with claim(out, layout="shards", command="prep shards", runner=passes.runner,
               overwrite=overwrite, progress=progress) as od:
        names: dict = {}
        if remote and passes.reads_buckets:  # the workers read the objects themselves
            names = {loc.uri: loc.uri for loc, _ in remote}
            paths = paths + list(names)
        elif remote:
            names = storage.download_inputs(remote, od.stage / "inputs", progress=progress)
            paths = paths + list_inputs(list(names))
        # in the order of the names the manifest gives them, whichever runner reads them
        paths = sorted(paths, key=lambda p: PurePosixPath(names.get(p, str(p))))
        hasher, stop_hashing, started, failed = None, threading.Event(), False, True
        try:
            # Workers and the hashing thread start before Arrow starts threads of its own,
            # with SIGINT/SIGTERM blocked: they reach the driver, which stops the workers.
            with signals_blocked():
                started = True
                passes.start()
                hasher = concurrent.futures.ThreadPoolExecutor(1)
                inputs_info = hasher.submit(lambda: [file_info(p, stop_hashing, names.get(p))
                                                     for p in paths])
            clock.since("main_prepare", start)
            with clock("main_units"):
                units, rows_total = read_units(paths)
            cfg = resolve_buckets(cfg, rows_total)
            print(f"{passes.describe(len(paths), rows_total)}; config {config_to_json(cfg)}",
                  file=sys.stderr)
            with clock("main_compile"):
                compile_s, compiled = compile_kernels(od.stage, passes.says, only_missing=True)
            cfg, read, results = passes.run(od, units, rows_total, cfg, t0)
            infos = inputs_info.result()
            same_bytes(infos)
            failed = False
        finally:
            if hasher:
                stop_hashing.set()
                hasher.shutdown(wait=not failed, cancel_futures=True)
            if started:
                passes.stop(failed)
        return finish(od, cfg, infos, read, results, t0,
                      passes.timing() | {"compile_s": round(compile_s, 3),
                                         "kernels_compiled": compiled}, clock)


def finish(od: Claim, cfg: ShardsConfig, inputs: list[dict], read: dict,
           results: list[dict], t0: float, timing: dict, clock: StageClock) -> dict:
    """Both runners' ending: the manifest from the read counts and the per-bucket results
    (ordered by bucket), written into the staging folder and published (prep.jobs.claim).
    ``timing``'s ``stage_s`` and ``stage_cpu_s``, the workers' stages (a runner that times
    them), get the driver's from ``clock``."""
    with clock("main_manifest"):
        manifest = build_manifest(cfg, inputs, read, results)
        check_not_empty(od.path, manifest)
    clock.add(timing)
    timing = timing | clock.report()
    elapsed = time.perf_counter() - t0
    manifest["elapsed_s"] = round(elapsed, 3)
    # the rate of the run's work: a first run's one-off kernel compile is not part of it
    work_s = elapsed - timing.get("compile_s", 0.0)
    manifest["timing"] = timing | {
        "measurements_per_s": round(read["rows_in"] / max(work_s, 1e-9))}
    od.publish(manifest)
    return summary(manifest)


def new_read_counts() -> dict:
    """Pass 1's counts, which both runners add up per unit (add_read_counts)."""
    return {"rows_in": 0, "accepted": 0, "rejected": Counter(), "misread_times": Counter()}


def add_read_counts(read: dict, unit: dict) -> None:
    read["rows_in"] += unit["rows_in"]
    read["accepted"] += unit["accepted"]
    read["rejected"].update(unit["rejected"])
    read["misread_times"].update(unit["misread_times"])


def check_not_empty(out: Path, manifest: dict) -> None:
    """InputError, before anything is published, when the dataset would have no train rows:
    a finished-looking empty dataset is worse than an error."""
    c, n = manifest["counts"], sum(manifest["counts"]["rows"].values())
    if c["rows"]["train"]:
        return
    if not c["rows_in"]:
        why = "the inputs hold no rows"
    elif not c["measurements_accepted"]:
        top = format_rejected(c["rows_rejected"], top=3)
        hint = time_unit_hint(c["rows_rejected"], c.get("time_out_of_range_as", {}))
        why = (f"all {c['rows_in']:,} measurements were rejected ({top}); "
               + (hint or "`prep import-atlas` writes only rows that pass these checks"))
    elif n:
        cfg = manifest["config"]
        why = (f"all {n:,} rows went to the test split (--split {cfg['split']}, --test-fraction "
               f"{cfg['test_fraction']:g}); lower --test-fraction or give more probes")
    else:
        why = f"{c['measurements_accepted']:,} measurements were accepted but none was tokenized"
    raise InputError(f"{out}: no training rows written: {why}; nothing was published")


def needs_cutoff(cfg: ShardsConfig) -> bool:
    """A time split whose cutoff is to be found from the data (no --test-from)."""
    return cfg.split in TIME_RULES and cfg.test_from is None


def build_manifest(cfg: ShardsConfig, inputs: list[dict], read: dict, results: list[dict]) -> dict:
    """The manifest (without timing fields) from the read counts and the bucket results.
    ``cfg`` is the resolved config (a time split's cutoff an int)."""
    if needs_cutoff(cfg):
        raise ValueError(f"split {cfg.split!r}: the cutoff test_from is not resolved")
    splits = {s: {"rows": 0, "measurements": 0, "tokens": 0, "contexts": 0, "segments": 0,
                  "probes": 0, "shards": []} for s in SPLITS}
    hist: dict[str, int] = {}
    for r in results:
        for s in SPLITS:
            splits[s]["probes"] += r["probes"][s]
        for k, v in r["segments_per_row"].items():
            hist[k] = hist.get(k, 0) + v
    # Shards listed by (split, epoch, bucket): a reader taking one epoch takes a prefix.
    shards = sorted((s | {"bucket": r["bucket"]} for r in results for s in r["shards"]),
                    key=lambda s: (SPLITS.index(s["split"]), s["epoch"], s["bucket"]))
    tokens_by_pass: dict[tuple[str, int], int] = {}
    for s in shards:
        sp = splits[s["split"]]
        sp["rows"] += s["records"]
        for k in ("measurements", "tokens", "contexts", "segments"):
            sp[k] += s[k]
        sp["shards"].append(s)
        key = (s["split"], s["epoch"])
        # Lower bound: whole contexts, tokens added by cuts count against the packer.
        tokens_by_pass[key] = tokens_by_pass.get(key, 0) + s["context_tokens"]
    lower = sum(math.ceil(t / cfg.row_len) for t in tokens_by_pass.values())
    rows = sum(sp["rows"] for sp in splits.values())
    tokens = sum(sp["tokens"] for sp in splits.values())
    counts = {
        "rows_in": read["rows_in"],
        "rows_rejected": dict(sorted(read["rejected"].items())),
        # of the time_out_of_range rows, integers in range as ms or us (validate.misread_times)
        "time_out_of_range_as": dict(sorted(read["misread_times"].items())),
        "measurements_accepted": read["accepted"],
        # Accepted but in neither split (time+probe: held-out probes before the cutoff,
        # the other probes from it on); tokenized = (accepted - excluded) x epochs.
        "measurements_excluded_by_split": sum(r["excluded"] for r in results),
        "measurements_tokenized": sum(sp["measurements"] for sp in splits.values()),
        "contexts": sum(sp["contexts"] for sp in splits.values()),
        "segments": sum(sp["segments"] for sp in splits.values()),
        "rows": {s: splits[s]["rows"] for s in SPLITS},
        "tokens": tokens,
        "padding_tokens": rows * cfg.row_len - tokens,
    }
    return mf.header(cfg.row_len) | {
        "config": json.loads(config_to_json(cfg)), "seed": cfg.seed,
        "inputs": inputs, "counts": counts,
        "padding_fraction": (rows * cfg.row_len - tokens) / (rows * cfg.row_len) if rows else 0.0,
        "lower_bound_rows": lower,
        "rows_over_lower_bound": rows / lower if lower else 1.0,
        "segments_per_row": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "splits": splits,
    }


def summary(manifest: dict) -> dict:
    """The closing summary: what `prep shards --json` prints."""
    c, t, cfg = manifest["counts"], manifest.get("timing", {}), manifest["config"]
    test_from = cfg.get("test_from")
    split = {"rule": cfg.get("split", "probe"), "test_fraction": cfg["test_fraction"],
             "test_from": test_from,
             "test_from_iso": None if test_from is None else format_time(test_from)}
    return {"measurements_in": c["rows_in"], "measurements_rejected": sum(c["rows_rejected"].values()),
            "rejected_by_reason": c["rows_rejected"], "measurements_tokenized": c["measurements_tokenized"],
            "measurements_excluded_by_split": c.get("measurements_excluded_by_split", 0),
            "split": split,
            "contexts": c["contexts"], "segments": c["segments"], "rows": c["rows"],
            "tokens": c["tokens"], "padding_fraction": manifest["padding_fraction"],
            "lower_bound_rows": manifest["lower_bound_rows"],
            "rows_over_lower_bound": manifest["rows_over_lower_bound"],
            "elapsed_s": manifest.get("elapsed_s"),
            "measurements_per_s": t.get("measurements_per_s"), "workers": t.get("workers"),
            "compile_s": t.get("compile_s", 0.0), "kernels_compiled": t.get("kernels_compiled"),
            "peak_rss_mb": t.get("peak_rss_mb"), "stage_s": t.get("stage_s"),
            "stage_cpu_s": t.get("stage_cpu_s"),
            "buckets": cfg["n_buckets"],
            # each bucket's last row of each split and epoch may be part-filled
            "bucket_tail_rows": cfg["n_buckets"] * len(SPLITS) * cfg["epochs"],
            "warnings": [w for w in [time_unit_hint(c["rows_rejected"],
                                                    c.get("time_out_of_range_as", {}))] if w]
            + split_warnings(manifest)}


# Below these a split still builds, but what is measured on it (or learned from it) is noise.
MIN_SPLIT_SHARE, MIN_SPLIT_MEASUREMENTS = 0.01, 100


def split_warnings(manifest: dict) -> list[str]:
    """A line per split holding under 1 % of the rows or under 100 measurements."""
    rows = manifest["counts"]["rows"]
    total = sum(rows.values())
    out = []
    for s in SPLITS:
        n, meas = rows[s], manifest.get("splits", {}).get(s, {}).get("measurements", 0)
        if total and (n < MIN_SPLIT_SHARE * total or meas < MIN_SPLIT_MEASUREMENTS):
            fix = ("a `train eval` on it means little; give more probes, a larger "
                   "--test-fraction or an earlier --test-from" if s == "test" else
                   "too little to train on; lower --test-fraction or give more data")
            out.append(f"the {s} split holds {n:,} of {total:,} rows "
                       f"({100 * n / total:.3g} %) and {meas:,} measurements: {fix}")
    return out


def format_summary(s: dict) -> str:
    rej = format_rejected(s["rejected_by_reason"])
    rows = s["rows"]["train"] + s["rows"]["test"]
    sp = s["split"]
    if sp["test_from"] is None:
        split = f"{sp['rule']}, {100 * sp['test_fraction']:g} % of the probes in test"
    else:
        split = f"{sp['rule']}, test from {sp['test_from_iso']} ({sp['test_from']})"
        if sp["rule"] == "time+probe":
            split += (f", {100 * sp['test_fraction']:g} % of the probes held out; "
                      f"{s['measurements_excluded_by_split']:,} measurements in neither split")
    return "\n".join([
        f"prep shards: done in {s['elapsed_s']:.1f} s, "
        f"{s['measurements_per_s']:,} measurements/s on {count(s['workers'], 'worker')}"
        + (f" (the {s['compile_s']:.1f} s of compiling kernels left out of the rate)"
           if s.get("compile_s") else ""),
        f"  measurements  {s['measurements_in']:,} in, {s['measurements_rejected']:,} rejected ({rej})",
        f"  split         {split}",
        f"  contexts      {s['contexts']:,} ({s['segments']:,} segments after cuts)",
        f"  rows          {rows:,} (train {s['rows']['train']:,}, test {s['rows']['test']:,}); "
        f"lower bound {s['lower_bound_rows']:,} (x{s['rows_over_lower_bound']:.4f})",
        f"  buckets       {s['buckets']}" + (
            f"; up to {min(s['bucket_tail_rows'], rows - s['lower_bound_rows']):,} of the "
            f"{rows - s['lower_bound_rows']:,} rows over the lower bound are the buckets' "
            "part-filled last rows (fewer --buckets pack tighter, with more memory per worker)"
            if s["buckets"] > 1 and rows > s["lower_bound_rows"] else ""),
        f"  tokens        {s['tokens']:,}, padding {100 * s['padding_fraction']:.3f} %",
    ] + [f"warning: {w}" for w in s.get("warnings", [])])


def read_units(paths: list[Path]) -> tuple[list[list[tuple[str, list[int]]]], int]:
    """Inputs cut into units of whole row groups, about UNIT_ROWS rows each.

    Small files (synth writes one per hour) share a unit; a big file spans several.
    """
    units, unit, n, total = [], [], 0, 0
    for p in paths:
        md = open_parquet(p).metadata
        groups = []
        for rg in range(md.num_row_groups):
            rows = md.row_group(rg).num_rows
            if n and n + rows > UNIT_ROWS:
                if groups:
                    unit.append((str(p), groups))
                units.append(unit)
                unit, groups, n = [], [], 0
            groups.append(rg)
            n += rows
        if groups:
            unit.append((str(p), groups))
        total += md.num_rows
    if unit:
        units.append(unit)
    return units, total


def config_to_json(cfg: ShardsConfig) -> str:
    """The config as JSON: the start-up echo, pool tasks, the Beam pipeline."""
    return json.dumps(asdict(cfg))


def config_from_dict(d: dict) -> ShardsConfig:
    """ShardsConfig from its JSON form (the manifest's ``config``, a pool task)."""
    d = dict(d)
    d["mode_weights"] = tuple(d["mode_weights"])
    return ShardsConfig(**d)


def same_bytes(infos: list[dict]) -> None:
    """InputError if two inputs hold the same bytes (a copy under another name): every
    measurement in them would be read twice, as if measured twice. Checked once the inputs
    are hashed (beside the read), before the dataset is published."""
    first: dict[str, str] = {}
    for e in infos:
        seen = first.setdefault(e["sha256"], e["name"])
        if seen != e["name"] and e["size"]:
            raise InputError(f"{seen} and {e['name']}: the same bytes (sha256 "
                             f"{e['sha256'][:12]}…); each measurement would count twice; give "
                             "each file once")


def file_info(p: Path | str, stop: threading.Event | None = None, name: str | None = None) -> dict:
    """An input's identity for the manifest; ``name``: what to call it (a downloaded
    input's URI), else its path. A bucket path is hashed as it streams from the bucket."""
    if storage.is_remote(p):
        size, sha = storage.digest(storage.Remote.parse(p), stop)
        return {"name": p, "size": size, "sha256": sha}
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
            if stop is not None and stop.is_set():
                break  # the run failed: the caller no longer waits for this
            h.update(chunk)
    return {"name": name or str(p), "size": p.stat().st_size, "sha256": h.hexdigest()}


def own_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the
    parent across exec, so a big parent (a benchmark harness) would show up as ours."""
    with contextlib.suppress(OSError):  # not Linux: fall back to getrusage below
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
