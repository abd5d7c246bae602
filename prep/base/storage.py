"""Object storage: ``s3://bucket/key`` (and ``gs://``) paths for the commands' inputs and outputs.

Everything that touches a bucket goes through this module, on pyarrow's filesystems
(``pyarrow.fs.S3FileSystem``; ``gs://`` through ``pyarrow.fs.FileSystem.from_uri``, same
code, not tested here). The local runner's commands never read a bucket in place: inputs
are downloaded into the run's staging folder (``download_inputs``), outputs uploaded
(prep.jobs.remote_out), datasets read from a cache checked by sha256 (prep.schema.cache),
so the pool's workers, ArrayRecord and Grain see local files only.

Where the bucket is and who may read it, from the standard AWS settings (as the AWS CLI):

    AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL   an S3-compatible server (MinIO, Ceph, moto):
                                            http(s)://host:port, path-style addressing
    AWS_REGION, AWS_DEFAULT_REGION          the region (else the bucket's own is looked up)
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE,
    ~/.aws/credentials, ~/.aws/config, instance roles    the credentials (the SDK's chain)

A storage failure is one line (InputError, exit 2) naming the URI and the fix: wrong
credentials, an endpoint that cannot be reached, no such bucket (``failure``).

The Beam runner is the exception, its workers sharing no disk with the driver: they read
row groups in place (``open_input_file``, ranged GETs) and ``upload`` shards and JSON results
(prep.shards.beam_worker.BucketStage); the driver hashes inputs it never downloads
(``digest``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from prep.base import sniff
from prep.base.atomic import replacing
from prep.base.errors import InputError, first_line

SCHEMES = ("s3", "gs")
CHUNK = 8 << 20  # bytes per read/write of a transfer
THREADS = 8  # transfers at once
CONNECT_TIMEOUT_S = 10.0


def is_remote(path) -> bool:
    """Whether ``path`` names object storage (``s3://``, ``gs://``) rather than a local path."""
    return isinstance(path, str) and path.split("://", 1)[0] in SCHEMES and "://" in path


# The commands that take bucket paths (README: Object storage); the others' refusal names them
_TAKE_BUCKETS = "prep shards, import-atlas, verify, inspect and train take bucket paths"
_COPY = {"s3": "aws s3 cp --recursive", "gs": "gcloud storage cp --recursive"}


def local_only(path: str, *, output: bool = False) -> str | None:
    """Why a command of local paths only cannot take ``path`` (None when it is local): a
    bucket path would be "does not exist", or folded by pathlib into ``s3:/bucket``."""
    if not is_remote(path):
        return None
    copy = _COPY[path.split("://", 1)[0]]
    if output:
        return (f"{path}: this command writes a local folder only, not a bucket; write one, "
                f"then upload it (`{copy} DIR {path}`); {_TAKE_BUCKETS}")
    return (f"{path}: this command reads local files only, not a bucket; copy them here first "
            f"(`{copy} {path} DIR`) and give DIR; {_TAKE_BUCKETS}")


@dataclass(frozen=True)
class Remote:
    """A location in a bucket: ``s3://bucket/key`` (``key`` may be "", the bucket's root)."""

    scheme: str
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str) -> Remote:
        scheme, _, rest = uri.partition("://")
        bucket, _, key = rest.partition("/")
        key = key.strip("/")
        if scheme not in SCHEMES or not bucket or ".." in PurePosixPath(key).parts:
            raise InputError(f"{uri}: not a bucket path; write s3://BUCKET/PREFIX "
                             "(or gs://BUCKET/PREFIX)")
        return cls(scheme, bucket, key)

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.bucket}" + (f"/{self.key}" if self.key else "")

    @property
    def path(self) -> str:
        """The path pyarrow's filesystem takes: ``bucket/key``."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket

    def child(self, rel: str) -> Remote:
        return Remote(self.scheme, self.bucket, f"{self.key}/{rel}".strip("/"))

    def __str__(self) -> str:
        return self.uri


def endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


_FS: dict = {}


def filesystem(scheme: str):
    """pyarrow's filesystem for ``scheme``, made from the environment (one per setting)."""
    import pyarrow.fs as pafs

    if scheme == "gs":
        key = ("gs",)
        if key not in _FS:
            _FS[key] = pafs.GcsFileSystem()
        return _FS[key]
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    key = ("s3", endpoint(), region, os.environ.get("AWS_ACCESS_KEY_ID"),
           os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN"),
           os.environ.get("AWS_PROFILE"))
    if key not in _FS:
        kw = {"connect_timeout": CONNECT_TIMEOUT_S,
              "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
        if endpoint():
            kw["endpoint_override"] = endpoint()
        if region:
            kw["region"] = region
        _FS[key] = pafs.S3FileSystem(**kw)
    return _FS[key]


def failure(e: BaseException, where, doing: str) -> InputError:
    """A storage error as one line: what went wrong with ``where`` and what to do."""
    return known_failure(e, where, doing) or InputError(
        f"{where}: storage error while {doing} ({first_line(e)[:200]})")


def known_failure(e: BaseException, where, doing: str) -> InputError | None:
    """``failure``'s line when ``e`` is a storage failure it knows (access, network, no
    such bucket), else None: an error reading a bucket's object may also be the object's
    own damage, which the caller names."""
    text = str(e)
    if any(w in text for w in ("ACCESS_DENIED", "INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH",
                               "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                               "EXPIRED_TOKEN", "ExpiredToken", "InvalidToken", "Forbidden")):
        code = next((w for w in ("INVALID_ACCESS_KEY_ID", "SIGNATURE_DOES_NOT_MATCH", "EXPIRED_TOKEN",
                                 "ACCESS_DENIED") if w in text), "access denied")
        return InputError(f"{where}: access denied while {doing} ({code.lower().replace('_', ' ')}); "
                          "check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                          "AWS_PROFILE or ~/.aws/credentials), that they may do this, and that "
                          "the bucket exists")
    if any(w in text for w in ("NETWORK_CONNECTION", "curlCode", "Could not connect",
                               "Could not resolve", "Connection refused", "timed out")):
        detail = text.split("Details:", 1)[-1].strip() if "Details:" in text else first_line(e)
        if endpoint():
            return InputError(f"{where}: cannot reach the storage endpoint {endpoint()} while "
                              f"{doing} ({detail[:160]}); check AWS_ENDPOINT_URL, the network "
                              "and that the server runs")
        if str(where).startswith("gs://"):
            return InputError(f"{where}: cannot reach Google Cloud Storage while {doing} "
                              f"({detail[:160]}); check the network connection")
        return InputError(f"{where}: cannot reach AWS S3 while {doing} ({detail[:160]}); "
                          "check the network connection, or, for an S3-compatible server "
                          "(MinIO, Ceph), set AWS_ENDPOINT_URL to its URL (none is set)")
    if any(w in text for w in ("NO_SUCH_BUCKET", "NoSuchBucket")) or (
            "Bucket" in text and "not found" in text):
        return _no_bucket(where)
    return None


def _no_bucket(where) -> InputError:
    return InputError(f"{where}: no such bucket; create it, or check the name")


def _check_bucket(loc: Remote) -> None:
    """InputError when ``loc``'s bucket does not exist: asked where nothing was found, so
    that a missing bucket is said as such (not "no manifest.json"), and before a run into
    it builds anything."""
    import pyarrow.fs as pafs

    with errors(loc, "looking for its bucket"):
        if filesystem(loc.scheme).get_file_info(loc.bucket).type == pafs.FileType.NotFound:
            raise _no_bucket(Remote(loc.scheme, loc.bucket, ""))


@contextlib.contextmanager
def errors(where, doing: str):
    """Within the block a storage OSError becomes ``failure``'s one line."""
    try:
        yield
    except OSError as e:
        raise failure(e, where, doing) from None


def list_files(loc: Remote) -> dict[str, int]:
    """Every object under ``loc`` (a prefix), by its path relative to it, with its size;
    ``{"": size}`` when ``loc`` is itself an object; empty when nothing is there."""
    import pyarrow.fs as pafs

    fs = filesystem(loc.scheme)
    with errors(loc, "listing it"):
        info = fs.get_file_info(loc.path) if loc.key else None
        if info is not None and info.type == pafs.FileType.File:
            return {"": info.size}
        if info is not None and info.type == pafs.FileType.NotFound:
            _check_bucket(loc)
            return {}
        sel = pafs.FileSelector(loc.path, recursive=True, allow_not_found=True)
        n = len(loc.path) + 1
        found = {i.path[n:]: i.size for i in fs.get_file_info(sel)
                 if i.type == pafs.FileType.File}
    if not found:
        _check_bucket(loc)
    return found


def etag(loc: Remote) -> str | None:
    """The object's ETag (one HEAD request), or None when there is no such object."""
    fs = filesystem(loc.scheme)
    try:
        with fs.open_input_file(loc.path) as f:
            return _etag_of(f)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise failure(e, loc, "reading it") from None


def _etag_of(f) -> str | None:
    """The ETag in an opened object's metadata (pyarrow's S3 streams carry it)."""
    tag = f.metadata().get("ETag")
    return tag.decode() if isinstance(tag, bytes) else tag


def read_bytes(loc: Remote) -> bytes | None:
    """The object's bytes, or None when there is none."""
    import pyarrow.fs as pafs

    fs = filesystem(loc.scheme)
    with errors(loc, "reading it"):
        if fs.get_file_info(loc.path).type != pafs.FileType.File:
            _check_bucket(loc)
            return None
        with fs.open_input_stream(loc.path) as f:
            return f.read()


def open_input_file(loc: Remote):
    """The object as a seekable pyarrow file: a parquet reader fetches its footer and the
    row groups it reads by ranged GETs, never the whole object."""
    fs = filesystem(loc.scheme)
    with errors(loc, "opening it"):
        return fs.open_input_file(loc.path)


def digest(loc: Remote, stop: threading.Event | None = None) -> tuple[int, str]:
    """The object's size and sha256, streamed (nothing is kept); on ``stop``, what was read
    so far (the caller no longer waits for it)."""
    fs = filesystem(loc.scheme)
    h, n = hashlib.sha256(), 0
    with errors(loc, "reading it"), fs.open_input_stream(loc.path) as src:
        while chunk := src.read(CHUNK):
            if stop is not None and stop.is_set():
                break
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def write_bytes(loc: Remote, data: bytes) -> None:
    """One object, whole: S3 makes it visible only once it is complete."""
    fs = filesystem(loc.scheme)
    with errors(loc, "writing it"):
        with fs.open_output_stream(loc.path) as f:
            f.write(data)


def delete(locs: list[Remote]) -> None:
    """Remove these objects (missing ones are fine), several at once."""
    if not locs:
        return
    fs = filesystem(locs[0].scheme)

    def one(loc):
        with errors(loc, "removing it"):
            with contextlib.suppress(FileNotFoundError):
                fs.delete_file(loc.path)

    with concurrent.futures.ThreadPoolExecutor(min(THREADS, len(locs))) as pool:
        list(pool.map(one, locs))


def delete_tree(loc: Remote, last: str | None = None) -> None:
    """Remove everything under the prefix ``loc``: the object ``last`` (a marker) after all
    the others, then the empty "directory" objects pyarrow leaves behind."""
    import pyarrow.fs as pafs

    files = list_files(loc)
    delete([loc.child(r) for r in files if r != last])
    fs = filesystem(loc.scheme)
    with errors(loc, "removing it"), contextlib.suppress(FileNotFoundError):
        if fs.get_file_info(loc.path).type == pafs.FileType.Directory:
            fs.delete_dir(loc.path)


def copy(src: Remote, dst: Remote) -> None:
    """Copy an object within the storage (no bytes pass through here)."""
    fs = filesystem(src.scheme)
    with errors(src, f"copying it to {dst}"):
        fs.copy_file(src.path, dst.path)


class _Stopped(Exception):
    """A transfer gave up because another one failed or the run was interrupted."""


def _pump(read, write, bar, stop: threading.Event, hasher=None) -> None:
    while chunk := read(CHUNK):
        if stop.is_set():
            raise _Stopped
        write(chunk)
        if hasher is not None:
            hasher.update(chunk)
        if bar is not None:
            bar.update(len(chunk))


def upload(local: Path, loc: Remote, bar=None, stop: threading.Event | None = None) -> None:
    """Copy a local file to the object ``loc``."""
    fs = filesystem(loc.scheme)
    with errors(loc, "uploading to it"), open(local, "rb") as src:
        with fs.open_output_stream(loc.path) as dst:
            _pump(src.read, dst.write, bar, stop or threading.Event())


def download(loc: Remote, local: Path, bar=None,
             stop: threading.Event | None = None) -> tuple[str, str | None]:
    """Copy the object ``loc`` to the local file ``local`` (written as ``local.part`` and
    renamed when whole); its sha256, and the ETag of the object version it read."""
    fs = filesystem(loc.scheme)
    local.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with replacing(local, ".part") as part:
        with errors(loc, "downloading it"), fs.open_input_stream(loc.path) as src:
            tag = _etag_of(src)
            with open(part, "wb") as dst:
                _pump(src.read, dst.write, bar, stop or threading.Event(), h)
    return h.hexdigest(), tag


def transfer(jobs: list[tuple], fn, *, total: int, desc: str, progress: bool) -> list:
    """``fn(*job, bar, stop)`` for every job, THREADS at once, under one progress bar of
    ``total`` bytes; the results in job order. On a failure or an interrupt the others stop
    at their next chunk, and the first error is raised once all have stopped."""
    from tqdm import tqdm

    stop = threading.Event()
    # no bar at all without progress: tqdm starts a monitor thread even when disabled, and
    # prep.jobs.pool forks its workers only while this process has no other thread
    bar_cm = (tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
              if progress else contextlib.nullcontext())
    with bar_cm as bar, concurrent.futures.ThreadPoolExecutor(max(1, min(THREADS, len(jobs)))) as pool:
        futures = [pool.submit(fn, *job, bar, stop) for job in jobs]
        try:
            for f in concurrent.futures.as_completed(futures):
                f.result()  # the first to fail, before any other was told to stop
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
            raise
        return [f.result() for f in futures]


def remote_inputs(paths, suffixes: tuple[str, ...], command: str) -> list[tuple[Remote, int]]:
    """The objects the bucket paths among ``paths`` stand for, as local paths stand for
    files: an object named directly, or every object under a prefix ending in ``suffixes``
    (hidden path parts skipped: staging areas of unfinished runs), with their sizes.
    InputError for a path with nothing there or a dataset given as input."""
    found: dict[Remote, int] = {}
    for uri in (p for p in paths if is_remote(p)):
        loc = Remote.parse(uri)
        files = list_files(loc)
        if "" in files:
            found[loc] = files[""]
            continue
        if "manifest.json" in files:
            raise InputError(f"{loc}: a shards dataset (the output of `prep shards`); "
                             f"`{command}` reads measurements: give it the input files, or "
                             f"use `train --data {loc}`")
        refusal = sniff.unfinished_publish(loc, files)
        if refusal:
            raise InputError(refusal)
        picked = {rel: n for rel, n in files.items() if rel.endswith(suffixes)
                  and not any(part.startswith(".") for part in rel.split("/"))}
        if not files:
            raise InputError(f"{loc}: no such object or prefix; check the path")
        if not picked:
            raise InputError(f"{loc}: no {', '.join(suffixes)} objects under it; point at "
                             f"the input files or the prefix that holds them")
        found.update({loc.child(rel): n for rel, n in picked.items()})
    return sorted(found.items(), key=lambda kv: kv[0].uri)


def download_inputs(objects: list[tuple[Remote, int]], into: Path, *,
                    progress: bool = True) -> dict[Path, str]:
    """Download ``objects`` (from ``remote_inputs``) into ``into/<bucket>/<key>``; the
    local path of each, mapped to its URI."""
    jobs = [(loc, into / loc.scheme / loc.bucket / loc.key) for loc, _ in objects]
    transfer(jobs, download, total=sum(n for _, n in objects), desc="download inputs",
             progress=progress)
    return {local: loc.uri for loc, local in jobs}
