"""A helper running a part on the caller's own CPU (the scheduler put it there; Helpers._spread moves it off only
after the job) progresses only while the caller leaves that CPU: the waiting caller yields instead of spinning
(workers._wait), so its CPU time is its own part's, not the helper's part's again in spinning."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import epilogue, host, jobs, workers

pytestmark = pytest.mark.skipif(not host.HELPER_THREADS or not hasattr(os, "sched_setaffinity"),
                                reason=host.HELPERS_REFUSED or "needs helper threads and CPU affinity")


def _affine(elements: int, seed: int):
    """One AFFINE part (Relu(x * factor + shift) over one channel of ``elements``) and its expected output."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 1, elements), dtype=np.float32)
    factor, shift = rng.standard_normal(1, dtype=np.float32), rng.standard_normal(1, dtype=np.float32)
    params = np.array([0, 6], dtype=np.float32)
    y, expected = np.full_like(x, np.nan), np.empty_like(x)
    epilogue.channel_affine(x, factor, shift, expected, epilogue.RELU, params)
    return (x, factor, shift, y, epilogue.RELU, params), y, expected


def test_a_caller_sharing_its_cpu_with_the_helper_yields_while_it_waits(monkeypatch):
    """Both threads pinned to one CPU: once the helper has started its part (tens of milliseconds), the caller
    waits for it. Spinning, the caller spends about that part's CPU time again (the helper gets every other time
    slice); yielding, little of it."""
    monkeypatch.setattr(workers, "_SPIN_SECONDS", 5.0)  # the helper spins through the test once awake
    cpus = os.sched_getaffinity(0)
    one = {min(cpus)}
    pool = workers.Helpers(1)
    helper = pool._helpers[0]  # noqa: SLF001
    big, y_big, want_big = _affine(1 << 25, 2)
    start = time.thread_time()
    epilogue.channel_affine(*big)  # the helper's part, on this thread
    big_cpu = time.thread_time() - start
    os.sched_setaffinity(0, one)
    try:
        os.sched_setaffinity(helper.thread.native_id, one)
        spent = []
        for _ in range(3):
            y_big[:] = np.nan
            sequence = helper.post(jobs.AFFINE, big)
            deadline = time.monotonic() + 60  # a loaded machine may keep the helper waiting
            while helper.mailbox[workers.CLAIMED] < sequence and time.monotonic() < deadline:
                threading.Event().wait(0.0005)  # off the CPU: the helper claims its part
            assert helper.mailbox[workers.CLAIMED] >= sequence, "the helper never started its part"
            start = time.thread_time()
            helper.wait(sequence)
            spent.append(time.thread_time() - start)
            np.testing.assert_array_equal(y_big, want_big)
        assert min(spent) < 0.3 * big_cpu, (f"the caller spent {[round(t * 1e3, 1) for t in spent]} ms of CPU "
                                            f"waiting for a part of {big_cpu * 1e3:.1f} ms")
    finally:
        os.sched_setaffinity(0, cpus)
