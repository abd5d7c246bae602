"""The bucket backend of an output (prep.jobs.claim describes the protocol): ``--out s3://…``
of `prep shards` and `prep import-atlas`. S3 has no rename and no lock: the files are staged in
a local folder under ``$TMPDIR/ping-pack-out/``, claimed as a local ``--out`` (a second run on
this machine into the same URI fails at once), and uploaded; what publishes them is one
object written last, whole, in one PUT. What a prefix may hold::

    s3://b/p/manifest.json                          a dataset: written last
    s3://b/p/g<UTC time>-<token>/.ping-pack-owner   a generation's marker (role, host, pid)
    s3://b/p/g<UTC time>-<token>/train/…, test/…    its shards (the manifest's paths lead here)
    s3://b/raw/*.parquet                            parquet files
    s3://b/raw/.tmp-<runner>-<pid>-<token>/         their upload: marker, files, .publish

A dataset: its shards go into a new generation (marker first; uploaded, or written there by
the Beam runner's workers, ``stage_in_bucket``), then the manifest is PUT (``--overwrite``
checked again), and the generation it replaced is marked ``old`` and removed. Parquet files:
uploaded under the hidden prefix, then the list of files to remove and to copy in
(``.publish``) is written there and carried out by server-side copies. Killed before the
manifest or the list, a run leaves the old output, and an upload that the next run here
removes if surely dead (marked ``old``, or from a gone process of this host; else it is
named and left, as is a generation without a marker: a killed driver's workers writing on);
killed after the list, a publish that the next run finishes (readers refuse the prefix until
then, prep.base.sniff). Two runs on different machines each upload their own generation; the
manifest that lands last wins.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

from prep.base import storage
from prep.base.errors import FS_PROBLEMS, InputError
from prep.base.lock import pid_alive
from prep.base.signals import Guard
from prep.base.storage import Remote
from prep.jobs import outdir, parquet_out
from prep.jobs.outdir import SHARD_FILE, shard_paths
from prep.jobs.owned import (
    MARKER,
    Claim,
    FolderClaim,
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
    """The staging folder of a run into ``loc``: one per destination on this machine, so a
    second run into it is refused. The same URI on another S3-compatible server (another
    AWS_ENDPOINT_URL) is another destination, with a folder of its own."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{loc.scheme}-{loc.bucket}-{loc.key}")[:80]
    at = storage.endpoint() if loc.scheme == "s3" else None
    where = loc.uri if at is None else f"{at} {loc.uri}"
    return staging_root() / f"{name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"


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


class BucketClaim(Claim):
    """The bucket backend: ``--out`` a prefix, staged in a local folder held by the
    layout's local claim (``staging``) and uploaded. A layout adds ``_check`` (what the
    prefix holds), ``publish`` and ``_abandon`` (what a run that did not publish uploaded)."""

    staging: type[FolderClaim]

    def __init__(self, out, **kw):
        self.loc = Remote.parse(str(out))
        super().__init__(self.loc.uri, **kw)
        self.local = self.staging(_local_for(self.loc), command=self.command,
                                  runner=self.runner, overwrite=True)
        self.upload: Remote | None = None  # this run's upload: removed unless published

    def acquire(self, guard: Guard) -> None:
        self.guard = guard
        self.local.acquire(guard)
        self.stage = self.local.stage
        files = storage.list_files(self.loc)
        if "" in files:
            raise InputError(f"{self.loc}: an object, not a prefix; --out names a prefix "
                             "(a folder) of the bucket")
        self._check(files)

    @abc.abstractmethod
    def _check(self, files: dict[str, int]) -> None:
        """Refuse what the prefix holds (``files``) that this layout may not replace."""

    @abc.abstractmethod
    def _abandon(self, upload: Remote) -> None:
        """Remove ``upload``: the run did not publish it, and the old output stays."""

    def release(self) -> None:
        self.guard.defer = True
        if self.upload is not None and not self.published:
            with contextlib.suppress(InputError):  # what stays, a later run removes
                self._abandon(self.upload)
        self.local.release()
        with contextlib.suppress(OSError):  # nothing is ever published there
            self.local.path.rmdir()

    def failure(self, e: BaseException) -> InputError | None:
        """As the local claim's, naming the prefix (and the local staging where it failed)."""
        err = self.local.failure(e) or e
        if not isinstance(err, InputError):
            return None
        text, local = str(err), str(self.local.path)
        if text.startswith(str(staging_root())) and any(w in text for w in FS_PROBLEMS):
            return InputError(f"{err} (the local staging of {self.loc}: set TMPDIR to a disk "
                              "with room for the output)")
        if text.startswith(local):  # e.g. another run on this machine writing loc
            return InputError(f"{self.loc} (staged in {local}){text[len(local):]}")
        return None if err is e else err

    def _upload(self, rels: list[str], into: Remote) -> None:
        """The staged files ``rels`` into the prefix ``into``, under one progress bar."""
        jobs = [(self.stage / rel, into.child(rel)) for rel in rels]
        storage.transfer(jobs, storage.upload, desc="upload", progress=self.progress,
                         total=sum(p.stat().st_size for p, _ in jobs))


