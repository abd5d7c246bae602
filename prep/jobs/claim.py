"""Owning an output: the one way every command that writes (`prep shards`, `prep import-atlas`,
`prep synth`, `prep import-matrix`) claims, stages, publishes and releases its ``--out``.

``with claim(out, layout=..., ...) as od``: the run writes into ``od.stage``, then calls
``od.publish``; whatever ends the block, the claim is released (prep.jobs.owned.Claim.held).

1. Claim: lock ``.lock`` for the whole run (prep.base.lock); a second run fails at once, in
   one line naming the first one's pid. Forked workers inherit the lock.
2. Check before touching anything: everything there is either the layout's output or one of
   our own dot-folders (by name AND marker ``.ping-pack-owner``: role, pid, token); anything
   else is refused, named, never deleted. Output already there is replaced only with
   ``--overwrite``.
3. Recover: a dead run's leftovers are finished if it was killed while publishing, then
   removed, their marker last.
4. Stage: ``.tmp-<runner>-<pid>-<token>/``, where every file of the run is written.
5. Publish, SIGINT/SIGTERM held until it ends: a reader sees the old output or the new one,
   never a mix; a SIGKILL half-way is finished by the next run.
6. Release: what was staged and not published is removed, the lock released, a folder this
   run made removed again unless it was published. A full, read-only or not writable disk
   is one line naming the folder and the fix, exit 2.

Two backends: a local folder, published by renames (owned.FolderClaim), and a bucket prefix,
staged in a local folder claimed as above and published by an object written last
(remote_out.BucketClaim: S3 has no rename and no lock). Two layouts: a shards dataset,
``manifest.json`` last (outdir), and a set of parquet files (parquet_out).
"""

from __future__ import annotations

from prep.base import storage
from prep.jobs.outdir import OutDir
from prep.jobs.parquet_out import ParquetOut
from prep.jobs.remote_out import RemoteDataset, RemoteParquet

KINDS = {("folder", "shards"): OutDir, ("folder", "parquet"): ParquetOut,
         ("bucket", "shards"): RemoteDataset, ("bucket", "parquet"): RemoteParquet}


def claim(out, *, layout: str, command: str, runner: str, overwrite: bool = False,
          progress: bool = True):
    """The output folder (or bucket prefix) ``out`` claimed for ``layout`` ("shards" or
    "parquet"): a context manager yielding the claim (``.path``, ``.stage``, ``.publish``).
    ``runner`` names the staging folder; ``progress``: a bar for an upload."""
    kind = KINDS["bucket" if storage.is_remote(str(out)) else "folder", layout]
    return kind(out, command=command, runner=runner, overwrite=overwrite,
                progress=progress).held()
