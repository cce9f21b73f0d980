"""Threads: how many the CPU provider's split kernels use, and numpy's BLAS pool.

The default is one thread per CPU this process may use: its affinity set, capped by a cgroup CPU quota
(a container's ``--cpus``), not the machine's core count. ``intra_op_num_threads`` (0 = that default)
sets it for the process: the last session created with an explicit setting wins. numpy's BLAS runs on
one thread by default (the ``blas_threads`` knob of tuning.py): OpenBLAS's own pool spins on cores
another process may hold and waits for threads the OS descheduled, where the split kernels hand out
their parts as tasks claimed one at a time. ``use_deterministic_compute`` runs everything on one
thread: threaded GEMV/GEMM partition the output, and different partitions can round identical columns
differently, which a model with huge activations turns into visibly different softmax outputs across
machines. (The packed convolution's results do not depend on its partition.)
"""

from __future__ import annotations

import ctypes

from onnx_runtime.cpus import usable_cpus
from onnx_runtime.errors import InvalidArgumentError

from .blas import bundled_openblas
from .tuning import KNOBS, when_changed

_DEFAULT_THREADS = usable_cpus()
_threads = _DEFAULT_THREADS  # threads a split kernel uses, the caller's included
_blas_applied: int | None = None  # the BLAS pool size set (None: not yet)


def kernel_threads() -> int:
    """How many threads a kernel that splits its work uses, the calling one included (the ``threads``
    knob of tuning.py, else the session's setting)."""
    return KNOBS.threads or _threads


def helper_count() -> int:
    """How many helper threads the split kernels start (once per process): one per other core (or the
    ``helpers`` knob of tuning.py)."""
    return KNOBS.helpers or max(1, _DEFAULT_THREADS - 1)


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


def limit_blas_threads() -> None:
    """Set numpy's BLAS pool to the ``blas_threads`` knob's size (when it is not that size already)."""
    global _blas_applied
    if _blas_applied != KNOBS.blas_threads:
        if not _setter:
            _setter.append(_numpy_openblas_setter())
        if _setter[0] is not None:
            _setter[0](KNOBS.blas_threads)
        else:  # another BLAS (a numpy built against MKL, a system OpenBLAS): threadpoolctl knows them all
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=KNOBS.blas_threads, user_api="blas")
        _blas_applied = KNOBS.blas_threads


def _follow_the_knob() -> None:
    if _blas_applied is not None:  # once a session set it, a changed knob changes the pool
        limit_blas_threads()


when_changed(_follow_the_knob)


def apply_thread_settings(session_config: dict[str, str]) -> int | None:
    """Apply the thread settings of ``session_config``; returns the thread count set, if any."""
    limit_blas_threads()
    try:
        threads = int(session_config.get("session.intra_op_num_threads", "0"))
    except ValueError:
        raise InvalidArgumentError(
            f"intra_op_num_threads must be an integer, got {session_config['session.intra_op_num_threads']!r}"
        ) from None
    if threads < 0:
        raise InvalidArgumentError(f"intra_op_num_threads must be >= 0 (0 = default), got {threads}")
    if session_config.get("session.use_deterministic_compute", "0") == "1":
        threads = 1
    if threads == 0:
        return None
    global _threads
    _threads = min(threads, _DEFAULT_THREADS)
    return threads
