"""CUDA virtual memory management: the driver calls (simulated in sim/vmm.py, real with
ONNX_RUNTIME_CUDA_TESTS=real) and the provider's mapped-growth buffer (vmm.py) on them, charged to the memory
governor, with every mapping unmapped and every physical handle released exactly once."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REAL
from onnx_runtime.contract.residency import HolderId
from onnx_runtime.errors import InvalidArgumentError, ProviderError
from onnx_runtime.memory import MemoryBudgetError, ProcessMemoryGovernor


@pytest.fixture
def device(cuda_driver_mode):
    from onnx_runtime_ep_cuda import CudaDevice

    return CudaDevice.get(0)


def _live(device) -> dict[str, int] | None:
    return None if REAL else device.driver.live_vmm()


def _ok(result):
    err, *values = result
    assert int(err) == 0, result
    return values[0] if len(values) == 1 else values


def _fails(result) -> bool:
    return int(result[0]) != 0


# -- the driver calls -----------------------------------------------------------------------------------------
def test_reserve_create_map_access_then_undo_each_exactly_once(device):
    from onnx_runtime_ep_cuda.vmm import allocation_prop, driver_for, granularity

    d = driver_for(device)
    g = granularity(device)
    va = _ok(d.cuMemAddressReserve(4 * g, g, 0, 0))
    handle = _ok(d.cuMemCreate(2 * g, allocation_prop(d, 0), 0))
    _ok(d.cuMemMap(va, 2 * g, 0, handle, 0))
    assert _fails(d.cuMemMap(va, 2 * g, 0, handle, 0))  # a range is mapped once
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(d.cuMemSetAccess(va, 2 * g, [desc], 1))
    data = np.arange(2 * g // 4, dtype=np.uint32)
    _ok(d.cuMemcpyHtoD(va, data, data.nbytes))
    back = np.empty_like(data)
    _ok(d.cuMemcpyDtoH(back, va, back.nbytes))
    np.testing.assert_array_equal(back, data)
    if not REAL:  # past the mapped granules nothing is accessible: the simulator refuses the copy
        assert _fails(d.cuMemcpyHtoD(int(va) + 2 * g, data[:4], 16))
        assert _fails(d.cuMemAddressFree(va, 4 * g))  # mappings are still in the range
    _ok(d.cuMemUnmap(va, 2 * g))
    _ok(d.cuMemRelease(handle))
    assert _fails(d.cuMemRelease(handle))  # released twice
    _ok(d.cuMemAddressFree(va, 4 * g))
    if not REAL:
        assert _fails(d.cuMemAddressFree(va, 4 * g))
        assert _live(device) == {"reservations": 0, "handles": 0, "mappings": 0}


@pytest.mark.skipif(REAL, reason="the simulator's capacity accounting")
def test_physical_memory_counts_against_the_device_until_released_and_unmapped(device):
    from onnx_runtime_ep_cuda.vmm import allocation_prop, driver_for, granularity

    d = driver_for(device)
    g = granularity(device)
    free_before, _ = _ok(d.cuMemGetInfo())
    handle = _ok(d.cuMemCreate(g, allocation_prop(d, 0), 0))
    va = _ok(d.cuMemAddressReserve(g, g, 0, 0))
    _ok(d.cuMemMap(va, g, 0, handle, 0))
    assert _ok(d.cuMemGetInfo())[0] == free_before - g
    _ok(d.cuMemRelease(handle))  # still mapped: CUDA frees it with the last mapping
    assert _ok(d.cuMemGetInfo())[0] == free_before - g
    _ok(d.cuMemUnmap(va, g))
    assert _ok(d.cuMemGetInfo())[0] == free_before
    _ok(d.cuMemAddressFree(va, g))


@pytest.mark.skipif(REAL, reason="the simulator's stricter argument checks")
def test_sizes_must_be_granular(device):
    from onnx_runtime_ep_cuda.vmm import allocation_prop, driver_for, granularity

    d = driver_for(device)
    g = granularity(device)
    assert _fails(d.cuMemCreate(g + 1, allocation_prop(d, 0), 0))
    assert _fails(d.cuMemAddressReserve(g // 2, 0, 0, 0))
    assert "granularity" in d.last_error_message()


# -- mapped growth --------------------------------------------------------------------------------------------
def test_a_buffer_grows_in_place_keeping_its_bytes_and_undoes_every_step(device):
    from onnx_runtime_ep_cuda.vmm import MappedGrowthBuffer

    governor = ProcessMemoryGovernor()
    view = governor.device("cuda:0")
    holder = HolderId("kv cache")
    buffer = MappedGrowthBuffer(device, 8 << 20, view, holder)
    g = buffer.granularity
    address = buffer.ptr
    assert buffer.committed == 0 and governor.used("cuda:0") == 0  # reserved, not backed
    assert buffer.grow(100) == g and governor.used("cuda:0") == g
    first = np.random.default_rng(0).integers(0, 2**31, g // 4, dtype=np.uint32)
    device.upload(buffer.ptr, first.view(np.uint8))
    assert buffer.grow(g + 1) == g and buffer.ptr == address  # grown without moving
    assert buffer.grow(g) == 0  # already backed
    second = np.arange(g // 4, dtype=np.uint32)
    device.upload(buffer.ptr + g, second.view(np.uint8))
    whole = np.empty(g // 2, np.uint32)  # one copy across the two growth steps
    device.download(whole.view(np.uint8), buffer.ptr)
    np.testing.assert_array_equal(whole, np.concatenate([first, second]))
    assert governor.used("cuda:0") == 2 * g and governor.snapshot()[0]["roles"] == {"kv_cache": 2 * g}
    assert buffer.shrink(g) == g and governor.used("cuda:0") == g
    head = np.empty(g // 4, np.uint32)
    device.download(head.view(np.uint8), buffer.ptr)
    np.testing.assert_array_equal(head, first)
    buffer.close()
    buffer.close()  # idempotent
    assert governor.used("cuda:0") == 0
    assert (buffer.creates, buffer.maps) == (buffer.releases, buffer.unmaps) == (2, 2)
    if not REAL:
        assert _live(device) == {"reservations": 0, "handles": 0, "mappings": 0}
    with pytest.raises(ProviderError, match="was closed"):
        buffer.grow(1)


def test_growth_past_the_budget_is_refused_naming_the_holder_and_takes_nothing(device):
    from onnx_runtime_ep_cuda.vmm import MappedGrowthBuffer, granularity

    g = granularity(device)
    governor = ProcessMemoryGovernor()
    governor.set_limit("cuda:0", 2 * g)
    with MappedGrowthBuffer(device, 8 * g, governor.device("cuda:0"), HolderId("decoder kv")) as buffer:
        buffer.grow(2 * g)
        with pytest.raises(MemoryBudgetError, match=r"decoder kv.*needs \d+ bytes of kv_cache.*short"):
            buffer.grow(3 * g)
        assert buffer.committed == 2 * g and buffer.creates == 1  # refused before the driver was asked
        assert governor.used("cuda:0") == 2 * g
        with pytest.raises(InvalidArgumentError, match="passes its reserved capacity"):
            buffer.grow(9 * g)
    assert governor.used("cuda:0") == 0
    if not REAL:
        assert _live(device) == {"reservations": 0, "handles": 0, "mappings": 0}


@pytest.mark.skipif(REAL, reason="exhausts the simulated device only")
def test_a_driver_failure_while_growing_gives_the_grant_back(device, monkeypatch):
    from onnx_runtime_ep_cuda.vmm import MappedGrowthBuffer

    governor = ProcessMemoryGovernor()
    with MappedGrowthBuffer(device, 4 << 20, governor.device("cuda:0")) as buffer:
        monkeypatch.setattr(device.driver, "cuMemMap", lambda *args: (device.driver.CUresult(2),))
        with pytest.raises(ProviderError, match="cuMemMap failed"):
            buffer.grow(1)
        monkeypatch.undo()
        assert governor.used("cuda:0") == 0 and buffer.committed == 0
        assert buffer.creates == buffer.releases == 1 and buffer.maps == buffer.unmaps == 0
    assert _live(device) == {"reservations": 0, "handles": 0, "mappings": 0}
