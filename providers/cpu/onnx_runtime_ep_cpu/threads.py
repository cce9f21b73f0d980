"""BLAS threads: the session options that govern the CPU provider's matrix kernels.

numpy's BLAS has one process-wide thread pool, so these settings apply to the process: the last
session created with an explicit setting wins. ``intra_op_num_threads`` (0 = BLAS's default) sets
the pool size. ``use_deterministic_compute`` runs BLAS on one thread: threaded GEMV/GEMM partition
the output across threads, and different partitions can round identical columns differently, which
a model with huge activations (the onnx package's light CNNs reach 1e19) turns into visibly
different softmax outputs across machines.
"""

from __future__ import annotations

from onnx_runtime.errors import InvalidArgumentError
from threadpoolctl import threadpool_limits


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
    return threads
