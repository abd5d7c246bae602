"""``ShardsConfig``: everything that decides the bytes of the shards, saved in the manifest.

Each field that `prep shards` takes as a flag carries it (prep.base.options): the flag, its
help and its default are written here once, and prep/cli.py builds the options from them.
Kept light (no kernels) so that `prep --help` does not load them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import click

from prep.base.options import Finite, Parsed, setting
from prep.schema import splits
from prep.schema.manifest import MAX_GAP_S
from prep.schema.rows import MAX_SEGMENTS

# ISO-8601 (UTC unless it carries an offset) or Unix seconds -> int Unix seconds
TIME = Parsed("TIME", splits.parse_time)
COMPRESSIONS = "zstd:N (N up to 22), brotli:N (N up to 11), snappy or uncompressed"


def writer_options(compression: str) -> str:
    """The ArrayRecordWriter options of every shard: a record per chunk (group_size:1, for
    the readers' random access), compressed by ``compression``."""
    return f"group_size:1,{compression}"


def parse_compression(text: str) -> str:
    """``text`` if ArrayRecord's writer takes ``writer_options(text)`` (tried on the null
    device, before any work: the workers met it after the whole read pass), else ValueError
    naming the forms."""
    from array_record.python.array_record_module import ArrayRecordWriter  # not at --help

    try:
        ArrayRecordWriter(os.devnull, writer_options(text)).close()
    except ValueError as e:  # "Unknown option foo, valid options: <all the writer's>"
        why = str(e).split(", valid")[0]
        own = "; prep sets group_size:1 itself" if "group_size" in text else ""
        raise ValueError(f"{text}: {why}; use {COMPRESSIONS}{own}") from None
    return text


@dataclass(frozen=True)
class ShardsConfig:
    """Everything that decides the bytes of the shards (saved in the manifest)."""

    seed: int = setting(
        0, "--seed", "Seeds the encoding and the cuts.", show_default=True,
        type=click.IntRange(0))
    # epoch k uses epoch_seed(seed, k)
    test_fraction: float = setting(
        0.1, "--test-fraction", show_default=True, type=Finite(0, 1),
        help="Share of probes held out for test (--split probe, time+probe); with a time "
             "split and no --test-from, also the share of measurements at or after the "
             "default cutoff.")
    split: str = setting(  # the rules: prep.schema.splits
        "probe", "--split", type=click.Choice(list(splits.SPLIT_RULES)), show_default=True,
        help="probe: each probe's whole history in train or test; time: measurements "
             "before --test-from in train, the others in test; time+probe: test = the "
             "held-out probes from --test-from on, train = the other probes before it, "
             "the rest in neither split (counted in the manifest).")
    test_from: int | None = setting(
        None, "--test-from", type=TIME,
        show_default="the earliest whole minute with at most --test-fraction of the "
                     "measurements at or after it",
        help="Cutoff of the time splits: ISO-8601 (2026-01-02T12:00:00Z, 2026-01-02; "
             "UTC unless an offset is given) or Unix seconds; test = time >= it.")
    row_len: int = setting(
        1024, "--row-len", show_default=True, type=click.IntRange(64, 65535),
        help="Tokens per row, the model's sequence length; no context is longer. "
             "256 for the CPU recipe (`train --model small`, docs/learning.md) and "
             "for latency matrices.")
    max_segments: int = setting(  # segment ids are uint8 (prep.schema.rows)
        0, "--max-segments", show_default=True, type=click.IntRange(0, MAX_SEGMENTS),
        help="Cap on contexts per row (0 = none).")
    max_measurements: int = setting(
        0, "--max-measurements", show_default=True, type=click.IntRange(0),
        help="Cap on measurements per context (0 = none).")
    max_gap_s: int = setting(
        MAX_GAP_S, "--max-gap", show_default=True, type=click.IntRange(0),
        help="Cut a context after a silence longer than this many seconds (0 = never).")
    max_span_s: int = 0  # cut a context covering more than this many seconds (0 = never)
    mode_weights: tuple[float, float, float] = (0.4, 0.3, 0.3)  # timestamp modes full/partial/none
    epochs: int = setting(
        1, "--epochs", show_default=True, type=click.IntRange(1),
        help="Passes over the data, each encoded and cut with its own seed.")
    # hash partitions, fixed here so outputs never depend on workers; 0 = from the input's
    # row count (bucket.resolve_buckets: one per BUCKET_ROWS, so a small input packs as one
    # bucket), the command's default
    n_buckets: int = setting(
        16, "--buckets", cli_default=0, show_default="0: one per 250,000 input rows",
        type=click.IntRange(0),
        help="Hash partitions of the probes: more bound the memory per worker, fewer "
             "pack tighter (each ends in part-filled rows).")
    # snappy writes and reads faster than zstd for a little more size (docs/measurements.md)
    compression: str = setting(
        "snappy", "--compression", show_default=True,
        type=Parsed("TEXT", parse_compression),
        help=f"ArrayRecord compression: {COMPRESSIONS}.")

    def __post_init__(self):
        if not 0.0 <= self.test_fraction <= 1.0:
            raise ValueError(f"test_fraction {self.test_fraction}: must be within [0, 1]")
        if self.epochs < 1 or self.n_buckets < 0:
            raise ValueError("epochs must be >= 1 and n_buckets >= 0 (0: from the input)")
        if not 0 <= self.max_segments <= MAX_SEGMENTS:
            raise ValueError(f"max_segments {self.max_segments}: 0 (no cap) to {MAX_SEGMENTS}")
        if self.split not in splits.SPLIT_RULES:
            raise ValueError(f"split {self.split!r}: one of {', '.join(splits.SPLIT_RULES)}")
        if self.test_from is not None:
            if self.split not in splits.TIME_RULES:
                raise ValueError(f"test_from applies to split {' or '.join(splits.TIME_RULES)}, "
                                 f"not {self.split!r}")
            if (isinstance(self.test_from, bool) or not isinstance(self.test_from, int)
                    or not -(1 << 63) <= self.test_from < (1 << 63)):
                raise ValueError(f"test_from {self.test_from!r}: must be int Unix seconds")
        self.context_config()  # its own checks (row_len, limits, weights)

    def context_config(self):
        """The prep.pack.contexts.ContextConfig of these settings."""
        from prep.pack.contexts import ContextConfig  # the kernels: not at `prep --help`

        return ContextConfig(row_len=self.row_len, max_measurements=self.max_measurements,
                             max_gap_s=self.max_gap_s, max_span_s=self.max_span_s,
                             mode_weights=tuple(self.mode_weights))
