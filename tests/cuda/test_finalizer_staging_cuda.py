"""A finalizer that synchronizes the device, run by a collection while its thread is inside the staging ring (issue 21).

A released device binding synchronizes the device (``DeviceIoBinding.__del__`` -> close -> sync), and the sync
delivers the ring's staged downloads (staging.py). A collection runs such a finalizer on the thread whose allocation
started it, wherever that thread is: inside the ring's lock, or holding a block for a copy of its own. With a plain
lock either waited forever for its own thread. Each case runs on a thread of its own with a time limit, so a
regression fails instead of hanging the run.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from model_helpers import within_limit

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")

LIMIT_S = 20
pytestmark = pytest.mark.usefixtures("collector_off")  # (tests/cuda/conftest.py)


class _Syncs:
    """Reachable only through a cycle; its finalizer synchronizes the device, as a released binding's does."""

    def __init__(self, lane, calls):
        self.lane, self.calls, self.cycle = lane, calls, self

    def __del__(self):
        self.lane.sync()
        self.calls.append("synced")


def _pending_download(lane, values):
    """A staged download of ``values`` from the device into a host array, left pending; (array, block)."""
    _address, base = lane.allocate(values.nbytes)
    lane.shared.upload(base, values.view(np.uint8))
    lane.sync()
    host = np.zeros(values.nbytes, np.uint8)
    lane.copy_async(host, base, values.nbytes)
    block = next(b for b in lane.shared.staging._blocks if b.pending is not None)  # noqa: SLF001
    return host, base, block


def test_a_sync_inside_the_ring_lock_delivers_without_waiting_for_itself(cuda_handle):
    lane = cuda_handle.provider.cuda_device()
    staging = lane.shared.staging
    values = np.arange(256, dtype=np.float32)
    host, base, _block = _pending_download(lane, values)
    calls = []
    _Syncs(lane, calls)

    def collect_inside():
        with staging._lock:  # noqa: SLF001 - as a collection started by an allocation inside the ring would
            gc.collect()

    within_limit(collect_inside, staging._lock, LIMIT_S, "a finalizer's sync inside the staging ring's lock")  # noqa: SLF001
    assert calls == ["synced"]
    np.testing.assert_array_equal(host.view(np.float32), values)  # delivered by the finalizer's sync
    lane.free(base)


def test_a_sync_while_holding_a_pending_block_leaves_it_to_the_holder(cuda_handle):
    lane = cuda_handle.provider.cuda_device()
    staging = lane.shared.staging
    values = np.linspace(-1, 1, 512, dtype=np.float32)
    host, base, block = _pending_download(lane, values)
    calls = []
    _Syncs(lane, calls)

    def collect_holding():
        block.take()  # as the ring does while settling the block it hands out to this thread's next copy
        try:
            gc.collect()
            assert block.pending is not None  # passed over, not lost
        finally:
            block.give()
        staging.deliver()

    within_limit(collect_holding, block.held, LIMIT_S, "a finalizer's sync while its thread holds a staging block")
    assert calls == ["synced"]
    np.testing.assert_array_equal(host.view(np.float32), values)
    assert block.pending is None
    lane.free(base)
