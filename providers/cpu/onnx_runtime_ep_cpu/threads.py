"""Threads: how many the CPU provider's split kernels use, and numpy's BLAS pool.

The default is one thread per CPU this process may use: its affinity set, capped by a cgroup CPU quota
(a container's ``--cpus``), not the machine's core count. ``intra_op_num_threads`` (0 = that default)
belongs to its session, as in onnxruntime: the provider resolves it at ``initialize`` and each run of that
session makes it the count of the running thread (a context variable, entered through the core's run scope:
onnx_runtime/run_scope.py), so kernels shared by every session, and the plans they keep per thread count,
read the count of the run that calls them. Outside any run (constant folding at creation, a kernel called
directly) the default applies. numpy's BLAS runs on one thread by default (the ``blas_threads`` knob of
tuning.py, capped by the session's count): OpenBLAS's own pool spins on cores another process may hold and
waits for threads the OS descheduled, where the split kernels hand out their parts as tasks claimed one at a
time. That pool is process-wide: a run sets it at entry when it differs, so runs of sessions that want
different BLAS counts at the same time (only with the knob above one) share the last one set.
``use_deterministic_compute`` runs that session on one thread: threaded GEMV/GEMM partition the output, and
different partitions can round identical columns differently, which a model with huge activations turns into
visibly different softmax outputs across machines. (The packed convolution's results do not depend on its
partition.)
"""

from __future__ import annotations

import contextvars
import ctypes

from onnx_runtime.cpus import usable_cpus
from onnx_runtime.errors import InvalidArgumentError

from .blas import bundled_openblas
from .tuning import KNOBS, when_changed

_default: list[int] = []  # [one thread per usable CPU], read at the first need (see default_threads)
# The calling run's session's count (0: not in a run, the default applies; -1: one_thread, whatever the knob says)
_run_threads: contextvars.ContextVar[int] = contextvars.ContextVar("onnx_runtime_cpu_threads", default=0)
_blas_applied: int | None = None  # the BLAS pool size set (None: not yet)


def default_threads() -> int:
    """One thread per usable CPU (onnx_runtime/cpus.py: the affinity set, capped by a cgroup quota), read once at
    the first need: its files cost a new process's first session a little, and a session of one thread, whose runs
    set their own count, never needs it."""
    if not _default:
        _default.append(usable_cpus())
    return _default[0]


def kernel_threads() -> int:
    """How many threads a kernel that splits its work uses, the calling one included: the ``threads`` knob of
    tuning.py, else the running session's setting, else one per usable CPU."""
    threads = _run_threads.get()
    if threads < 0:  # (one_thread)
        return 1
    return KNOBS.threads or threads or default_threads()


class one_thread:  # noqa: N801  (a context manager, named for what it does)
    """``with one_thread():`` kernel_threads() is 1 on this thread, whatever the ``threads`` knob says: what is made
    meanwhile is made as a one-thread run makes it (segment_split.py's plans of a batch's ranges, each run on one
    thread)."""

    def __enter__(self) -> None:
        self._token = _run_threads.set(-1)

    def __exit__(self, *exc) -> None:
        _run_threads.reset(self._token)


def helper_count() -> int:
    """How many helper threads the split kernels start (once per process): one per other core (or the
    ``helpers`` knob of tuning.py)."""
    return KNOBS.helpers or max(1, default_threads() - 1)


# numpy's bundled OpenBLAS's thread-count setter, by symbol name
_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads64_",
            "openblas_set_num_threads")


def _numpy_openblas_setter():
    """The ``set_num_threads`` of the OpenBLAS numpy bundles and loaded (blas.bundled_openblas), else None."""
    for _, library in bundled_openblas():
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter.argtypes, setter.restype = [ctypes.c_int], None
                return setter
    return None


_setter: list = []  # [numpy's OpenBLAS setter or None], looked up at the first limit


def limit_blas_threads(size: int | None = None) -> None:
    """Set numpy's BLAS pool to ``size`` threads (default: the ``blas_threads`` knob's), when it is not that
    size already."""
    global _blas_applied
    size = KNOBS.blas_threads if size is None else size
    if _blas_applied != size:
        if not _setter:
            _setter.append(_numpy_openblas_setter())
        if _setter[0] is not None:
            _setter[0](size)
        else:  # another BLAS (a numpy built against MKL, a system OpenBLAS): threadpoolctl knows them all
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=size, user_api="blas")
        _blas_applied = size


def _follow_the_knob() -> None:
    if _blas_applied is not None:  # once a session set it, a changed knob changes the pool
        limit_blas_threads()


when_changed(_follow_the_knob)


def session_threads(session_config: dict[str, str]) -> int:
    """The thread count a session with ``session_config`` runs with (its ``intra_op_num_threads``, 0: one per
    usable CPU, at most that many; one with ``use_deterministic_compute``)."""
    text = session_config.get("session.intra_op_num_threads", "0")
    try:
        threads = int(text)
    except ValueError:
        raise InvalidArgumentError(
            f"intra_op_num_threads must be an integer (0 = one per usable CPU), got {text!r}"
        ) from None
    if threads < 0:
        raise InvalidArgumentError(f"intra_op_num_threads must be >= 0 (0 = default), got {threads}")
    if threads == 1 or session_config.get("session.use_deterministic_compute", "0") == "1":
        return 1  # (one is never past the usable CPUs)
    return min(threads, default_threads()) if threads else default_threads()


class RunThreads:
    """One session's thread count, entered at each of its runs (the provider registers ``enter`` and
    ``leave`` as its run scope): the split kernels' count on the running thread, and numpy's BLAS pool set to
    the knob's size capped by it, when the pool is not that size already (a global compare on most runs)."""

    def __init__(self, threads: int):
        self.threads = threads

    def enter(self) -> contextvars.Token:
        size = min(KNOBS.blas_threads, self.threads)
        if _blas_applied != size:
            limit_blas_threads(size)
        return _run_threads.set(self.threads)

    @staticmethod
    def leave(token: contextvars.Token) -> None:
        _run_threads.reset(token)


def apply_thread_settings(session_config: dict[str, str]) -> RunThreads:
    """The session's RunThreads (see session_threads); numpy's BLAS pool is sized for it now too."""
    run = RunThreads(session_threads(session_config))
    limit_blas_threads(min(KNOBS.blas_threads, run.threads))
    return run
