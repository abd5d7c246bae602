"""A parquet file written a table at a time, by `prep import-matrix` and `train predict`.

``TableFile`` opens the file at the first table (with its schema, or the one given, and the
writer's options) and closes it at the end of its ``with`` block; when the block fails it
closes quietly, so that the block's error, not the half-written file's, is the one a user
sees. Where the file goes on failure (a staging folder, a ``.part`` file) is its owner's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class TableFile:
    """``path`` as a parquet file; ``schema``: the file's even with no table written (an
    empty file), else the first table's; ``options``: pyarrow.parquet.ParquetWriter's."""

    def __init__(self, path: str | os.PathLike, schema: pa.Schema | None = None, **options):
        self.path, self.schema, self.options = Path(path), schema, options
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self._open(table.schema)
        self._writer.write_table(table)

    def _open(self, schema: pa.Schema) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = pq.ParquetWriter(self.path, schema, **self.options)

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            if self._writer is not None:
                with contextlib.suppress(Exception):  # the block's error is the one to see
                    self._writer.close()
            return
        if self._writer is None and self.schema is not None:
            self._open(self.schema)  # nothing written: an empty file
        if self._writer is not None:
            self._writer.close()
