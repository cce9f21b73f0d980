"""The CPUs this process may use: its affinity set, capped by its cgroup's CPU quota (a container's ``--cpus``),
not the machine's core count. The CPU provider's default thread count and the batch engines' worker sizing both
start from it."""

from __future__ import annotations

import functools
import math
import os

__all__ = ["cgroup_cpu_quota", "cpu_flags_line", "usable_cpus"]


def usable_cpus(affinity: int | None = None, quota: float | None = None) -> int:
    """The CPUs this process may use: its affinity set, capped by its cgroup's CPU quota (rounded up)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if quota is None:
        quota = cgroup_cpu_quota()
    return max(1, min(affinity, math.ceil(quota))) if quota is not None else max(1, affinity)


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time per period the process's cgroup allows (cgroup v2's cpu.max, v1's
    cpu.cfs_quota_us / cpu.cfs_period_us), or None without a limit."""
    for path in _cgroup_v2_paths(root):
        try:
            quota, period = _read(path).split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else int(quota) / int(period)
    for directory in (f"{root}/cpu", f"{root}/cpu,cpuacct"):
        try:
            quota_us = int(_read(f"{directory}/cpu.cfs_quota_us"))
            period_us = int(_read(f"{directory}/cpu.cfs_period_us"))
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


def _cgroup_v2_paths(root: str) -> list[str]:
    """cpu.max of the process's own cgroup (from /proc/self/cgroup), then of the root."""
    paths = []
    try:
        for line in _read("/proc/self/cgroup").splitlines():
            if line.startswith("0::"):
                paths.append(f"{root}{line[3:].strip().rstrip('/')}/cpu.max")
    except OSError:
        pass
    return paths + [f"{root}/cpu.max"]


@functools.cache
def cpu_flags_line() -> str:
    """/proc/cpuinfo's first "flags" (x86) or "Features" (Arm) line as it is written, newline included; "" where
    there is none (not Linux, or unreadable). Read once per process for every reader (the plan cache's key, the CPU
    provider's kernels), and only up to that line: the kernel writes the file one CPU at a time as it is read, so
    the whole of it costs a host of many CPUs far more than the first CPU's part. (UTF-8, which every interpreter
    has loaded: the file is ASCII.)"""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""
