"""How kernels split their work across the helper threads: planes or channels in even spans (pooling, batch
normalization, depthwise convolution), items cut into tasks the threads claim (claimed_tasks, run_claimed), the
calling thread's scratch buffer, and the measure of an uneven split. The sizes that decide are knobs of tuning.py.
"""

from __future__ import annotations

import threading

import numpy as np

from ..threads import kernel_threads
from ..tuning import KNOBS


def thread_spans(count: int, elements: int, dtype, least: int | None = None) -> tuple[tuple[int, int], ...] | None:
    """``count`` independent rows (planes, channels) split evenly across the kernel threads from ``least`` work
    (default: the split_elements knob), for a
    float32 kernel that runs as a job of compiled/jobs.py (on the helper threads of workers.py, or on
    this one alone: one span when the work is small or there is one thread). None where the jobs do
    not run (other dtypes, hosts without the packed convolution): the caller calls its loop itself.
    Kept per (count, size, threads): building them would cost every run (measured in d57ce75)."""
    if dtype != np.float32:
        return None
    threads = kernel_threads()
    key = (count, elements >= (KNOBS.split_elements if least is None else least), threads)
    found = _spans.get(key, False)
    if found is False:
        from ..compiled import host  # not gemm.py, which imports numba

        found = None
        if host.AVX512:
            parts = min(threads, count) if key[1] else 1
            bounds = [count * t // max(parts, 1) for t in range(max(parts, 1) + 1)]
            found = tuple((a, b) for a, b in zip(bounds, bounds[1:]) if b > a) or ((0, count),)
        _spans[key] = found
    return found


_spans: dict[tuple, tuple | None] = {}


def span_bounds(spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The spans as part i from bounds[i] to bounds[i + 1] (int64), the form compiled posters take."""
    found = _bounds.get(spans)
    if found is None:
        found = _bounds[spans] = np.array([first for first, _ in spans] + [spans[-1][1]], dtype=np.int64)
    return found


_bounds: dict[tuple, np.ndarray] = {}


LINE_FLOATS = 16  # float32 values of a cache line: tasks of values cut on them, so no two threads write one line


def task_cuts(count: int, tasks: int, unit: int = 1) -> list[int]:
    """``count`` items cut evenly into ``tasks`` tasks: task i is items cuts[i] .. cuts[i + 1], each cut a multiple
    of ``unit`` but the last."""
    units = -(-count // unit)
    return [min(count, units * i // tasks * unit) for i in range(tasks + 1)]


def claimed_tasks(count: int, tasks: int, threads: int, unit: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cuts, ranges, claims) of ``count`` items in ``tasks`` tasks for ``threads`` parts, as the claimed-task job
    kinds take them (compiled/workers.claim_task): task i is items cuts[i] .. cuts[i + 1] (task_cuts), part p's
    tasks ranges[p] .. ranges[p + 1], claimed through claims[p] (run_claimed zeroes them before each run)."""
    cuts = np.array(task_cuts(count, tasks, unit), dtype=np.int64)
    ranges = np.array([tasks * p // threads for p in range(threads + 1)], dtype=np.int64)
    return cuts, ranges, np.zeros(threads, dtype=np.int64)


def run_claimed(kind, parts: list) -> None:
    """A claimed-task job of ``kind`` (a bound plan's step, or a kernel's call): ``parts``, one per thread, each ending
    with (claims, part), on the calling thread and the helpers, their shared claims zeroed first."""
    from ..compiled import workers

    parts[0][-2][:] = 0
    workers.run(kind, parts, len(parts) - 1)


_scratches = threading.local()  # per calling thread: the buffer of scratch


def scratch(floats: int) -> np.ndarray:
    """The calling thread's float32 scratch, ``floats`` long (grown as needed, reused by every kernel that
    asks: a kernel's use ends when it returns)."""
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or buffer.size < floats:
        buffer = _scratches.buffer = np.empty(max(floats, 1), dtype=np.float32)
    return buffer[:floats]


def uneven(count: int, parts: int) -> float:
    """The largest of ``parts`` near-equal shares of ``count`` units over the mean share."""
    return -(-count // parts) * parts / count
