"""The bucket backend of an output folder (prep.jobs.claim describes the protocol):
``--out s3://…`` of `prep shards` and `prep import-atlas`.

Files are written into a local staging folder under ``$TMPDIR/ping-pack-out/``, claimed as a
local ``--out`` is (so a second run on this machine into the same URI fails at once), and
uploaded when the run is done. S3 has no rename and no lock, so what the local backend does
with renames is done here with a manifest written last, whole, in one PUT.

A dataset on a bucket (`prep shards --out s3://b/p`)::

    s3://b/p/manifest.json                           the dataset: written last
    s3://b/p/g<UTC time>-<token>/.ping-pack-owner    a generation's marker (role, host, pid)
    s3://b/p/g<UTC time>-<token>/train/….array_record, test/…   its shards

The manifest's shard paths lead into its generation, so readers follow it as a local one
(prep.schema.cache). A run, step by step:

1. Claim the local staging folder (above).
2. Check the prefix: it may hold ``manifest.json``, its shards, shard files under ``train/``
   and ``test/``, and our generations; anything else is refused, named. A dataset needs
   ``--overwrite``. A generation no manifest lists is removed when surely dead (marked
   ``old``, or from a gone process of this host), else named on stderr and left.
3. The runner builds the dataset in the staging folder; a runner whose workers share no
   disk with this process (Beam on a cluster) stages in a new generation instead
   (``stage_in_bucket``), marker first, and its JSON results are read and removed here.
4. Publish: upload every shard into a new generation (marker first), or check that the
   workers' generation holds exactly the manifest's shards. Then, SIGINT/SIGTERM held:
   read ``manifest.json`` again (``--overwrite`` checked again), PUT the new manifest (the
   switch: a reader sees the old dataset or the new one, whole), mark the replaced
   generation ``old`` and remove what only the old manifest listed.

A kill before the PUT leaves the old dataset and a generation no manifest lists (removed by
the next run here); after it, the new dataset. A prefix named like a generation but without
a marker (a killed driver's cluster workers writing on) is named and left alone. Two runs
on different machines each upload their own generation; the manifest that lands last wins.

A folder of parquet files on a bucket (`prep import-atlas --out s3://b/raw`)::

    s3://b/raw/*.parquet                             the output
    s3://b/raw/.tmp-<runner>-<pid>-<token>/          a run's upload: marker, files, .publish

Uploaded under the hidden prefix, then the list of files to remove and to copy in
(``.publish``) is written there and carried out by server-side copies; a kill leaves the
list, which the next run finishes, as prep.jobs.parquet_out does with renames. Until then
readers refuse the prefix in one line (prep.base.sniff.unfinished_publish).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path

from prep.base import storage
from prep.base.errors import FS_PROBLEMS, InputError
from prep.base.lock import pid_alive
from prep.base.signals import Interrupted
from prep.base.storage import Remote
from prep.jobs import outdir, parquet_out
from prep.jobs.outdir import SHARD_FILE
from prep.jobs.owned import (
    MARKER,
    claim_local,
    foreign,
    holds_dataset,
    holds_parquet,
    not_for_parquet,
)
from prep.schema import manifest as mf
from prep.schema.manifest import MANIFEST_NAME, SPLITS

GEN = re.compile(r"g\d{8}T\d{6}Z-[0-9a-f]{12}")
_TMP = re.compile(r"\.tmp-[a-z]+-\d+-[0-9a-f]{12}")
PUBLISH = parquet_out.PUBLISH


def staging_root() -> Path:
    """Where runs into a bucket stage their files: ``$TMPDIR/ping-pack-out``."""
    return Path(tempfile.gettempdir()) / "ping-pack-out"


def _local_for(loc: Remote) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{loc.scheme}-{loc.bucket}-{loc.key}")[:80]
    return staging_root() / f"{name}-{hashlib.sha256(loc.uri.encode()).hexdigest()[:8]}"


def _marker(role: str, token: str) -> bytes:
    return json.dumps({"tool": "ping-pack", "role": role, "host": socket.gethostname(),
                       "pid": os.getpid(), "token": token,
                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()


def _owner(loc: Remote) -> dict:
    try:
        m = json.loads(storage.read_bytes(loc.child(MARKER)) or b"null")
    except ValueError:
        m = None
    return m if isinstance(m, dict) else {}


def _surely_dead(owner: dict) -> bool:
    """Written by a process of this machine that is gone (or marked old by its replacer)."""
    if owner.get("role") == "old":
        return True
    pid = owner.get("pid")
    return (owner.get("host") == socket.gethostname() and isinstance(pid, int)
            and pid != os.getpid() and not pid_alive(pid))


def _remove_tree(loc: Remote) -> None:
    """Our objects under ``loc``, the marker last: a kill half-way leaves it recognisable."""
    storage.delete_tree(loc, last=MARKER)


def _leftovers(loc: Remote, trees: dict[str, list[str]], what: str) -> None:
    """Remove the dead ones of our unlisted trees; name the others on stderr."""
    for top in sorted(trees):
        owner = _owner(loc.child(top))
        if _surely_dead(owner):
            _remove_tree(loc.child(top))
        else:
            print(f"note: {loc}/{top}/ is {what} of a run on {owner.get('host', '?')} "
                  f"(pid {owner.get('pid', '?')}, started {owner.get('started', '?')}); left "
                  "alone: remove it once no run writes there", file=sys.stderr)


def _by_top(files: dict[str, int]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rel in files:
        top, _, rest = rel.partition("/")
        if rest:
            out.setdefault(top, []).append(rest)
    return out


@contextlib.contextmanager
def _claimed(loc: Remote, kind, **kw):
    """The local staging claim for ``loc``; its Interrupted names ``loc``, not the stage."""
    local = _local_for(loc)
    try:
        try:
            with claim_local(kind, local, overwrite=True, **kw) as od:
                yield od
        finally:
            with contextlib.suppress(OSError):  # nothing is ever published there
                local.rmdir()
    except Interrupted as e:
        raise Interrupted(e.signum, loc.uri, e.published, e.command) from None
    except InputError as e:
        text = str(e)
        if text.startswith(str(staging_root())) and any(w in text for w in FS_PROBLEMS):
            raise InputError(f"{e} (the local staging of {loc}: set TMPDIR to a disk with "
                             "room for the output)") from None
        if text.startswith(str(local)):  # e.g. another run on this machine writing loc
            raise InputError(f"{loc} (staged in {local}){text[len(str(local)):]}") from None
        raise


class RemoteDataset:
    """``--out`` of `prep shards` on a bucket: what prep.jobs.outdir.OutDir offers the
    runners (``path``, ``stage``, ``publish``); made by ``claim``."""

    def __init__(self, loc: Remote, local, overwrite: bool, progress: bool):
        self.loc, self.path, self.stage = loc, loc.uri, local.stage
        self.overwrite, self.progress, self.published = overwrite, progress, False
        self._local, self._token, self.gen = local, secrets.token_hex(6), None
        self._in_bucket: Remote | None = None  # the generation, when workers stage there

    def _read_prefix(self) -> tuple[dict | None, set[str]]:
        """The prefix's manifest (or None) and the paths it lists."""
        data = storage.read_bytes(self.loc.child(MANIFEST_NAME))
        if data is None:
            return None, set()
        try:
            m = json.loads(data)
            listed = {e["path"] for sp in m["splits"].values() for e in sp["shards"]}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InputError(f"{self.loc}/{MANIFEST_NAME}: unreadable; it is not a manifest "
                             "`prep shards` wrote: use another --out prefix") from None
        return m, {p for p in listed if isinstance(p, str)}

    def _open(self) -> None:
        loc = self.loc
        files = storage.list_files(loc)
        if "" in files:
            raise InputError(f"{loc}: an object, not a prefix; --out names a prefix "
                             "(a folder) of the bucket")
        self.old, listed = self._read_prefix()
        gens, stray = {}, False
        for top, rels in _by_top(files).items():
            unlisted = not any(f"{top}/{r}" in listed for r in rels)
            if GEN.fullmatch(top) and MARKER in rels:
                if unlisted:
                    gens[top] = rels
                continue
            if GEN.fullmatch(top) and unlisted:
                # written after its run removed it: a cluster's workers outlive their driver
                print(f"note: {loc}/{top}/ has no owner marker: what the workers of a Beam "
                      "job wrote after its run had given up; left alone: remove it once that "
                      "job has ended (cancel it if it still runs)", file=sys.stderr)
                continue
            for rel in rels:
                if not (top in SPLITS and SHARD_FILE.fullmatch(rel)):
                    raise foreign(loc, f"{top}/{rel}", "prep shards", "prefix")
                stray |= f"{top}/{rel}" not in listed
        for rel in files:
            if "/" not in rel and rel != MANIFEST_NAME:
                raise foreign(loc, rel, "prep shards", "prefix")
        _leftovers(loc, gens, "an unfinished dataset")
        if (self.old is not None or stray) and not self.overwrite:
            raise holds_dataset(loc, self.old is not None)

    def _new_generation(self) -> Remote:
        """This run's generation prefix, its marker written first."""
        self.gen = f"g{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{self._token}"
        gen = self.loc.child(self.gen)
        storage.write_bytes(gen.child(MARKER), _marker("staging", self._token))
        return gen

    def stage_in_bucket(self) -> str:
        """The run's staging location in the bucket, for workers that share no disk with
        this process (the Beam runner): this run's generation prefix, made now (marker
        first). The workers write their shards (``train/``, ``test/``) and their small
        results there; before ``publish`` the runner removes the results, so the
        generation holds what a published one holds. A failed or interrupted run removes
        it, as it removes an upload of its own."""
        if self._in_bucket is None:
            self._in_bucket = self._new_generation()
        return self._in_bucket.uri

    def _staged_in_bucket(self, manifest: dict) -> None:
        """What the workers wrote into the generation is exactly what ``manifest`` lists;
        RuntimeError otherwise (a bug: it stops the run before it publishes anything)."""
        staged = {r for r in storage.list_files(self._in_bucket) if r != MARKER}
        listed = {e["path"] for sp in manifest["splits"].values() for e in sp["shards"]}
        if staged != listed:
            raise RuntimeError(f"{self._in_bucket}: staged objects {sorted(staged ^ listed)[:3]} "
                               "do not match the manifest")

    def publish(self, manifest: dict) -> None:
        """Upload the staged shards into a new generation (or, staged there by the workers
        already, check them) and switch the manifest to it."""
        if self._in_bucket is not None:
            self._staged_in_bucket(manifest)
        else:
            staged = outdir.check_staged(self.stage, manifest)
            gen = self._new_generation()
            jobs = [(self.stage / rel, gen.child(rel)) for rel in staged]
            storage.transfer(jobs, storage.upload, desc="upload", progress=self.progress,
                             total=sum(p.stat().st_size for p, _ in jobs))
        new = json.loads(json.dumps(manifest))
        for sp in new["splits"].values():
            for e in sp["shards"]:
                e["path"] = f"{self.gen}/{e['path']}"
        body = mf.write_manifest(self.stage, new).read_bytes()  # the bytes a local run writes
        self._local.guard.defer = True  # SIGINT/SIGTERM wait for the end of the switch
        old, listed = self._read_prefix()
        if old is not None and self.old is None and not self.overwrite:
            raise InputError(f"{self.loc}: another run published a dataset there meanwhile; "
                             "pass --overwrite to replace it, or use another --out")
        storage.write_bytes(self.loc.child(MANIFEST_NAME), body)
        self.published = self._local.guard.published = True
        # the replaced dataset: its generation marked old (any later run may remove it),
        # then removed; shards in train/, test/ (a local dataset copied up) removed too
        tops = sorted({p.split("/")[0] for p in listed if p.split("/")[0] != self.gen})
        for top in tops:
            if GEN.fullmatch(top):
                storage.write_bytes(self.loc.child(top).child(MARKER), _marker("old", self._token))
                _remove_tree(self.loc.child(top))
        for split in SPLITS:
            storage.delete_tree(self.loc.child(split))

    def _abandon(self) -> None:
        """Remove this run's unpublished generation (what a failed upload left)."""
        if self.gen is None or self.published:
            return
        with contextlib.suppress(InputError):
            _remove_tree(self.loc.child(self.gen))


