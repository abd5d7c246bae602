"""`prep`: turn ping measurements into packed, training-ready token shards.

Usage:
    prep synth --out data/raw --rows 3000000 --probes 2000 --days 2 --seed 0
    prep import-atlas tests/fixtures/ripe-atlas/api tests/fixtures/ripe-atlas/dump --out data/atlas
    prep import-matrix tests/fixtures/seattle --out data/seattle --interval 300 --unit s
    prep kernels
    prep shards data/raw --out shards --workers 2 --seed 0
    prep verify shards
    prep inspect shards --split test --rows 0:2
    prep analyze-padding data/raw --crop 1024

Each command validates its flags, builds one frozen config, and calls the library.
Results go to stdout; progress, warnings and summaries to stderr. Bad input is one
line on stderr and exit code 2.
"""

from __future__ import annotations

import gc
import sys

import click

from prep.base.errors import InputError
from prep.base.options import Finite, LocalPath, options
from prep.base.plotfile import PlotFile
from prep.shards.config import TIME, ShardsConfig

# what the commands that write an --out share, one wording each
REPLACE_PARQUET = click.option(
    "--overwrite", is_flag=True,
    help="Replace the parquet files already in --out (nothing else may be there); they stay "
         "until the new output is complete.")
SUMMARY_JSON = click.option("--json", "as_json", is_flag=True,
                            help="Print the summary as one JSON object on stdout.")


