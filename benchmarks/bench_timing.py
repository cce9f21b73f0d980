"""Fair timing of several runtimes in one process: warm up each, then alternate them, run by run
(``alternating``) or in blocks of consecutive runs separated by a pause (``in_blocks``)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def alternating(runners: dict[str, Callable[[], object]], repeat: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per call of each runner over ``repeat`` rounds, after ``warmup`` untimed rounds.

    Each round calls every runner once; the order rotates from round to round so that no runtime is
    always the one that runs right after another has filled (or evicted) the caches. On a shared, noisy
    machine this keeps slow periods spread over all runtimes instead of landing on one.
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeat):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    return times


def in_blocks(runners: dict[str, Callable[[], object]], repeat: int, warmup: int = 3, block: int = 5,
              pause: float = 0.3) -> dict[str, list[float]]:
    """Seconds per call of each runner: ``repeat`` timed calls each, in blocks of ``block`` consecutive
    calls, the runtimes taking turns block by block (order rotating), ``pause`` seconds apart.

    Thread pools keep their workers spinning for a while after a call (OpenBLAS's, onnxruntime's with
    its default ``allow_spinning``, this runtime's CPU helper threads for 5 ms), which speeds up a
    runtime's next call and slows down whatever else runs meanwhile. Within a block each runtime runs
    as it does for a user calling it in a loop, pools warm; the pause lets the pools go idle before
    another runtime's block, so none pays for another's spinning. The first call of each block is
    untimed (the pool wakes up there).
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(-(-repeat // block)):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            time.sleep(pause)
            runners[name]()
            for _ in range(min(block, repeat - len(times[name]))):
                start = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - start)
    return times


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start