class RemoteParquet:
    """``--out`` of `prep import-atlas` on a bucket: what prep.jobs.parquet_out.ParquetOut
    offers (``path``, ``stage``, ``publish``); made by ``claim``."""

    def __init__(self, loc: Remote, local, command: str, runner: str, overwrite: bool):
        self.loc, self.path, self.stage, self.command = loc, loc.uri, local.stage, command
        self.runner, self.overwrite, self.published = runner, overwrite, False
        self._local, self._token, self.up = local, secrets.token_hex(6), None

    def _open(self) -> None:
        loc, cmd = self.loc, self.command
        files = storage.list_files(loc)
        if "" in files:
            raise InputError(f"{loc}: an object, not a prefix; --out names a prefix "
                             "(a folder) of the bucket")
        if MANIFEST_NAME in files:
            raise not_for_parquet(loc, "a shards dataset (the output of `prep shards`)", cmd,
                                  "prefix")
        trees = _by_top(files)
        for top, rels in trees.items():
            if not (_TMP.fullmatch(top) and MARKER in rels):
                raise foreign(loc, f"{top}/{rels[0]}", cmd, "prefix")
        for rel in files:
            if "/" not in rel and not rel.endswith(".parquet"):
                raise foreign(loc, rel, cmd, "prefix")
        for top, rels in sorted(trees.items()):
            if PUBLISH in rels:  # killed while publishing: finish it
                self._finish(loc.child(top))
                _remove_tree(loc.child(top))
        _leftovers(loc, {t: r for t, r in trees.items() if PUBLISH not in r}, "the upload")
        self.old = sorted(r for r in storage.list_files(loc) if "/" not in r)
        if self.old and not self.overwrite:
            raise holds_parquet(loc, self.old)

    def _finish(self, up: Remote) -> None:
        plan = json.loads(storage.read_bytes(up.child(PUBLISH)) or b"{}")
        have = storage.list_files(up)
        for name in plan.get("move", []):
            if name in have:
                storage.copy(up.child(name), self.loc.child(name))
        storage.delete([self.loc.child(n) for n in plan.get("remove", [])])

    def publish(self, names: list[str]) -> None:
        """Replace the prefix's parquet files with ``names`` from the staging folder."""
        self.up = self.loc.child(f".tmp-{self.runner}-{os.getpid()}-{self._token}")
        storage.write_bytes(self.up.child(MARKER), _marker("staging", self._token))
        jobs = [(self.stage / n, self.up.child(n)) for n in names]
        storage.transfer(jobs, storage.upload, desc="upload", progress=sys.stderr.isatty(),
                         total=sum(p.stat().st_size for p, _ in jobs))
        plan = {"remove": [n for n in self.old if n not in set(names)], "move": list(names)}
        self._local.guard.defer = True  # from here on, the next run finishes it
        storage.write_bytes(self.up.child(PUBLISH), json.dumps(plan).encode())
        self._finish(self.up)
        self.published = self._local.guard.published = True
        _remove_tree(self.up)

    def _abandon(self) -> None:
        if self.up is None or self.published:
            return
        with contextlib.suppress(InputError):
            if PUBLISH not in storage.list_files(self.up):
                _remove_tree(self.up)


@contextlib.contextmanager
def claim(out: str, *, layout: str, command: str, runner: str, overwrite: bool = False,
          progress: bool = True):
    """prep.jobs.claim.claim for a bucket: yields a RemoteDataset (``layout="shards"``) or a
    RemoteParquet. A run that fails or is interrupted removes what it uploaded; the old
    output stays."""
    loc = Remote.parse(out)
    kind = {"shards": outdir.OutDir, "parquet": parquet_out.ParquetOut}[layout]
    with _claimed(loc, kind, command=command, runner=runner) as local:
        od = (RemoteDataset(loc, local, overwrite, progress) if layout == "shards"
              else RemoteParquet(loc, local, command, runner, overwrite))
        try:
            od._open()
            yield od
        finally:
            local.guard.defer = True
            od._abandon()