class RemoteDataset(BucketClaim):
    """``--out`` of `prep shards`, a bucket prefix, held by this run; made by
    prep.jobs.claim.claim."""

    staging = outdir.OutDir

    def __init__(self, out, **kw):
        super().__init__(out, **kw)
        self.gen: str | None = None  # the name of this run's generation (its upload)
        self._in_bucket: Remote | None = None  # the generation, when workers stage there

    def _read_prefix(self) -> tuple[dict | None, set[str]]:
        """The prefix's manifest (or None) and the paths it lists."""
        data = storage.read_bytes(self.loc.child(MANIFEST_NAME))
        if data is None:
            return None, set()
        try:
            m = json.loads(data)
            listed = shard_paths(m)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InputError(f"{self.loc}/{MANIFEST_NAME}: unreadable; it is not a manifest "
                             "`prep shards` wrote: use another --out prefix") from None
        return m, {p for p in listed if isinstance(p, str)}

    def _check(self, files: dict[str, int]) -> None:
        loc = self.loc
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
        self.upload = self.loc.child(self.gen)
        storage.write_bytes(self.upload.child(MARKER), _marker("staging", self._token))
        return self.upload

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
        listed = shard_paths(manifest)
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
            self._upload(staged, self._new_generation())
        new = json.loads(json.dumps(manifest))
        for sp in new["splits"].values():
            for e in sp["shards"]:
                e["path"] = f"{self.gen}/{e['path']}"
        body = mf.write_manifest(self.stage, new).read_bytes()  # the bytes a local run writes
        self.guard.defer = True  # SIGINT/SIGTERM wait for the end of the switch
        old, listed = self._read_prefix()
        if old is not None and self.old is None and not self.overwrite:
            raise InputError(f"{self.loc}: another run published a dataset there meanwhile; "
                             "pass --overwrite to replace it, or use another --out")
        storage.write_bytes(self.loc.child(MANIFEST_NAME), body)
        self._published()
        # the replaced dataset: its generation marked old (any later run may remove it),
        # then removed; shards in train/, test/ (a local dataset copied up) removed too
        tops = sorted({p.split("/")[0] for p in listed if p.split("/")[0] != self.gen})
        for top in tops:
            if GEN.fullmatch(top):
                storage.write_bytes(self.loc.child(top).child(MARKER), _marker("old", self._token))
                _remove_tree(self.loc.child(top))
        for split in SPLITS:
            storage.delete_tree(self.loc.child(split))

    def _abandon(self, upload: Remote) -> None:
        _remove_tree(upload)


class RemoteParquet(BucketClaim):
    """``--out`` of `prep import-atlas`, a bucket prefix, held by this run; made by
    prep.jobs.claim.claim."""

    staging = parquet_out.ParquetOut

    def _check(self, files: dict[str, int]) -> None:
        loc, cmd = self.loc, self.command
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
        up = self.upload = self.loc.child(f".tmp-{self.runner}-{os.getpid()}-{self._token}")
        storage.write_bytes(up.child(MARKER), _marker("staging", self._token))
        self._upload(names, up)
        plan = parquet_out.publish_plan(self.old, names)
        self.guard.defer = True  # from here on, the next run finishes it
        storage.write_bytes(up.child(PUBLISH), json.dumps(plan).encode())
        self._finish(up)
        self._published()
        _remove_tree(up)

    def _abandon(self, upload: Remote) -> None:
        if PUBLISH not in storage.list_files(upload):  # else the next run finishes it
            _remove_tree(upload)
