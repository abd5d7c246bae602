"""Checkpoints with Orbax: the train state and the Grain iterator state, saved together.

    RUN_DIR/checkpoints/<step>/state/   params, optimizer state, step (Orbax, async)
    RUN_DIR/checkpoints/<step>/data/    the reader's iterator state (JSON, a few ints)

Both halves of a step are written under one Orbax step directory that only appears once
complete, so a checkpoint is never half state, half data. A restore gives the state with an
abstract template's shardings and the iterator state for ``DatasetIterator.set_state``.

Once a save is complete, the sha256 of every file of the step goes to
``<step>/sha256.json``; a restore checks them, so changed bytes that still decode (e.g. to
NaN optimizer moments) are damage like a truncated file. A step without digests (the newest
of a live run, sealed with the next save; or a run killed before them) restores with a note
that it was not verified.

A save that fails (a full, read-only or not writable disk, which Orbax reports from its
background thread at the next ``check``, ``save`` or ``wait``) is one InputError line naming
the step, what failed and the last good checkpoint; its partial folders are removed and
Orbax's pages of log and echoes of its other failed writes are dropped (train.fit.orbax_echoes).

A checkpoint of another model than the run's config.json (a run folder mixed from two runs)
is not damage: ``check_model`` compares its parameter names and shapes with the model's
before a restore, and says so in one line.

A damaged step folder fails to restore; ``restore_intact`` takes the newest step that
restores, naming each one it skipped and why, and ``set_aside`` moves the damaged ones out
of the way (so the run can write those steps again). A reader of a live run (`train eval`,
`train predict`) sees only complete steps (Orbax writes a step under a temporary name), and
one that the trainer's rotation removes while it is read is no damage: one line says so.
With several processes (train.fit.multihost) each saves and restores its own shards through
Orbax, in a folder they all see; process 0 alone writes the digests, cleans up and sets
damaged steps aside.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from prep.base.atomic import write_atomic
from prep.base.errors import DISK, DISK_WORDS, InputError, disk_errno, first_line
from train.fit import multihost, orbax_echoes


def step_dirs(directory: str | Path) -> list[int]:
    """Steps with a folder under ``directory`` (intact or not), without opening Orbax."""
    d = Path(directory)
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()) \
        if d.is_dir() else []


def saved_at(run_dir: str | Path) -> float:
    """When the run last saved a checkpoint (its newest step folder's mtime; 0.0 if none).
    What "the newest run" means: the run folder's own mtime moves when anything reads or
    refuses it (a lock file, an eval/ report), so it would name the run last looked at."""
    steps = step_dirs(Path(run_dir) / "checkpoints")
    return (Path(run_dir) / "checkpoints" / str(steps[-1])).stat().st_mtime if steps else 0.0


def newest_first(runs) -> list[Path]:
    """Run folders by saved_at, newest first (ties by name, for a stable order)."""
    return sorted(map(Path, runs), key=lambda p: (saved_at(p), p.name), reverse=True)


def _shapes(tree: dict, prefix: str = "") -> dict[str, tuple]:
    """{"layers/w_in": shape, …} of a parameter tree whose leaves are arrays, metadata (with
    a ``shape``) or shapes."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _shapes(v, f"{prefix}{k}/")
        else:
            out[prefix + k] = tuple(v if isinstance(v, tuple) else v.shape)
    return out


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def params_mismatch(saved: dict, want: dict) -> str | None:
    """How the parameters ``saved`` fail the model's ``want`` (trees, ``_shapes``'s leaves):
    the names it lacks or holds besides, and a shape that differs; None when every parameter
    the model reads is there in its shape (one it does not read is not in its way)."""
    have, need = _shapes(saved), _shapes(want)
    missing = sorted(need.keys() - have.keys())
    other = sorted(k for k in need.keys() & have.keys() if need[k] != have[k])
    if not missing and not other:
        return None
    extra = sorted(have.keys() - need.keys())
    return "; ".join(
        ([f"missing {_few(missing)}"] if missing else []) + ([f"extra {_few(extra)}"] if extra
                                                             else [])
        + [f"{k} {have[k]}, the model's {need[k]}" for k in other[:2]])


def _why(e: BaseException) -> str:
    """A restore's exception as a short reason (TensorStore's spec dump cut off)."""
    text = str(e).strip().strip("'\"")
    first = text.splitlines()[0].split(" See full TensorStore details")[0] if text else ""
    return f"{type(e).__name__}: {first[:120]}" if first else type(e).__name__


@contextlib.contextmanager
def _quiet_failed_reads():
    """A restore: when one of its concurrent reads fails, the others are collected here
    once their threads are done, their echoes dropped (train.fit.orbax_echoes), and the
    one failure that counts goes on to the caller."""
    orbax_echoes.drop_late_echoes()
    try:
        yield
    except BaseException:
        time.sleep(0.05)  # let the other reads' threads finish, then collect them here
        gc.collect()
        raise


DIGESTS = "sha256.json"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _digests(step_dir: Path) -> dict[str, str]:
    """{path relative to the step folder: sha256} of every file of a checkpoint."""
    return {p.relative_to(step_dir).as_posix(): _file_sha256(p)
            for p in sorted(step_dir.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name not in (DIGESTS, DIGESTS + ".tmp")}


# a save that failed for want of a writable disk: the fix, by the kind prep.base.errors.DISK
# gives it; TensorStore says RESOURCE_EXHAUSTED for a full disk
_DISK_FIX = {"space": "free some space", "read-only": "make it writable",
             "permission": "make it writable"}
_DISK_WORDS = {**DISK_WORDS, "RESOURCE_EXHAUSTED": errno.ENOSPC}


def _save_failure(e: BaseException) -> tuple[str, str]:
    """(what went wrong, the fix) of a failed save, from the first disk errno (or the words
    for one) in its chain of exceptions."""
    seen, x = 0, e
    while x is not None and seen < 20:
        code = disk_errno(x, _DISK_WORDS)
        if code is not None:
            what, kind = DISK[code]
            return what, _DISK_FIX[kind]
        x, seen = x.__cause__ or x.__context__, seen + 1
    return first_line(e), "see what stopped it"


class Checkpointer:
    def __init__(self, directory: str | Path, *, max_to_keep: int = 3):
        self.directory = Path(directory).absolute()
        # lightweight: the steps from their folders' names alone; Orbax would read each
        # one's metadata, and a live trainer's rotation (max_to_keep) removing a folder in
        # between made `train eval` of that run a FileNotFoundError traceback
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               lightweight_initialize=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data"))
        self.skipped: list[tuple[int, str]] = []  # (step, why) of restore_intact
        self.unverified: list[int] = []  # steps restored without digests to check
        self._cached = None  # (step, state, data) found by newest_intact_step
        self._unsealed: list[int] = []  # saved, digests not yet written
        self.failed = False  # a save failed (reported once, as an InputError)
        # a failed save echoes from its threads before check() knows of it
        orbax_echoes.drop_late_echoes()
        self._absl_errors = orbax_echoes.AbslErrors()
        logging.getLogger("absl").addFilter(self._absl_errors)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, data_state: dict) -> None:
        """Start writing (asynchronously; the arrays are copied first, so training can go
        on) once the previous save is complete and sealed with its digests."""
        if step in self.manager.all_steps():
            return
        self.wait()
        self._unsealed.append(step)
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
                force=True)
        except Exception as e:  # the part that runs here: folders, metadata
            raise self._fail(e) from None

    def check(self) -> None:
        """InputError (one line) if a save under way has failed already."""
        if self._unsealed and not self.failed:
            try:
                self.manager.check_for_errors()
            except Exception as e:
                raise self._fail(e) from None

    def wait(self) -> None:
        """Wait for the saves under way, then write their digests (``sha256.json``);
        InputError (one line) if one failed (its partial folders are removed)."""
        if self.failed:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._fail(e) from None
        for step in self._unsealed if multihost.is_primary() else ():
            d = self.directory / str(step)
            if d.is_dir():  # not already dropped by max_to_keep
                try:
                    write_atomic(d / DIGESTS, json.dumps(_digests(d), indent=1, sort_keys=True)
                                 + "\n")
                except OSError as e:  # the checkpoint is whole: kept, without digests
                    raise self._fail(e, drop=False) from None
        self._unsealed = []

    def _fail(self, e: BaseException, drop: bool = True) -> InputError:
        """A failed save: remove what it left (``<step>.orbax-checkpoint-tmp*``, a
        ``<step>`` folder it did not finish), stop saving, and say so in one line."""
        steps, self._unsealed, self.failed = self._unsealed, [], True
        orbax_echoes.drop_late_echoes()  # its other writes fail too, some after the loop closed
        for step in steps if multihost.is_primary() else ():
            for d in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(d, ignore_errors=True)
            if drop:
                shutil.rmtree(self.directory / str(step), ignore_errors=True)
        with contextlib.suppress(Exception):
            self.manager.reload()
        what, fix = _save_failure(e)
        good = step_dirs(self.directory)
        keep = (f"the last good checkpoint is step {good[-1]}: {fix}, then resume it with "
                f"`train --run-dir {self.directory.parent} --resume`" if good else
                f"no checkpoint was saved: {fix}, then start again")
        step = steps[-1] if steps else "?"
        saved = "not saved" if drop else "saved without its digests"
        return InputError(f"{self.directory}: checkpoint {step} {saved}: {what}; training "
                          f"stopped; {keep}")

    def verify(self, step: int) -> str | None:
        """Why step ``step``'s files are not the ones saved (a digest differs, a file is
        missing), or None; a step without digests counts as intact and goes to
        ``self.unverified``."""
        d = self.directory / str(step)
        try:
            saved = json.loads((d / DIGESTS).read_text())
        except FileNotFoundError:
            self.unverified.append(step)
            return None
        except (OSError, ValueError, RecursionError) as e:
            return f"{DIGESTS} unreadable ({type(e).__name__})"
        if not isinstance(saved, dict):
            return f"{DIGESTS} is not a list of digests"
        for rel, digest in sorted(saved.items()):
            f = d / rel
            if not f.is_file():
                return f"{rel} missing"
            if _file_sha256(f) != digest:
                return f"sha256 of {rel} differs from the one saved with it (its bytes changed)"
        return None

    def _restore(self, step: int, template: dict | None) -> tuple[dict, dict]:
        if template is None:  # as saved, on this process's first device (a run saved from
            # several devices or hosts restores on one: Orbax would refuse its topology)
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
            abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                                    saved)
        else:
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        if not isinstance(out["data"], dict):
            raise ValueError(f"data/ holds {type(out['data']).__name__}, not an iterator state")
        return out["state"], out["data"]

    def check_model(self, step: int, params: dict) -> None:
        """InputError (one line) when step ``step`` holds the parameters of another model than
        ``params`` (the tree of the model config.json names: arrays or shapes). A step whose
        metadata does not read is left to the restore, which names the damage."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(
                self.directory / str(step) / "state")["params"]
            why = params_mismatch(saved, params)
        except Exception:
            return
        if why:
            raise InputError(f"{self.directory / str(step)}: the checkpoint at step {step} holds "
                             f"the parameters of another model than the run's config.json says "
                             f"({why}); do not mix run folders: keep each run's config.json "
                             "with the checkpoints it saved")

    def problem(self, step: int) -> str | None:
        """Why step ``step``'s folder cannot be a checkpoint, from a look at it (None if
        nothing shows; a restore may still fail)."""
        d = self.directory / str(step)
        if not d.is_dir():
            return "no such folder"
        if not any(d.iterdir()):
            return "an empty folder"
        for half in ("state", "data"):
            if not (d / half).is_dir():
                return f"no {half}/"
        return None

    def restore(self, step: int, template: dict | None = None) -> tuple[dict, dict]:
        """(state shaped and sharded like ``template`` (or as saved, on one device),
        iterator state) of ``step``; InputError (one line) if that checkpoint is damaged."""
        if self._cached is not None and self._cached[0] == step and template is None:
            _, state, data = self._cached
            self._cached = None
            return state, data
        state, data, why = self._restore_checked(step, template)
        if why is None:
            return state, data
        raise InputError(f"{self.directory / str(step)}: damaged checkpoint ({why}); pick "
                         f"another --step, or resume the run to fall back to an intact one")

    def _restore_checked(self, step: int, template: dict | None):
        """(state, iterator state, None) of ``step``, restored and checked against its
        digests, or (None, None, why it is damaged)."""
        why = self.problem(step)
        if why is None:
            try:
                with _quiet_failed_reads():
                    state, data = self._restore(step, template)
                why = self.verify(step)
                if why is None:
                    return state, data, None
            except Exception as e:  # orbax/tensorstore/json: KeyError, ValueError, …
                why = _why(e)
        return None, None, why

    def restore_intact(self, template: dict | None = None, *, log=None) -> tuple[int, dict, dict]:
        """(step, state, iterator state) of the newest checkpoint that restores. Each newer
        one skipped goes to ``self.skipped`` and is named on stderr (or to ``log``) with the
        reason; InputError (one line) if there is none or none is intact."""
        if log is None:  # process 0 speaks for all (they all see the same folder)
            log = (lambda msg: print(msg, file=sys.stderr, flush=True)) \
                if multihost.is_primary() else (lambda msg: None)
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise InputError(f"{self.directory}: no checkpoint; train (longer) first")
        self.skipped, gone = [], []
        for step in steps:
            state, data, why = self._restore_checked(step, template)
            if why is None:
                if self.unverified and self.unverified[-1] == step:
                    log(f"note: checkpoint {step} in {self.directory} has no {DIGESTS} (a "
                        "live `train` writes it with its next checkpoint or at its end; a "
                        "run killed before that, or an older version, wrote none): restored "
                        "without checking it")
                return step, state, data
            if not (self.directory / str(step)).exists():  # not damage: removed as it was read
                gone.append(step)
                continue
            self.skipped.append((step, why))
            log(f"skipping checkpoint {step} in {self.directory}: {why}")
        if gone:
            were = f"s {_few(list(map(str, gone)))} were" if len(gone) > 1 else f" {gone[0]} was"
            raise InputError(f"{self.directory}: checkpoint{were} removed as read: a live "
                             "`train` is saving this run and keeps only its newest checkpoints; "
                             "try again")
        raise InputError(f"{self.directory}: no intact checkpoint ("
                         + "; ".join(f"{s}: {w}" for s, w in self.skipped)
                         + "); start a new --run-dir")

    def newest_intact_step(self) -> int:
        """The step of ``restore_intact()``; its restored state is kept for ``restore(step)``."""
        step, state, data = self.restore_intact()
        self._cached = (step, state, data)
        return step

    def set_aside(self, steps, dest: str | Path) -> list[Path]:
        """Move these steps' folders to ``dest/<step>`` (out of Orbax's sight, so the run
        can save those steps again); where they went."""
        dest, moved = Path(dest), []
        multihost.sync("set-aside")  # no process still reading them
        for step in steps if multihost.is_primary() else ():
            src = self.directory / str(step)
            if not src.exists():
                continue
            dest.mkdir(parents=True, exist_ok=True)
            target, k = dest / str(step), 1
            while target.exists():
                target, k = dest / f"{step}.{k}", k + 1
            shutil.move(str(src), str(target))
            moved.append(target)
        multihost.sync("set-aside-done")
        self.manager.reload()
        return moved

    def close(self) -> None:
        try:
            self.wait()
        finally:
            logging.getLogger("absl").removeFilter(self._absl_errors)
            with contextlib.suppress(Exception) if self.failed else contextlib.nullcontext():
                self.manager.close()