class _Group(click.Group):
    """Turns InputError into one line on stderr and exit code 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ping-pack", prog_name="prep")
def main():
    """Offline ETL for ping measurements: validate, tokenize, bin-pack, write shards.

    \b
    Example, from RIPE Atlas results to training shards:
      prep import-atlas results/ --out data/atlas
      prep shards data/atlas --out shards
      prep verify shards
    """


@main.command()
@click.option("--out", required=True, type=LocalPath(output=True, file_okay=False),
              help="Folder for hourly parquet files.")
@click.option("--rows", default=3_000_000, show_default=True, type=click.IntRange(min=1))
@click.option("--probes", default=3_000, show_default=True, type=click.IntRange(min=1, max=1_000_000))
@click.option("--days", default=2, show_default=True, type=click.IntRange(min=1, max=366))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--access-ms", default=8.0, show_default=True, type=Finite(min=0),
              help="Each probe's access delay, a lognormal with this median (ms) added to all "
                   "its RTTs (0: none).")
@click.option("--access-sigma", default=1.1, show_default=True, type=Finite(min=0),
              help="Sigma of that lognormal.")
@click.option("--detour", default=0.15, show_default=True, type=Finite(min=0),
              help="Sigma of each (probe, target) stream's lognormal routing detour factor.")
@click.option("--anycast-sites", default=30, show_default=True, type=click.IntRange(min=0),
              help="Each root server gets 2 to this many sites and a probe's RTT to it is "
                   "the distance to the nearest (0: a draw per probe and root).")
@REPLACE_PARQUET
def synth(out, rows, probes, days, seed, access_ms, access_sigma, detour, anycast_sites,
          overwrite):
    """Write realistic RIPE-Atlas-like measurements as hourly parquet files.

    \b
    Example:
      prep synth --out data/raw --rows 100000 --probes 300
      prep synth --out data/flat --access-ms 0 --detour 0.35 --anycast-sites 0
    (the second: the built-in world before 2026-11-29, where a probe's replies say nothing
    of each other; by default they do, as real ones do: docs/learning.md §8.10, §8.12)
    """
    from pathlib import Path

    from prep.ingest.synth import SynthConfig
    from prep.ingest.synth import synth as run

    _interruptible(run, SynthConfig(out=Path(out), rows=rows, probes=probes, days=days,
                                    seed=seed, overwrite=overwrite, access_ms=access_ms,
                                    access_sigma=access_sigma, detour=detour,
                                    anycast_sites=anycast_sites), "prep synth")


@main.command("import-atlas")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder (or s3://BUCKET/PREFIX) for the parquet output.")
@click.option("--per-packet", is_flag=True, help="One row per packet instead of one per result.")
@click.option("--source", type=click.Choice(["public", "local"]), default="public", show_default=True,
              help="src_addr: public = the probe's public address (`from`, else `src_addr`); "
                   "local = its interface address (`src_addr`, often private). The local one "
                   "is kept in src_addr_local either way.")
@click.option("--errors", type=click.Choice(["skip", "failed"]), default="skip", show_default=True,
              help="A result whose packets are only local errors ({\"error\": ...}, no reply, no "
                   "timeout): skip = rejected as local_error; failed = an rtt -1 row like a timeout.")
@click.option("--workers", default=0, show_default=True, type=click.IntRange(min=0),
              help="Processes, one input file each; 0 = one per core. The output does not depend on it.")
@click.option("--strict", is_flag=True, help="A malformed JSON line is an error, not a rejected row.")
@REPLACE_PARQUET
@SUMMARY_JSON
def import_atlas(inputs, out, per_packet, source, errors, workers, strict, overwrite, as_json):
    """Convert RIPE Atlas ping results (JSON, JSON lines, .bz2 dumps) to parquet.

    INPUTS are files or folders (searched recursively for .json, .jsonl, .ndjson, .bz2,
    .gz). One parquet file per input file; rejected results are counted by reason.

    \b
    Example:
      prep import-atlas ping-2026-01-01T00:00.bz2 measurement-1001.json --out data/atlas
    """
    import json
    from pathlib import Path

    from prep.base.storage import is_remote
    from prep.ingest.atlas import AtlasConfig
    from prep.ingest.atlas import import_atlas as run

    summary = _interruptible(run, AtlasConfig(
        inputs=tuple(p if is_remote(p) else Path(p) for p in inputs),
        out=out if is_remote(out) else Path(out), per_packet=per_packet,
        strict=strict, source=source, errors=errors, workers=workers, overwrite=overwrite), "prep import-atlas")
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))


def _interruptible(run, cfg, command: str):
    """``run(cfg)`` under prep.base.signals.exit_on_interrupt (the run's output folder,
    prep.jobs.claim, has removed its staging folder)."""
    from prep.base.signals import exit_on_interrupt

    with exit_on_interrupt(command):
        return run(cfg)


@main.command("import-matrix")
@click.argument("inputs", nargs=-1, required=True, type=LocalPath())
@click.option("--out", required=True, type=LocalPath(output=True, file_okay=False),
              help="Folder for the parquet output (DIR/matrix.parquet).")
@click.option("--interval", required=True, type=click.IntRange(min=1), metavar="SECONDS",
              help="Seconds each frame covers: frame f is [start + f*interval, "
                   "start + (f+1)*interval).")
@click.option("--unit", required=True, type=click.Choice(["s", "ms", "us"]),
              help="The matrices' RTT unit (Seattle's is s); converted to ms.")
@click.option("--start", type=TIME, default="2026-01-01T00:00:00Z", show_default=True,
              metavar="TIME", help="Frame 0's start: ISO-8601 (UTC unless an offset is "
                                   "given) or Unix seconds.")
@REPLACE_PARQUET
@SUMMARY_JSON
@click.option("--quiet", is_flag=True, help="No progress bar.")
def import_matrix(inputs, out, interval, unit, start, overwrite, as_json, quiet):
    """Convert latency matrices (one N×N RTT matrix per time frame) to parquet.

    INPUTS are files, one time frame each, or folders standing for the files directly
    in them: N lines of N whitespace-separated RTTs, entry (i, j) measured from node i to
    node j, the format of the network-coordinate data sets (King, Meridian, PlanetLab,
    Seattle). Frames are taken in natural order of their paths (SeattleData_2 before
    SeattleData_10), whatever order they are given in. Node i gets one stable public-looking
    IPv4 address and prb_id i + 1; frame f's measurements are spread over its interval.
    The diagonal and entries <= 0 are rejected (counted by reason); a token that is not a
    number, ragged rows, a non-square matrix or frames of different N are an error.

    \b
    Example (the first 4 frames of the Seattle set, 99 nodes, in seconds; all 688 in
    the GitHub repository uofa-rzhu3/NetLatency-Data):
      prep import-matrix tests/fixtures/seattle --out data/seattle --interval 300 --unit s
      prep shards data/seattle --out shards-seattle --split time+probe --row-len 256
    """
    import json
    from pathlib import Path

    from prep.ingest.matrix import MatrixConfig
    from prep.ingest.matrix import import_matrix as run

    summary = _interruptible(run, MatrixConfig(
        inputs=tuple(Path(p) for p in inputs), out=Path(out), interval_s=interval, unit=unit,
        start=start, overwrite=overwrite, progress=not quiet), "prep import-matrix")
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))


@main.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", required=True, help="Folder (or s3://BUCKET/PREFIX: written locally, "
              "uploaded, manifest.json last) for train/, test/ and manifest.json.")
@click.option("--workers", default=0, show_default="0: one per core", type=click.IntRange(0),
              help="Processes (--runner local; for Beam's, --beam-option "
                   "direct_num_workers=N); never changes the output bytes.")
@options(ShardsConfig)
@click.option("--runner", type=click.Choice(["local", "beam"]), default="local", show_default=True,
              help="local: a process pool; beam: Apache Beam (same bytes; needs ping-pack[beam]).")
@click.option("--beam-option", "beam_options", multiple=True, metavar="KEY=VALUE",
              help="Beam pipeline option, repeatable: direct_running_mode=multi_processing "
                   "with direct_num_workers=N runs N worker processes here; runner="
                   "DataflowRunner with project=…, region=…, temp_location=gs://…, "
                   "extra_package=dist/ping_pack-….whl runs on Dataflow (README).")
@click.option("--overwrite", is_flag=True,
              help="Replace the dataset already in --out; it stays intact until the new one "
                   "is complete.")
@SUMMARY_JSON
@click.option("--quiet", is_flag=True, help="No progress bars.")
def shards(inputs, out, workers, runner, beam_options, overwrite, as_json, quiet, **settings):
    """Validate, tokenize and pack INPUT parquet files or folders into shards in --out.

    \b
    Examples:
      prep shards data/atlas --out shards --split time --test-from 2026-01-02
      prep shards data/raw --out shards-256 --split time+probe --row-len 256   # CPU recipe
      prep shards data/raw --out shards --runner beam \\
          --beam-option direct_running_mode=multi_processing --beam-option direct_num_workers=2
      prep shards s3://bucket/atlas --out s3://bucket/shards   # AWS_* settings, see README
    """
    import json

    from prep.base.signals import exit_on_interrupt, stop_on_signals
    from prep.shards.dataset import format_summary

    if settings["test_from"] is not None and settings["split"] == "probe":
        raise InputError("--test-from applies to --split time or time+probe; --split probe "
                         "holds out --test-fraction of the probes whatever the time")
    try:
        cfg = ShardsConfig(**settings)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    # the run itself (prep.jobs.claim.claim) stops its workers and removes its staging
    # folder before the signal's one line
    with exit_on_interrupt(), stop_on_signals():
        if runner == "beam":
            from prep.shards.beam_runner import run_beam

            summary = run_beam(list(inputs), out, cfg, beam_options_kv=beam_options,
                               progress=not quiet, overwrite=overwrite)
        else:
            from prep.shards.local_runner import run_shards

            summary = run_shards(list(inputs), out, cfg, workers=_workers(workers),
                                 progress=not quiet, overwrite=overwrite)
    click.echo(format_summary(summary), err=True)
    if as_json:
        click.echo(json.dumps(summary, sort_keys=True))


@main.command()
def kernels():
    """Compile the Numba kernels `prep shards` runs into Numba's cache, or load them if
    cached; say which, and in how many seconds. `make setup` runs it, so that a first
    `prep shards` and each test process load them (prep.shards.kernels).

    \b
    Example:
      prep kernels    # prep kernels: kernels loaded from Numba's cache in 0.4 s (18; none compiled)
    """
    from prep.shards.kernels import compile_kernels

    compile_kernels(None, "prep kernels")


@main.command()
@click.argument("shards_dir")
@click.option("--workers", default=0, show_default="0: one per core", type=click.IntRange(0),
              help="Processes.")
def verify(shards_dir, workers):
    """Check a shards folder against its manifest; list the problems (exit 1) or exit 0.

    \b
    Examples:
      prep verify shards
      prep verify s3://bucket/shards   # through the local cache (README: object storage)
    """
    from prep.schema.cache import local_dataset
    from prep.tools.verify import verify_dir

    # a bucket's dataset: its local copy, with what it holds as it is (verify says what differs)
    local = local_dataset(shards_dir, strict=False)
    problems = verify_dir(local, workers=_workers(workers))
    for p in problems:
        click.echo(p if str(local) == shards_dir else p.replace(str(local), shards_dir.rstrip("/")))
    if problems:
        from prep.base.words import count

        click.echo(f"{shards_dir}: {count(len(problems), 'problem')}; re-run `prep shards` to "
                   "rebuild it", err=True)
        sys.exit(1)
    click.echo(f"{shards_dir}: ok", err=True)


@main.command()
@click.argument("shards_dir")
@click.option("--split", type=click.Choice(["train", "test"]), show_default="both",
              help="Only this split.")
@click.option("--rows", "rows_range", default=None, metavar="A:B",
              show_default="all",
              help="Rows A (inclusive) to B (exclusive) of each split, in manifest order.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row.")
def inspect(shards_dir, split, rows_range, as_json):
    """Print rows for people: each segment's measurements (or JSON lines with --json).

    \b
    Example:
      prep inspect shards --split test --rows 0:2
    """
    from prep.schema.cache import local_dataset
    from prep.tools.inspect_rows import format_row, iter_rows, parse_range, row_json

    start, stop = parse_range(rows_range)
    local = local_dataset(shards_dir, splits=[split] if split else None)
    for row in iter_rows(local, split=split, start=start, stop=stop):
        click.echo(row_json(row) if as_json else format_row(row))


def _workers(n: int) -> int:
    """0: one per core this process may run on."""
    from prep.jobs.pool import cores

    return n or cores()

@main.command("analyze-padding")
@click.argument("input_path", metavar="INPUT", type=LocalPath(exists=True))
@click.option("--crop", default=None, type=click.IntRange(16, 65535),
              help="Row length / crop in tokens [default: a shards folder's own, else 1024].")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1),
              help="Rows per step, for the steps column.")
@click.option("--max-segments", default=16, show_default=True, type=click.IntRange(1, 255),
              help="Segment cap of the capped packer variant.")
@click.option("--grain-sample", default=2000, show_default=True, type=click.IntRange(0),
              help="Contexts given to each Grain packer (they run in Python); 0 = all.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0),
              help="Tokenizer seed.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@click.option("--plot", type=PlotFile(),
              help="Write the figure here (.png, .pdf, .svg; no suffix: .png).")
def analyze_padding(input_path, crop, batch_size, max_segments, grain_sample, seed, as_json,
                    plot):
    """Padding of every packing strategy on INPUT (parquet measurements or a shards folder).

    \b
    Example:
      prep analyze-padding data/atlas --crop 1024 --plot padding.png
    """
    import json

    from prep.tools import analyze

    cfg = analyze.AnalyzeConfig(crop=analyze.crop_for(input_path, crop), batch_size=batch_size,
                                max_segments=max_segments, grain_sample=grain_sample, seed=seed)
    click.echo(f"analyze-padding {input_path}: {analyze.config_line(cfg)}", err=True)
    result = analyze.analyze(analyze.load(input_path, cfg), cfg)
    click.echo(json.dumps(result) if as_json else analyze.format_report(result))
    if plot:
        analyze.plot(result, plot)
        click.echo(f"wrote {plot}", err=True)


def run() -> None:
    """The `prep` console script: ``main``, then, as the process ends, the collector's final
    pass told to skip what the command left (``gc.freeze``): walking the objects of Numba,
    LLVM and Arrow took ~0.1 s of every `prep shards` exit (3 % of a 10M-row run), and a
    process that ends frees its memory whole. Objects still die by their reference counts,
    files close; only garbage in reference cycles is left to the exit."""
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    run()
