"""Fair timing of several runtimes in one process: warm up each, then alternate them round by round."""

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


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and the seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start
