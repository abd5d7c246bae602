"""ping-pack ETL: measurements -> validated columns -> contexts -> tokens -> packed rows -> shards.

Numba caches each kernel's machine code but checks only the file that defines it, while
ours inline code and constants from other modules (prep.tokens.costs, prep.tokens.draws,
prep.pack.fill, ...): an edit there would leave stale machine code in use. So the
cache folder is named after a hash of every module of prep/ and its subpackages, and of
train/ (whose kernels share the folder): ``prep/__pycache__/numba-<hash>``. Any edit there
compiles the kernels afresh (once; `make bench`'s compile.cold_s). Folders of other
versions are removed a day after they were last written. A NUMBA_CACHE_DIR set by the
user wins.
"""

import contextlib as _contextlib
import hashlib as _hashlib
import os as _os
import shutil as _shutil
import sys as _sys
import time as _time
from pathlib import Path as _Path


def _numba_cache_dir(here: _Path | None = None) -> str:
    here = here or _Path(__file__).resolve().parent
    h = _hashlib.sha256()
    # every subpackage (the kernels import across them), and train/'s kernels, which share
    # this folder
    roots = [here] + [r for r in [here.parent / "train"] if (r / "__init__.py").is_file()]
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{p.relative_to(root).as_posix()}".encode() + b"\0"
                     + p.read_bytes())
    current = here / "__pycache__" / f"numba-{h.hexdigest()[:16]}"
    for old in (here / "__pycache__").glob("numba-*"):
        with _contextlib.suppress(OSError):  # gone already: another process pruned it
            if old != current and _time.time() - old.stat().st_mtime > 86_400:
                _shutil.rmtree(old, ignore_errors=True)
    return str(current)


if "NUMBA_CACHE_DIR" not in _os.environ:
    if "numba" in _sys.modules:  # imported before us: its config is read, set it there
        _sys.modules["numba"].config.CACHE_DIR = _numba_cache_dir()
    else:
        _os.environ["NUMBA_CACHE_DIR"] = _numba_cache_dir()
