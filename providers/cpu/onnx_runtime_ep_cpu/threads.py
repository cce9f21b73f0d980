"""Threads: the session options that govern the CPU provider's matrix kernels.

numpy's BLAS has one process-wide thread pool, and the packed convolution (compiled/gemm.py) its
own helper threads (compiled/workers.py), so these settings apply to the process: the last session
created with an explicit setting wins. ``intra_op_num_threads`` (0 = default: BLAS's own default, and
one convolution thread per available core) sets both pool sizes. ``use_deterministic_compute``
runs BLAS on one thread: threaded GEMV/GEMM partition the output across threads, and different
partitions can round identical columns differently, which a model with huge activations (the onnx
package's light CNNs reach 1e19) turns into visibly different softmax outputs across machines. (The
packed convolution's results do not depend on its partition.)
"""

from __future__ import annotations

import os

from onnx_runtime.errors import InvalidArgumentError
from threadpoolctl import threadpool_limits

from .tuning import KNOBS

_DEFAULT_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_threads = _DEFAULT_THREADS  # threads a split kernel uses, the caller's included


def kernel_threads() -> int:
    """How many threads a kernel that splits its work uses, the calling one included (the ``threads``
    knob of tuning.py, else the session's setting)."""
    return KNOBS.threads or _threads


def helper_count() -> int:
    """How many helper threads the split kernels start (once per process): one per other core (or the
    ``helpers`` knob of tuning.py)."""
    return KNOBS.helpers or max(1, _DEFAULT_THREADS - 1)


def apply_thread_settings(session_config: dict[str, str]) -> int | None:
    """Apply the thread settings of ``session_config``; returns the BLAS thread limit set, if any."""
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
    threadpool_limits(limits=threads, user_api="blas")
    global _threads
    _threads = min(threads, _DEFAULT_THREADS)
    return threads
