"""`train`: train a decoder-only transformer on packed shards.

Usage:
    train --data shards/
"""

from __future__ import annotations

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", type=click.Path(), default="shards", show_default=True,
              help="A shards folder written by `prep shards`.")
def main(data):
    """Train on DATA (not built yet)."""
    raise click.ClickException("the trainer is not built yet")


if __name__ == "__main__":
    main()
