"""Mapped growth on the CUDA driver: a buffer whose address range is reserved once at its full capacity and
whose physical memory is created and mapped as it grows (cuMemAddressReserve, cuMemCreate, cuMemMap,
cuMemSetAccess), for buffers such as KV caches that grow step by step without moving.

Every granule mapped is first granted by the process's memory governor (``prepare_mapped_growth`` semantics:
the bytes are charged before the driver is asked, and returned after they are unmapped), so a growing cache
shares the device's budget with every session. Each physical handle is released exactly once and each mapping
unmapped exactly once, on :meth:`MappedGrowthBuffer.shrink` or :meth:`MappedGrowthBuffer.close`; the counters
say so. The same code runs on the real driver and on the simulator (sim/vmm.py).
"""

from __future__ import annotations

import threading

from onnx_runtime.contract.residency import HolderId, MemoryRole
from onnx_runtime.errors import InvalidArgumentError, ProviderError

from .driver import check

__all__ = ["MappedGrowthBuffer", "allocation_prop", "driver_for", "granularity"]


def driver_for(device):
    """``device``'s driver module, with its context current on this thread (driver calls need it)."""
    device._bind()  # noqa: SLF001 (the device owns its context; this is its one way in)
    return device.driver


def allocation_prop(driver, ordinal: int):
    """A CUmemAllocationProp for pinned memory on device ``ordinal``."""
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def granularity(device) -> int:
    """The driver's minimum mapping granularity on ``device`` (a CudaDevice)."""
    d = device.driver
    flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check(d, d.cuMemGetAllocationGranularity(allocation_prop(d, device.index), flag),
                     "cuMemGetAllocationGranularity"))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class MappedGrowthBuffer:
    """``capacity`` bytes of address space on ``device`` with ``committed`` bytes of it backed by memory.

    ``governor`` (a DeviceGovernor, or None for an ungoverned buffer) grants each growth for ``role`` to
    ``holder``. Not a Tensor: the owner views ``ptr`` for as many bytes as are committed.
    """

    def __init__(self, device, capacity: int, governor=None, holder: HolderId | None = None,
                 role: MemoryRole = MemoryRole.KV_CACHE):
        if capacity <= 0:
            raise InvalidArgumentError(f"a mapped-growth buffer needs a positive capacity, got {capacity}")
        self.device = device
        self.driver = device.driver
        self.granularity = granularity(device)
        self.capacity = _round_up(int(capacity), self.granularity)
        self.governor = governor
        self.holder = holder or HolderId("mapped growth")
        self.role = role
        self._lock = threading.Lock()
        self._chunks: list[tuple[object, int]] = []  # (physical handle, size), in address order
        self.committed = 0
        self.maps = self.unmaps = self.creates = self.releases = 0
        self._bind()
        d = self.driver
        self.ptr = int(check(d, d.cuMemAddressReserve(self.capacity, self.granularity, 0, 0), "cuMemAddressReserve"))
        self._closed = False

    def _bind(self) -> None:
        driver_for(self.device)

    def _access(self):
        d = self.driver
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device.index
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def mapped_bytes_for(self, nbytes: int) -> int:
        """The bytes growing to ``nbytes`` would newly map (granule rounding included)."""
        return max(0, _round_up(int(nbytes), self.granularity) - self.committed)

    def grow(self, nbytes: int) -> int:
        """Back at least ``nbytes`` from ``ptr`` with memory; returns the bytes newly mapped. A failure leaves
        what was committed before, and gives back what it took."""
        if nbytes > self.capacity:
            raise InvalidArgumentError(
                f"growing a mapped buffer to {nbytes} bytes passes its reserved capacity of {self.capacity}; "
                f"reserve a larger capacity")
        with self._lock:
            self._check_open()
            size = self.mapped_bytes_for(nbytes)
            if not size:
                return 0
            grant = self.governor.grant(size, self.role, self.holder) if self.governor is not None else None
            d = self.driver
            self._bind()
            address = self.ptr + self.committed
            handle = None
            mapped = False
            try:
                handle = check(d, d.cuMemCreate(size, allocation_prop(d, self.device.index), 0), "cuMemCreate")
                self.creates += 1
                check(d, d.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
                mapped = True
                self.maps += 1
                check(d, d.cuMemSetAccess(address, size, [self._access()], 1), "cuMemSetAccess")
                if grant is not None:
                    grant.commit_bytes(size)
            except BaseException:
                if mapped:
                    check(d, d.cuMemUnmap(address, size), "cuMemUnmap")
                    self.unmaps += 1
                if handle is not None:
                    check(d, d.cuMemRelease(handle), "cuMemRelease")
                    self.releases += 1
                if grant is not None:
                    grant.release()  # nothing was committed: the whole grant goes back
                raise
            if grant is not None:
                grant.release()  # nothing unused: the committed bytes stay charged until unmapped
            self._chunks.append((handle, size))
            self.committed += size
            return size

    def shrink(self, nbytes: int) -> int:
        """Unmap the granules past ``nbytes`` (whole growth steps, newest first); returns the bytes unmapped."""
        freed = 0
        with self._lock:
            self._check_open()
            while self._chunks and self.committed - self._chunks[-1][1] >= nbytes:
                freed += self._unmap_last()
        return freed

    def _unmap_last(self) -> int:
        handle, size = self._chunks.pop()
        self.committed -= size
        d = self.driver
        self._bind()
        try:
            check(d, d.cuMemUnmap(self.ptr + self.committed, size), "cuMemUnmap")
            self.unmaps += 1
        finally:
            check(d, d.cuMemRelease(handle), "cuMemRelease")  # the memory goes once its mapping is gone
            self.releases += 1
        if self.governor is not None:
            self.governor.release_mapped(size, self.role, self.holder)
        return size

    def _check_open(self) -> None:
        if self._closed:
            raise ProviderError("this mapped-growth buffer was closed; its address range is gone")

    def close(self) -> None:
        """Unmap and release everything, then free the address range; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                while self._chunks:
                    self._unmap_last()
            finally:
                d = self.driver
                self._bind()
                check(d, d.cuMemAddressFree(self.ptr, self.capacity), "cuMemAddressFree")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
