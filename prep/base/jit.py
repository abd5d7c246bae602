"""How prep's Numba code is compiled: ``kernel`` for what Python calls, ``helper`` for what
only kernels call. A first run (a fresh clone, an edit of prep/) compiles every kernel
that `prep shards` runs, so what a compile costs is chosen here, once.

- ``kernel``: ``njit(cache=True, no_cfunc_wrapper=True)``, options as njit's. Its machine
  code is cached (prep/__init__.py names the folder); no cfunc wrapper, which only a
  function passed as a first-class value would need.
- ``helper``: a function that only kernels call, compiled once per argument types (plain
  types: a literal 0 or True at a call makes no version of its own) and cached, without
  the CPython wrapper every njit function gets: for a function of the packer's tuples of
  arrays, that wrapper took longer to compile than the function. Not ``inline="always"``
  either, which types the body again at every call site; LLVM inlines small helpers
  after linking all the same. Called from Python, a helper runs as plain Python.

Inside kernels, a few numpy conveniences compile large error paths of Numba's own (a
slice assigned from an array: its shape-mismatch message; ``a.min()``): the planner's
sort writes those as loops. `make bench` reports the cold compile (compile.cold_s).
``cache_use`` counts, per kernel and helper made here, the versions this process loaded
from Numba's cache and those it compiled (Numba's own counters): what `prep kernels` and
`prep shards` report.
"""

import multiprocessing
import sys

from numba import njit, types
from numba.core.registry import CPUDispatcher


def kernel(fn=None, **options):
    """Decorator, ``@kernel`` or ``@kernel(nogil=True)``: a Numba kernel that Python calls,
    cached, ``options`` as njit's."""
    jit = njit(cache=True, no_cfunc_wrapper=True, **options)

    def make(fn):
        d = jit(fn)
        _MADE.append(d)
        return d
    return make if fn is None else make(fn)


_MADE: list = []  # every kernel and helper made here, for cache_use


def cache_use() -> dict[str, tuple[int, int]]:
    """``{"prep.pack.fill._fill_rows": (loaded, compiled), ...}``: the versions of each kernel
    and helper this process has so far loaded from Numba's cache and compiled (a cache
    miss: none there, or one Numba found stale, of another Numba or for another CPU)."""
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}":
            (sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()))
            for d in _MADE}


class _Helper(CPUDispatcher):
    """njit's dispatcher less the wrappers, typed on its arguments' plain types."""

    def get_call_template(self, args, kws):
        # a literal argument (0, True) would compile a version of its own, seconds each
        return super().get_call_template([types.unliteral(a) for a in args],
                                         {k: types.unliteral(v) for k, v in kws.items()})

    def __call__(self, *args, **kwargs):
        # it has no CPython wrapper (its machine code would be called blind): run as Python,
        # as the kernels' plain-Python twins in the tests do
        return self.py_func(*args, **kwargs)


def helper(fn=None, *, inline=False):
    """Decorator, ``@helper`` or ``@helper(inline=True)``: a Numba function that only
    kernels call (see the module docstring)."""
    def make(fn):
        d = _Helper(py_func=fn, locals={}, targetoptions={
            "nopython": True, "no_cpython_wrapper": True, "no_cfunc_wrapper": True,
            "inline": "always" if inline else "never"})
        d.enable_caching()
        _MADE.append(d)
        return d
    return make if fn is None else make(fn)


def no_blas_in_worker(worker: bool | None = None) -> None:
    """In a worker process whose kernels are all prep's, before its first kernel: Numba's
    first kernel in a process (compiled or loaded) asks whether a BLAS is there
    (numba.np.arraymath's ``_check_blas``), which imports scipy.linalg: ~0.12 s of CPU in
    every `prep shards` worker. prep's kernels call no BLAS, so the worker answers no
    without the import. Not in the main process, where other code (a test, train's
    kernels) may compile a kernel that does; nor once Numba has asked. ``worker``: whether
    this process is such a worker (default: a multiprocessing child; a Beam SDK worker
    process, started on its own, says so itself)."""
    if worker is None:
        worker = multiprocessing.parent_process() is not None
    if not worker or "numba.np.arraymath" in sys.modules:
        return
    import numba.np.linalg

    def no_blas():
        raise ImportError("prep's kernels call no BLAS (prep.base.jit.no_blas_in_worker)")
    numba.np.linalg.ensure_blas = no_blas
