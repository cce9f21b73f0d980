"""A buffer released by a garbage collection's finalizer while its thread is inside the memory account's lock.

A collection runs finalizers on the thread whose allocation started it, wherever that thread is: ``Tensor.__del__``
of a tensor dropped in a reference cycle then gives its charge back (``DeviceAccount.released``) on a thread that
may hold the account's lock (charging an allocation builds lists under it). With a plain lock that release waited
forever for its own thread; it is kept and given back at the thread's next call. The collection runs on a thread of
its own with a time limit, so a regression fails instead of hanging the run.
"""

from __future__ import annotations

import gc

import onnx_runtime as ort
import pytest
from model_helpers import within_limit
from onnx_runtime.contract.residency import HolderId
from onnx_runtime.memory import ProcessMemoryGovernor
from onnx_runtime.memory.accounts import DeviceAccount

LIMIT_S = 20


@pytest.fixture
def account():
    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    enabled = gc.isenabled()
    gc.disable()  # no automatic collection finds the cycle before the test's own does
    governor = ProcessMemoryGovernor()
    handle = ort.ProviderHandle(SampleDeviceExecutionProvider())
    handle.initialize({})
    account = DeviceAccount(handle, governor.device("other:7"), HolderId("finalizers"))
    handle.memory_account = account
    yield account
    account.close()
    handle.shutdown()
    if enabled:
        gc.enable()


def test_a_release_by_a_collection_inside_the_account_lock_is_given_back_after_it(account):
    handle = account.handle
    tensor = ort.Tensor(ort.DataType.UINT8, (4096,), handle.allocate(4096), handle)
    cycle = [tensor]
    cycle.append(cycle)
    del tensor, cycle
    assert account.charged == 4096
    def collect_inside():
        with account._lock:  # noqa: SLF001
            gc.collect()  # as one started by an allocation inside the section would
        assert account.charged == 0  # given back at the next call
        buffer = handle.allocate(64)
        handle.deallocate(buffer)
        assert account.charged == 0

    within_limit(collect_inside, account._lock, LIMIT_S, "a finalizer's release inside the account's lock")  # noqa: SLF001
