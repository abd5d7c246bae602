"""`prep analyze-padding`: what each way of filling 1024-token rows costs, on the same contexts.

Every strategy sees the same context lengths (tokens) and reports rows, steps at a batch
size, padding fraction, tokens lost to truncation, segments per row (p50/p99/max) and
useful (kept, non-padding) tokens per row:

- ``pad-to-crop``: one context per row, padded to the crop (how ping-llm trained).
- ``probe-window``: one crop-sized window of each probe's whole history (the sum of its
  contexts' lengths), padded, the rest truncated (ping-llm's "probe chunk" examples).
- ``grain-first-fit-B`` / ``grain-best-fit-B``: Grain's own online packers
  (FirstFitPackIterDataset / BestFitPackIterDataset, B bins) run for real on the lengths;
  being slow Python, on a seeded sample (order kept) of ``grain_sample`` contexts, rows
  scaled to the whole but never below the lower bound, as the note says (0: all of them).
- ``packer`` / ``packer-capK``: our offline packer (prep.pack.packing), on the measurement-level
  arrays, so it may split contexts; ``capK`` with at most K segments per row. On a shards
  folder ``packer`` is what the shards hold (rows read back; equals the manifest).
- ``lower-bound``: ceil(tokens / crop).

Input is parquet (contexts planned as ``prep shards`` plans them with its defaults, per
split and bucket, row_len = crop) or a shards folder at its own row length. A shards
folder stores the packer's pieces, already cut to fit, so the strategies run on its
contexts as planned again from the manifest's inputs and config (held to its sha256s and
context count), beside the rows the shards hold; without those inputs the report is the
stored packing against the lower bound only, and says which input to analyze for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prep.base import sniff
from prep.base.words import count
from prep.pack import packing

HIST_BIN = 64  # tokens per bar of the length histogram
COMMAND = "prep analyze-padding"
NONE_FOUND = (f"no .parquet files found, nor a shards folder's manifest.json; `{COMMAND}` reads "
              f"{sniff.READS[COMMAND]}")


@dataclass(frozen=True)
class AnalyzeConfig:
    crop: int = 1024  # row length / crop, tokens
    batch_size: int = 64  # rows per step, for the steps column
    grain_bins: tuple[int, ...] = (4, 32, 256)  # num_packing_bins tried for Grain's packers
    grain_sample: int = 2_000  # contexts given to each Grain packer (Python); 0 = all
    max_segments: int = 16  # the capped packer variant
    seed: int = 0  # tokenizer seed for parquet input; also picks the Grain sample


@dataclass(frozen=True)
class Contexts:
    """What the strategies run on. ``arrays`` lets the packer split; ``probe`` groups histories."""
    lengths: np.ndarray  # int64 tokens per context (or per stored segment, for shards)
    probe: np.ndarray | None = None  # int64 probe group of each context
    arrays: tuple | None = None  # (ctx_start, ctx_end, cost, has_ts, abs_extra)
    shard_rows: np.ndarray | None = None  # shards input: int64[rows, 2] (real tokens, segments)
    source: str = "lengths"
    unit: str = "contexts"  # what ``lengths`` counts: contexts, or the shards' stored segments
    lower_bound: int | None = None  # a shards folder's own (its manifest's, per split)
    note: str = ""  # a line the report prints under its header


def _entry(name, rows, kept, truncated, segs, crop, batch, note=""):
    segs = np.asarray(segs if segs is not None else [], np.int64)
    pct = (lambda q: int(np.percentile(segs, q, method="higher"))) if len(segs) else \
        (lambda q: None)
    return {"name": name, "rows": int(rows), "steps": -(-int(rows) // batch),
            "padding_fraction": 1 - kept / (rows * crop) if rows else 0.0,
            "truncated_tokens": int(truncated),
            "segments_p50": pct(50), "segments_p99": pct(99),
            "segments_max": int(segs.max()) if len(segs) else None,
            "useful_tokens_per_row": kept / rows if rows else 0.0, "note": note}


def grain_rows(lengths: np.ndarray, *, crop: int, best_fit: bool, bins: int) -> np.ndarray:
    """Segments of each row Grain's packer makes from ``lengths`` (in that order)."""
    import grain

    ds = grain.MapDataset.source([{"t": np.ones(int(n), np.int32)} for n in lengths])
    cls = (grain.experimental.BestFitPackIterDataset if best_fit
           else grain.experimental.FirstFitPackIterDataset)
    packed = cls(ds.to_iter_dataset(), length_struct={"t": crop}, num_packing_bins=bins,
                 shuffle_bins=False)
    return np.array([int(ex["t_segment_ids"].max()) for ex in packed], np.int64)


