"""Owning an output folder: the one way every command that writes (`prep shards`,
`prep import-atlas`, `prep synth`, `prep import-matrix`) claims, stages, publishes and
releases its ``--out``.

``claim(out, layout=..., command=..., runner=...)`` picks the backend by the path and the
layout by the command; what the block writes goes into ``.stage``, and ``.publish`` makes it
the folder's content; whatever ends the block, the claim is released. Step by step:

1. Claim: lock ``out/.lock`` (prep.base.lock) for the whole run; a second run into the
   folder fails at once, in one line naming the first one's pid. Forked workers inherit it.
2. Check before touching anything: ``out`` is a folder; everything in it is either the
   layout's output or one of our own dot-folders (by name AND marker ``.ping-pack-owner``:
   role, pid, token). Anything else is refused, named (``foreign``), never deleted. Output
   already there is replaced only with ``--overwrite``.
3. Recover: a dead run's folders (the lock is ours, so their runs are gone) are finished
   if it was killed while publishing, then removed, their marker last.
4. Stage: ``.tmp-<runner>-<pid>-<token>/``; every file of the run is written there.
5. Publish, with SIGINT/SIGTERM held until it ends, so that a reader sees the old output
   or the new one, never a mix; a SIGKILL half-way is finished by the next run.
6. Release: the staging folder is removed, ``.lock`` removed and unlocked, and a folder
   this run made is removed again unless it was published. A full, read-only or not
   writable disk anywhere is one line naming the folder and the fix, exit 2.

Two layouts: a shards dataset (prep.jobs.outdir: ``train/``, ``test/``, ``manifest.json``
last) and a set of parquet files (prep.jobs.parquet_out). Two backends: a local folder,
published by renames (those two modules), and a bucket prefix, staged in a local folder
claimed as above and uploaded, the manifest or the list of files to publish written last
(prep.jobs.remote_out: S3 has no rename and no lock).
"""

from __future__ import annotations

from prep.base import storage
from prep.jobs import outdir, parquet_out, remote_out
from prep.jobs.owned import claim_local


def claim(out, *, layout: str, command: str, runner: str, overwrite: bool = False,
          progress: bool = True):
    """The output folder (or bucket prefix) ``out`` claimed for ``layout`` ("shards" or
    "parquet"): a context manager yielding the claim (``.path``, ``.stage``, ``.publish``)."""
    if storage.is_remote(str(out)):
        return remote_out.claim(str(out), layout=layout, command=command, runner=runner,
                                overwrite=overwrite, progress=progress)
    kind = {"shards": outdir.OutDir, "parquet": parquet_out.ParquetOut}[layout]
    return claim_local(kind, out, command=command, runner=runner, overwrite=overwrite)
