"""Compiled loops (numba) for the kernels numpy cannot do in one pass over memory.

numpy spends one pass over memory per operation, and some kernels need many: a max pool is a
pass per window tap, a conv epilogue (bias, residual, activation) a pass per term, a depthwise
convolution a pass per tap. The loops here do such work in one pass, on float32/float64 arrays;
the numpy kernels keep every other dtype. Modules of this package are imported by the op
factories that use them, and a loop imports numba at its first compiled call, so numba loads only
for models that need it, and a session's first runs may be served from numpy while it loads in the
background (deferred.py).

Every loop is serial (numba's ``parallel`` stays off: its OpenMP pool fought numpy's spinning
OpenBLAS workers, slower than one thread; measured in afcca01). The kernels that split their work across cores
(the packed convolution of gemm.py, the packed products of matmul.py, attention.py's tiles, pooling,
batch normalization, depthwise convolution, few-row products) run one part per thread on the helper
threads of workers.py, as the job kinds of jobs.py.
Compiled code is cached on disk (numba's cache, stamped with every module of this package: cache_stamp.py),
so a process pays numba's compile time once per loop and dtype, not per session.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import numpy as np

from .deferred import Loop, ensure_numba

# The dtypes the compiled loops take; callers fall back to numpy for the rest. (Compared as dtype
# objects: reading ``dtype.name`` costs microseconds per call, which the per-run checks would pay.)
COMPILED_DTYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def takes(*arrays) -> bool:
    """Whether the compiled loops handle these arrays: float32/float64 (other dtypes stay on numpy)."""
    return all(a.dtype in COMPILED_DTYPES for a in arrays)


def compiler(**options):
    """numba's ``njit`` with the package's settings plus ``options`` (e.g. fastmath flags).

    nogil: sessions may run from several Python threads at once. error_model="numpy": a division by
    zero gives inf/nan as in numpy instead of raising. No fastmath unless a loop asks for one flag:
    results match numpy's. cache=True needs a writable place for the compiled code (next to this
    package, or numba's user cache / NUMBA_CACHE_DIR); where there is none, a loop compiles per
    process instead of failing.

    Returns a deferred.Loop, which imports numba and builds the dispatcher on its first compiled call (and
    may serve a session's first calls from numpy meanwhile: see deferred.py).
    """
    settings = dict(nogil=True, boundscheck=False, error_model="numpy", **options)

    def build(function):
        import numba

        from .cache_stamp import enable_caching

        dispatcher = numba.njit(**settings)(function)
        try:
            enable_caching(dispatcher, function)  # cache=True, stamped with the whole package's sources
        except RuntimeError as exc:  # "cannot cache function ...: no locator available"
            _warn_uncached(exc)
            return dispatcher
        _recover_damaged_entries(dispatcher, function.__qualname__)
        return dispatcher

    def decorate(function):
        return Loop(function, build)

    return decorate


def cached_cfunc(signature, function):
    """numba's ``cfunc(signature, cache=True, nopython=True)`` for ``function``, loading from the disk cache as
    the loops do (no context refresh, damaged entries recovered); compiled per process where nothing is
    writable."""
    ensure_numba()  # its code may call loops: numba must know their type before it compiles (a fresh cache)
    from numba.core import sigutils
    from numba.core.ccallback import CFunc

    callback = CFunc(function, sigutils.normalize_signature(signature), locals={}, options={"nopython": True})
    from .cache_stamp import enable_caching

    try:
        enable_caching(callback, function)
    except RuntimeError as exc:  # "cannot cache function ...: no locator available"
        _warn_uncached(exc)
    else:
        _recover_damaged_entries(callback, function.__qualname__)
    from .deferred import loading_only, must_not_compile

    # the background loader links from the cache and never compiles; nor does a run's thread in a Trial
    if loading_only() or must_not_compile():
        cres = callback._cache.load_overload(callback._sig, callback._targetdescr.target_context)  # noqa: SLF001
        if cres is None:
            from .deferred import CacheMiss, runner_missed

            raise CacheMiss(function.__qualname__) if loading_only() else runner_missed(function)
        callback._cache = _Loaded(cres)  # noqa: SLF001  (compile() below links it; loading twice would link twice)
    callback.compile()
    return callback


class _Loaded:
    """A cfunc's cache holding the one result the loader has read already."""

    def __init__(self, cres):
        self._cres = cres

    def load_overload(self, sig, target_context):
        return self._cres

    def save_overload(self, sig, cres):
        pass


_warned_uncached = False


def _warn_uncached(exc: Exception) -> None:
    global _warned_uncached
    if not _warned_uncached:
        _warned_uncached = True
        warnings.warn(f"the CPU provider's compiled loops have no writable cache location ({exc}), so every "
                      "process compiles them again on first use; set NUMBA_CACHE_DIR to a writable folder",
                      RuntimeWarning, stacklevel=3)


_linked_contexts: set[int] = set()


def _linkable(target_context, folder: str | None = None) -> None:
    """The symbols a cached loop's code may call, registered once per target context (see below); ``folder``:
    where the loop's cache entries are, beside which the runtime's compiled functions are kept (nrt_cache.py)."""
    if id(target_context) in _linked_contexts:
        return
    import numba.cpython.hashing  # noqa: F401  (registers the hash secret's symbols)

    from .nrt_cache import initialize_runtime

    initialize_runtime(target_context, folder)
    _linked_contexts.add(id(target_context))


def _recover_damaged_entries(dispatcher, qualname: str) -> None:
    """Loads a cached loop without refreshing numba's contexts, and recovers from a damaged entry.

    numba's ``Cache.load_overload`` first calls ``target_context.refresh()``, which imports and installs every
    typing and lowering registry numba has: most of a warm process's first run went there. Linking a cached
    library needs only the symbols its code calls: numba's C helpers and math functions (registered when the
    contexts are created), the reference-counting runtime (``rtsys.initialize``, which the refresh would run; its
    compiled functions read from beside the cache entries: nrt_cache.py) and the hash secret (registered when
    ``numba.cpython.hashing`` is imported). Those are set up here instead, and numba still refreshes the contexts
    itself before anything compiles (``CompilerBase``) or lowers (``get_function``). A cache entry that no longer
    unpickles (a truncated or overwritten file) is dropped with a warning and the loop compiled again, which
    rewrites the entry; left alone it would fail every later process.
    """
    cache = getattr(dispatcher, "_cache", None)
    index_path = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    load = getattr(cache, "_load_overload", None)
    guard = getattr(cache, "_guard_against_spurious_io_errors", None)
    if index_path is None or load is None or guard is None:
        return

    folder = getattr(cache, "_cache_path", None)

    def load_overload(sig, target_context):
        _linkable(target_context, folder)
        try:
            with guard():
                return load(sig, target_context)
            return None  # the guard swallowed a spurious I/O error: compile instead
        except Exception as exc:  # UnpicklingError, EOFError, ValueError, ...: whatever a damaged file raises
            warnings.warn(f"the compiled-loop cache entry {index_path} is damaged ({type(exc).__name__}: {exc}); "
                          f"it is dropped and {qualname} compiled again",
                          RuntimeWarning, stacklevel=2)
            with contextlib.suppress(OSError):
                os.remove(index_path)  # the next save writes a fresh index; old data files get overwritten
            return None

    cache.load_overload = load_overload


def __getattr__(name: str):
    # ``from . import jit`` in a loop module: the package's default settings.
    if name != "jit":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global jit
    jit = compiler()
    return jit