def scaled_rows(sample_rows: int, sample: int, total: int, lower_bound: int) -> int:
    """Rows for ``total`` contexts from a packer's rows on ``sample`` of them, never fewer
    than the lower bound (a lucky sample must not look better than possible)."""
    return max(round(sample_rows * total / sample), lower_bound) if sample else lower_bound


def strategies(ctx: Contexts, cfg: AnalyzeConfig) -> list[dict]:
    crop, batch = cfg.crop, cfg.batch_size
    n = len(ctx.lengths)
    kept = np.minimum(ctx.lengths, crop)
    tokens = int(ctx.lengths.sum())
    if ctx.unit != "contexts":  # stored pieces: only what the shards hold is comparable
        real, segs = ctx.shard_rows[:, 0], ctx.shard_rows[:, 1]
        return [_entry("packer", len(real), real.sum(), 0, segs, crop, batch,
                       "as stored in the shards"),
                _entry("lower-bound", _lower(ctx, tokens, crop), tokens, 0, None, crop, batch,
                       "the manifest's (per split)")]
    out = [_entry("pad-to-crop", n, kept.sum(), tokens - kept.sum(), np.ones(n), crop, batch)]
    if ctx.probe is not None:
        hist = np.bincount(ctx.probe, weights=ctx.lengths).astype(np.int64)
        hist = hist[hist > 0]
        win = np.minimum(hist, crop)
        out.append(_entry("probe-window", len(hist), win.sum(), tokens - win.sum(),
                          np.ones(len(hist)), crop, batch))
    if n:
        rng = np.random.default_rng(cfg.seed)
        size = n if not cfg.grain_sample else min(n, cfg.grain_sample)
        pick = np.sort(rng.choice(n, size, replace=False))
        sample = kept[pick]
        lower = -(-int(kept.sum()) // crop)
        note = "" if len(pick) == n else \
            f"estimated: {len(pick):,} of {n:,} contexts, rows scaled (>= lower bound)"
        for best in (False, True):
            for b in cfg.grain_bins:
                segs = grain_rows(sample, crop=crop, best_fit=best, bins=b)
                out.append(_entry(f"grain-{'best' if best else 'first'}-fit-{b}",
                                  scaled_rows(len(segs), len(pick), n, lower), kept.sum(),
                                  tokens - kept.sum(), segs, crop, batch, note))
    if ctx.shard_rows is not None:
        real, segs = ctx.shard_rows[:, 0], ctx.shard_rows[:, 1]
        out.append(_entry("packer", len(real), real.sum(), 0, segs, crop, batch,
                          "as stored in the shards (pieces restart their timestamps)"))
    else:
        arrays = ctx.arrays or (np.arange(n), np.arange(1, n + 1), kept,
                                np.zeros(n, bool), np.zeros(n, np.int64))
        for name, cap in (("packer", 0), (f"packer-cap{cfg.max_segments}", cfg.max_segments)):
            p = packing.pack(*arrays, row_len=crop, max_segments=cap)
            segs = np.bincount(p.piece_row, minlength=p.n_rows)
            note = "" if ctx.arrays else "whole contexts (lengths only: no splitting)"
            out.append(_entry(name, p.n_rows, p.piece_len.sum(dtype=np.int64),
                              tokens - kept.sum(), segs, crop, batch, note))
    out.append(_entry("lower-bound", _lower(ctx, tokens, crop), tokens, 0, None, crop, batch,
                      "" if ctx.lower_bound is None else "the manifest's (per split)"))
    return out


def _lower(ctx: Contexts, tokens: int, crop: int) -> int:
    return ctx.lower_bound if ctx.lower_bound is not None else -(-tokens // crop)


def analyze(ctx: Contexts, cfg: AnalyzeConfig) -> dict:
    # bars (lo - 1, lo - 1 + HIST_BIN]: 1-64 ... 961-1024, so a bar ends on the row length
    # and none crosses its line (a 1024-token context is in 961-1024, not in "1024-1087")
    top = max(cfg.crop, int(ctx.lengths.max(initial=0)))
    edges = np.arange(1, top + HIST_BIN + 1, HIST_BIN)
    counts, _ = np.histogram(ctx.lengths, bins=edges)
    tokens = int(ctx.lengths.sum())
    return {"source": ctx.source, "crop": cfg.crop, "batch_size": cfg.batch_size,
            "unit": ctx.unit, "contexts": int(len(ctx.lengths)), "tokens": tokens,
            "lower_bound_rows": _lower(ctx, tokens, cfg.crop), "note": ctx.note,
            "length_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
            "strategies": strategies(ctx, cfg)}


def from_parquet(paths: list[str], cfg: AnalyzeConfig, shards_cfg=None) -> Contexts:
    """Contexts exactly as ``prep shards`` plans them, per split and bucket: by a shards
    folder's ``shards_cfg`` (its ShardsConfig), else by the command's defaults at row_len =
    crop, buckets from the input's rows (a context's cuts depend on the other measurements
    of its split and bucket: the planner's supply of free bodies). Where those defaults put
    every probe in test, the note says `prep shards` would write nothing."""
    from prep.base.errors import InputError
    from prep.pack import contexts
    from prep.schema import validate
    from prep.shards.bucket import ShardsConfig, bucket_of, resolve_buckets, split_masks

    files = validate.find_files(paths, (".parquet",), NONE_FOUND, command=COMMAND,
                                kinds=("parquet",))
    m, rejected, rows_in = validate.read_validated(files)
    if not len(m):
        why = f", all rejected ({validate.format_rejected(rejected, top=3)})" if rows_in else ""
        raise InputError(f"{', '.join(map(str, paths))}: no measurements to analyze "
                         f"({count(len(files), 'parquet file')} of {count(rows_in, 'row')}"
                         f"{why}); `{COMMAND}` reads {sniff.READS[COMMAND]}")
    scfg = shards_cfg or resolve_buckets(
        ShardsConfig(row_len=cfg.crop, seed=cfg.seed, n_buckets=0), rows_in)
    b = bucket_of(m.probe, scfg.n_buckets)
    train, test = split_masks(m, scfg)
    parts = [m.take(np.flatnonzero(mask & (b == k))) for mask in (train, test)
             for k in range(scfg.n_buckets)]
    note = ""
    if not train.any():  # prep.shards.dataset.check_not_empty refuses it
        n = len(np.unique(m.probe))
        note = (f"`prep shards` with its defaults would write nothing of this: its "
                f"{count(n, 'probe')} {'is' if n == 1 else 'are all'} held out for test "
                f"(--split {scfg.split}, --test-fraction {scfg.test_fraction:g}), leaving no "
                "training rows; lower --test-fraction or give more probes")
    lengths, probe, arrays, off = [], [], [], 0
    for part in parts:
        if not len(part):
            continue
        plan = contexts.plan_contexts(part, scfg.context_config(),
                                      contexts.epoch_seed(scfg.seed, 0))
        lengths.append(plan.ctx_len.astype(np.int64))
        probe.append(plan.sorted.probe[plan.ctx_start].astype(np.int64))
        # one measurement index space over the parts, for the packer
        arrays.append((plan.ctx_start + off, plan.ctx_end + off, plan.cost, plan.has_ts,
                       plan.abs_extra))
        off += len(plan.sorted)
    _, group = np.unique(np.concatenate(probe), return_inverse=True)
    return Contexts(np.concatenate(lengths), group.astype(np.int64),
                    tuple(np.concatenate(a) for a in zip(*arrays)), note=note,
                    source=f"{', '.join(map(str, paths))} (parquet, {count(len(m), 'measurement')})")


def from_shards(shards_dir: str, cfg: AnalyzeConfig) -> Contexts:
    """A shards folder at its own row length: its contexts before packing (shards_inputs)
    beside its stored rows, else its stored segments alone. Each shard is held to the
    manifest first, sha256 included (prep.tools.inspect_rows.iter_rows): a shard of another
    build or a damaged one is InputError naming it."""
    from prep.base.errors import InputError
    from prep.schema.manifest import load_manifest
    from prep.shards.dataset import config_from_dict
    from prep.tools.inspect_rows import iter_rows

    man = load_manifest(shards_dir)
    if cfg.crop != man["row_len"]:
        raise InputError(f"--crop {cfg.crop}: the shards in {shards_dir} hold rows of "
                         f"{man['row_len']} tokens; analyze them with --crop {man['row_len']}, "
                         f"or analyze their parquet input with --crop {cfg.crop}")
    lengths, per_row = [], []
    for row in iter_rows(shards_dir, sha256=True):  # every row is read: check every digest
        c = np.bincount(row["segment_ids"])[1:]
        c = c[c > 0]
        lengths.append(c)
        per_row.append((int(c.sum()), len(c)))
    rows = np.array(per_row, np.int64).reshape(-1, 2)
    lens = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
    n_ctx = man["counts"]["contexts"]
    where = f"shards {shards_dir} ({count(len(rows), 'row')})"
    inputs, why = shards_inputs(shards_dir, man)
    if inputs:
        ctx = from_parquet(inputs, cfg, config_from_dict(man["config"]))
        if len(ctx.lengths) == n_ctx:
            return Contexts(ctx.lengths, ctx.probe, ctx.arrays, shard_rows=rows,
                            lower_bound=man["lower_bound_rows"],
                            source=f"{where}: its contexts planned again from its "
                                   f"{count(len(inputs), 'input file')}")
        why = (f"its inputs plan {len(ctx.lengths):,} contexts, the manifest counts "
               f"{n_ctx:,} (an epoch or split cut them)")
    return Contexts(lens, shard_rows=rows, source=where, unit="stored segments",
                    lower_bound=man["lower_bound_rows"],
                    note=f"these are the packer's pieces of {n_ctx:,} contexts, cut to fill "
                         f"rows; other packers are compared on the contexts, which need the "
                         f"inputs ({why}): prep analyze-padding INPUT --crop {cfg.crop}")


def shards_inputs(shards_dir: str, man: dict) -> tuple[list[str], str]:
    """The manifest's input files, found as named (from here, or from the shards folder's
    parent) and holding the bytes it recorded; else ([], why not)."""
    from prep.schema.manifest import file_sha256

    if man["config"].get("epochs", 1) != 1:
        return [], f"{man['config']['epochs']} epochs"
    found = []
    for e in man.get("inputs", []):
        name = Path(e["name"])
        paths = [name] if name.is_absolute() else [name, Path(shards_dir).parent / name]
        hit = next((p for p in paths if p.is_file() and p.stat().st_size == e.get("size")), None)
        if hit is None:
            return [], f"{e['name']} is not there"
        if e.get("sha256") and file_sha256(hit) != e["sha256"]:
            return [], f"{hit} changed since the build"
        found.append(str(hit))
    return (found, "") if found else ([], "the manifest lists none")


def is_shards(path: str) -> bool:
    """A shards folder, finished or not (its manifest or shard files): the rest is read as
    parquet, whose errors say what a folder of something else holds."""
    return Path(path).is_dir() and sniff.kind(path) == "shards"


def crop_for(path: str, crop: int | None) -> int:
    """--crop as given, else a shards folder's own row length (1024 for parquet)."""
    if crop is not None or not is_shards(path):
        return crop or AnalyzeConfig.crop
    from prep.schema.manifest import load_manifest

    return int(load_manifest(path)["row_len"])


def load(path: str, cfg: AnalyzeConfig) -> Contexts:
    if is_shards(path):
        return from_shards(path, cfg)
    return from_parquet([path], cfg)


def config_line(cfg: AnalyzeConfig) -> str:
    """``crop=1024, batch_size=64, grain_bins=4,32,256, ...``: the start-up echo."""
    from dataclasses import asdict

    return ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
                     for k, v in asdict(cfg).items())


def format_report(r: dict) -> str:
    unit = r.get("unit", "contexts")
    lines = [f"{r['source']}: {count(r['contexts'], unit[:-1], unit)}, "
             f"{count(r['tokens'], 'token')}, crop {r['crop']}, lower bound "
             f"{count(r['lower_bound_rows'], 'row')}"]
    lines += [f"note: {r['note']}"] if r.get("note") else []
    lines += ["", f"length histogram ({unit}):"]
    h = r["length_histogram"]
    top = max(h["counts"], default=0) or 1
    for lo, c in zip(h["edges"], h["counts"]):
        lines.append(f"  {lo:>5}-{lo + HIST_BIN - 1:<5} {c:>10,} {'#' * math.ceil(40 * c / top)}")
    lines += ["", f"{'strategy':<22} {'rows':>11} {'steps':>9} {'padding':>8} {'truncated':>12} "
              f"{'seg p50/p99/max':>16} {'useful/row':>10}  note"]
    for s in r["strategies"]:
        seg = "-" if s["segments_max"] is None else \
            f"{s['segments_p50']}/{s['segments_p99']}/{s['segments_max']}"
        lines.append(f"{s['name']:<22} {s['rows']:>11,} {s['steps']:>9,} "
                     f"{100 * s['padding_fraction']:>7.2f}% {s['truncated_tokens']:>12,} "
                     f"{seg:>16} {s['useful_tokens_per_row']:>10.1f}  {s['note']}")
    return "\n".join(lines)


GROUPS = (  # (name prefix, legend label, colour)
    ("packer", "ours: offline packer (prep/pack/packing.py)", "tab:green"),
    ("grain-", "Grain online packers (first/best fit, bins)", "tab:blue"),
    ("pad-to-crop", "ping-llm: one context per row, padded", "tab:gray"),
    ("probe-window", "ping-llm: one window per probe history", "darkgray"),
)


def plot(r: dict, path: str, *, title: str | None = None) -> None:
    """Context lengths and padding per strategy (log scale, so 0.1 % and 5 % both read),
    the lower bound as a reference line; titled with the data set and N."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        from prep.base.errors import InputError
        raise InputError("--plot needs matplotlib: pip install 'ping-pack[plots]'") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1, 1.3]})
    h = r["length_histogram"]
    unit = r.get("unit", "contexts")
    a.bar(np.array(h["edges"][:-1]) - 1, h["counts"], width=HIST_BIN, align="edge",
          color="tab:blue", label=unit)
    a.axvline(r["crop"], color="red", linestyle="--", label=f"row length {r['crop']}")
    a.set(xlabel=f"{unit[:-1]} length (tokens)", ylabel=f"{unit} (log scale)", yscale="log",
          title=f"{unit[0].upper()}{unit[1:-1]} lengths")
    a.legend(fontsize=8)

    rows = [s for s in r["strategies"] if s["name"] != "lower-bound"]
    lower = next(s for s in r["strategies"] if s["name"] == "lower-bound")
    colour = lambda n: next((c for p, _, c in GROUPS if n.startswith(p)), "black")
    pad = [max(100 * s["padding_fraction"], 1e-3) for s in rows]
    b.barh([s["name"] for s in rows], pad, color=[colour(s["name"]) for s in rows])
    for y, (s, v) in enumerate(zip(rows, pad)):
        est = " (est.)" if s["note"].startswith("estimated") else ""
        b.text(v * 1.08, y, f"{100 * s['padding_fraction']:.2f} %{est}", va="center", fontsize=8)
    lb = max(100 * lower["padding_fraction"], 1e-3)
    b.axvline(lb, color="black", linestyle=":", lw=1)
    b.set_xscale("log")
    b.set_xlim(min(pad + [lb]) / 2, max(pad) * 4)
    b.set(xlabel="padding, % of row tokens (log scale)", title="Padding per strategy")
    b.invert_yaxis()
    present = {p for p, _, _ in GROUPS if any(s["name"].startswith(p) for s in rows)}
    handles = [Patch(color=c, label=l) for p, l, c in GROUPS if p in present]
    handles.append(plt.Line2D([], [], color="black", linestyle=":",
                              label=f"lower bound ({lower['rows']:,} rows: {lb:.3f} %)"))
    b.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13),
             ncol=2, frameon=False)
    fig.suptitle(title or f"{r['source']}: N = {r['contexts']:,} {unit}, {r['tokens']:,} "
                 f"tokens, rows of {r['crop']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
