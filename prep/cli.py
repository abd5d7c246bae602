"""`prep`: turn ping measurements into packed, training-ready token shards.

Usage:
    prep synth --out data/raw --rows 3000000 --probes 2000 --days 2 --seed 0
    prep import-atlas ../shared/data/ripe-atlas/api ../shared/data/ripe-atlas/dump --out data/atlas
    prep shards data/raw --out shards --workers 2 --seed 0
    prep verify shards
    prep inspect shards --split test --rows 0:2
    prep analyze-padding data/raw --crop 1024

Each command validates its flags, builds one frozen config, and calls the library.
Results go to stdout; progress, warnings and summaries to stderr. Bad input is one
line on stderr and exit code 2.
"""

from __future__ import annotations

import sys

import click

from prep.errors import InputError


class _Group(click.Group):
    """Turns InputError into one line on stderr and exit code 2, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except InputError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Offline ETL for ping measurements: validate, tokenize, bin-pack, write shards."""


# --- synth / import-atlas (foundation) ---------------------------------------------
# --- end synth / import-atlas ------------------------------------------------------

# --- shards / verify / inspect -----------------------------------------------------
# --- end shards / verify / inspect -------------------------------------------------

# --- analyze-padding ---------------------------------------------------------------
# --- end analyze-padding -----------------------------------------------------------


if __name__ == "__main__":
    main()
