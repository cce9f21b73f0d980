"""How many workers and how many intra-op threads each: workers x threads <= the CPUs of the node.

A session's kernels split across ``intra_op_num_threads`` threads; a batch job runs several sessions side by
side (processes, Ray actors, Dask task slots). More runnable threads than CPUs make them preempt one another
mid-kernel, which costs more than it gains, so one rule sizes every engine: fill the CPUs once.
"""

from __future__ import annotations

import sys

from ..cpus import usable_cpus
from ..errors import InvalidArgumentError


def plan_workers(workers: int | None = None, threads: int | None = None, cpus: int | None = None) -> tuple[int, int]:
    """``(workers, threads)`` with workers x threads <= cpus, filling in whichever is not given.

    Neither given: one worker per CPU, one thread each (batch throughput scales better across sessions than
    inside one). Over the CPUs (both given, or either alone above them): an error naming sizes that fit."""
    cpus = usable_cpus() if cpus is None else cpus
    for name, value in (("workers", workers), ("threads", threads), ("cpus", cpus)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InvalidArgumentError(f"batch sizing: {name} must be a positive integer, got {value!r}")
    if workers is None and threads is None:
        return cpus, 1
    if workers is None:
        assert threads is not None
        workers = max(1, cpus // threads)
    elif threads is None:
        threads = max(1, cpus // workers)
    if workers * threads > cpus:
        raise InvalidArgumentError(
            f"batch sizing: {workers} workers x {threads} intra-op threads = {workers * threads} threads on "
            f"{cpus} CPUs oversubscribes the node; use at most {max(1, cpus // threads)} workers of {threads} "
            f"threads, or {min(workers, cpus)} workers of {max(1, cpus // workers)} threads")
    return workers, threads


MICRO_BATCH_ROWS = 32  # rows per model call where neither the caller nor the model's static batch size says


def even_micro_batch(rows: int, most: int = MICRO_BATCH_ROWS) -> int:
    """Rows per model call for batches of ``rows`` rows: the largest size from ``most`` down to half of it that
    divides ``rows`` (``rows`` itself when it is at most ``most``), else ``most``.

    Every call of a batch then has the same number of rows. A runtime that plans per input shape (this one does)
    otherwise plans the short last call too, once per worker: a 250-row shard in calls of 32 is 7 x 32 + 26 rows,
    in calls of 25 it is 10 x 25."""
    if not isinstance(rows, int) or rows < 1:
        raise InvalidArgumentError(f"batch sizing: rows per shard must be a positive integer, got {rows!r}")
    if rows <= most:
        return rows
    for size in range(most, (most + 1) // 2 - 1, -1):
        if rows % size == 0:
            return size
    return most


def worker_threads() -> int:
    """Intra-op threads for a session created inside a worker, when the user gave none.

    In a Ray actor or task: the CPUs Ray assigned to it (``num_cpus``), which Ray's scheduler already keeps
    within the node. In a Dask worker: one per task slot, since Dask runs ``nthreads`` partitions at once per
    worker and sizes workers x nthreads to the CPUs. Elsewhere: every usable CPU (one session per process)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            assigned = ray.get_runtime_context().get_assigned_resources().get("CPU")
        except Exception:  # the driver, or a Ray without the runtime context API: not an actor
            assigned = None
        if assigned:
            return max(1, int(assigned))
    distributed = sys.modules.get("distributed")
    if distributed is not None:
        try:
            distributed.get_worker()
            return 1
        except ValueError:  # not inside a Dask worker
            pass
    return usable_cpus()
