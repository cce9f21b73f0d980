"""A tensor freed by a garbage collection's finalizer while its thread holds the device's locks (issue 21).

A collection runs finalizers on the thread whose allocation started it, wherever that thread is: inside the device's
own critical sections too. ``Tensor.__del__`` of a tensor dropped in a reference cycle then frees device memory on a
thread that holds the device's lock; with a plain lock that free waited forever for its own thread (a pytest worker
that stalled on an H200 after earlier tests had left cycles behind). The free is kept and issued at the next
allocation, free or sync. Each case runs on a thread of its own with a time limit, so a regression fails instead of
hanging the run.
"""

from __future__ import annotations

import gc

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import within_limit

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")

LIMIT_S = 20
pytestmark = pytest.mark.usefixtures("collector_off")  # (tests/cuda/conftest.py)


def _within_limit(action, lock) -> None:
    within_limit(action, lock, LIMIT_S, "a finalizer's free inside the device's lock")


def _cyclic_tensor(handle, n=64):
    """A device tensor reachable only through a reference cycle: freed by the next collection; its base address."""
    tensor = ort.Tensor.from_numpy(np.arange(n, dtype=np.float32), provider=handle)
    base = tensor.buffer.provider_state
    cycle = [tensor]
    cycle.append(cycle)
    return base


@pytest.mark.parametrize("lock", ["_lock", "_order_lock"])
def test_a_collection_inside_the_device_lock_frees_after_it(cuda_handle, lock):
    lane = cuda_handle.provider.cuda_device()
    device = lane.shared
    base = _cyclic_tensor(cuda_handle)
    frees = device.frees

    def collect_inside():
        with getattr(device, lock):
            gc.collect()  # as a collection started by an allocation inside the section would
            assert device.frees == frees and base in device._live  # noqa: SLF001 - kept for later, not lost
        lane.sync()  # the next sync issues it

    _within_limit(collect_inside, getattr(device, lock))
    assert device.frees == frees + 1
    assert base not in device._live  # noqa: SLF001


def test_kept_frees_are_issued_by_the_next_allocation(cuda_handle):
    lane = cuda_handle.provider.cuda_device()
    device = lane.shared
    bases = [_cyclic_tensor(cuda_handle) for _ in range(3)]
    frees = device.frees

    def collect_inside():
        with device._lock:  # noqa: SLF001
            gc.collect()
        _address, base = lane.allocate(256)
        lane.free(base)

    _within_limit(collect_inside, device._lock)  # noqa: SLF001
    assert device.frees == frees + 4
    assert not any(base in device._live for base in bases)  # noqa: SLF001
    assert not device._deferred_frees  # noqa: SLF001


def test_a_reserved_allocation_dropped_inside_the_device_lock_is_released_after_it(cuda_handle):
    from onnx_runtime_ep_cuda.vmm import granularity

    lane = cuda_handle.provider.cuda_device()
    device = lane.shared
    reserved = cuda_handle.hook.allocate_committed(size=2 * granularity(lane), alignment=256,
                                                   committed_ranges=[(0, 4096)])
    mapped = reserved.provider_state
    tensor = ort.Tensor(ort.DataType.UINT8, (4096,), reserved, cuda_handle)
    cycle = [tensor]
    cycle.append(cycle)
    del tensor, cycle

    def collect_inside():
        with device._lock:  # noqa: SLF001
            gc.collect()
            assert not mapped._closed  # noqa: SLF001 - kept for later
        lane.sync()

    _within_limit(collect_inside, device._lock)  # noqa: SLF001
    assert mapped._closed  # noqa: SLF001
