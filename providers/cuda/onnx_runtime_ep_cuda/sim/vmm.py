"""The CUDA virtual memory management calls, simulated: address ranges reserved without memory, physical
allocations created as handles, mapped into a range and made accessible, unmapped and released.

Same names, arguments and return conventions as ``cuda.bindings.driver``. A reservation is an inaccessible
host mapping of its size; a physical allocation (``cuMemCreate``) is a memory file of its size, counted against
the simulated device's capacity until it is released *and* no longer mapped (as CUDA frees it); ``cuMemMap``
maps the file into the range, still inaccessible, and ``cuMemSetAccess`` opens it, after which copies, memsets
and kernels see the bytes like any allocation (each contiguous accessible run of a reservation is one device
allocation to them). A kernel that reads past what was mapped faults. Stricter than CUDA where CUDA leaves the
result undefined: sizes and addresses must be multiples of the granularity, a range is mapped once, unmapping
needs whole mappings, and a reservation is freed only once nothing in it is mapped.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import mmap
import os
from dataclasses import dataclass, field

from .execution import _drain_all
from .memory import Allocation
from .state import _api, _Fail, _state, _value
from .types import CUdeviceptr, CUresult, _Handle

__all__ = [
    "CUmemAccess_flags", "CUmemAccessDesc", "CUmemAllocationGranularity_flags", "CUmemAllocationProp",
    "CUmemAllocationType", "CUmemGenericAllocationHandle", "CUmemLocation", "CUmemLocationType",
    "cuMemAddressFree", "cuMemAddressReserve", "cuMemCreate", "cuMemGetAllocationGranularity", "cuMemMap",
    "cuMemRelease", "cuMemSetAccess", "cuMemUnmap", "live_vmm",
]

GRANULARITY = 2 << 20  # what CUDA reports for device memory on current GPUs

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_RW = mmap.PROT_READ | mmap.PROT_WRITE


# ---- types (values are CUDA's) --------------------------------------------------------------------------------
class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - cuda-python's name
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801 - cuda-python's name
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemGenericAllocationHandle(_Handle):
    __slots__ = ()


class CUmemLocation:
    def __init__(self) -> None:
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.location = CUmemLocation()
        self.requestedHandleTypes = 0  # noqa: N815 - cuda-python's name


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


# ---- state ----------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Physical:
    handle: int
    size: int
    fd: int
    maps: int = 0
    released: bool = False


@dataclass(eq=False)
class _Mapping:
    start: int
    size: int
    physical: _Physical
    accessible: bool = False


@dataclass(eq=False)
class _Reservation:
    start: int
    size: int
    base: int  # the host mapping behind it (alignment slack included)
    length: int
    mappings: list[_Mapping] = field(default_factory=list)  # sorted by start
    views: list[Allocation] = field(default_factory=list)  # accessible runs, as the rest of the driver sees them


class _Vmm:
    def __init__(self, memory) -> None:
        self.memory = memory  # the DeviceMemory of the driver state this belongs to (a reset replaces it)
        self.reservations: dict[int, _Reservation] = {}
        self.starts: list[int] = []
        self.physical: dict[int, _Physical] = {}
        self.next_handle = 1

    def close(self) -> None:
        for reservation in self.reservations.values():
            _libc.munmap(reservation.base, reservation.length)
        for physical in self.physical.values():
            os.close(physical.fd)
        self.reservations.clear()
        self.physical.clear()


_current: _Vmm | None = None


def _vmm() -> _Vmm:
    """This driver state's VMM (after a simulator reset, the old one's host resources are given back)."""
    global _current
    if _current is None or _current.memory is not _state.memory:
        if _current is not None:
            _current.close()
        _current = _Vmm(_state.memory)
    return _current


def _granular(value: int, what: str) -> int:
    value = int(value)
    if value <= 0 or value % GRANULARITY:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"{what} {value} is not a positive multiple of the allocation granularity ({GRANULARITY})")
    return value


def _check_device_location(location, call: str) -> None:
    if int(location.type) != CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE or int(location.id) != 0:
        code = CUresult.CUDA_ERROR_INVALID_DEVICE if int(location.type) == 1 else CUresult.CUDA_ERROR_INVALID_VALUE
        raise _Fail(code, f"{call}: the location must be device 0 (CU_MEM_LOCATION_TYPE_DEVICE)")


def _reservation_of(address: int, size: int, call: str) -> _Reservation:
    vmm = _vmm()
    index = bisect.bisect_right(vmm.starts, address) - 1
    if index >= 0:
        reservation = vmm.reservations[vmm.starts[index]]
        if address + size <= reservation.start + reservation.size:
            return reservation
    raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                f"{call}: [{address:#x}, +{size}) is not inside one reserved address range")


def _refresh_views(reservation: _Reservation) -> None:
    """Register each contiguous accessible run of mappings as one allocation for copies and kernels."""
    memory = _vmm().memory
    for view in reservation.views:
        memory.unregister(view)
    reservation.views = []
    run_start = run_end = None
    for mapping in [*reservation.mappings, None]:
        if mapping is not None and mapping.accessible and mapping.start == run_end:
            run_end += mapping.size
            continue
        if run_start is not None:
            view = Allocation(run_start, run_end - run_start, 0, 0)
            memory.register(view)
            reservation.views.append(view)
        run_start = run_end = None
        if mapping is not None and mapping.accessible:
            run_start, run_end = mapping.start, mapping.start + mapping.size


def _free_physical(physical: _Physical) -> None:
    vmm = _vmm()
    if physical.released and physical.maps == 0 and vmm.physical.pop(physical.handle, None) is not None:
        os.close(physical.fd)
        vmm.memory.mapped -= physical.size


# ---- the API --------------------------------------------------------------------------------------------------
@_api(1)
def cuMemGetAllocationGranularity(prop, option):
    _check_device_location(prop.location, "cuMemGetAllocationGranularity")
    return GRANULARITY


@_api(1, context=True)
def cuMemAddressReserve(size, alignment, addr, flags):
    size = _granular(size, "cuMemAddressReserve: size")
    alignment = max(int(alignment), GRANULARITY)
    if alignment & (alignment - 1):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemAddressReserve: alignment {alignment} is not a power of 2")
    length = size + alignment
    base = _libc.mmap(None, length, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if base is None or base == _MAP_FAILED:
        raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"cuMemAddressReserve: no {size}-byte address range left")
    start = (base + alignment - 1) // alignment * alignment
    vmm = _vmm()
    vmm.reservations[start] = _Reservation(start, size, base, length)
    bisect.insort(vmm.starts, start)
    return CUdeviceptr(start)


@_api(context=True)
def cuMemAddressFree(ptr, size):
    start, size = _value(ptr), int(size)
    vmm = _vmm()
    reservation = vmm.reservations.get(start)
    if reservation is None or reservation.size != size:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemAddressFree: [{start:#x}, +{size}) is not a whole reserved range (freed twice?)")
    if reservation.mappings:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemAddressFree: {len(reservation.mappings)} mappings are still in [{start:#x}, +{size}); "
                    f"cuMemUnmap them first")
    del vmm.reservations[start]
    vmm.starts.remove(start)
    _libc.munmap(reservation.base, reservation.length)


@_api(1, context=True)
def cuMemCreate(size, prop, flags):
    size = _granular(size, "cuMemCreate: size")
    if int(prop.type) != CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemCreate: prop.type must be CU_MEM_ALLOCATION_TYPE_PINNED")
    _check_device_location(prop.location, "cuMemCreate")
    vmm = _vmm()
    if vmm.memory.mapped + size > vmm.memory.capacity:
        free = vmm.memory.capacity - vmm.memory.mapped
        raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"cuMemCreate: {size} bytes requested, {free} free")
    fd = os.memfd_create("cuda-sim-physical", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as fresh:  # new device memory holds stale bytes, never zeros
            fresh.write(b"\xff" * size)
    except OSError as exc:
        os.close(fd)
        raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"cuMemCreate: {exc}") from None
    handle = vmm.next_handle
    vmm.next_handle += 1
    vmm.physical[handle] = _Physical(handle, size, fd)
    vmm.memory.mapped += size
    return CUmemGenericAllocationHandle(handle)


@_api(context=True)
def cuMemRelease(handle):
    physical = _vmm().physical.get(_value(handle))
    if physical is None or physical.released:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemRelease: {_value(handle)} is not a live allocation handle (released twice?)")
    physical.released = True
    _free_physical(physical)  # now, or when its last mapping goes


@_api(context=True)
def cuMemMap(ptr, size, offset, handle, flags):
    start, size, offset = _value(ptr), _granular(size, "cuMemMap: size"), int(offset)
    if start % GRANULARITY or offset % GRANULARITY or offset < 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemMap: address and offset must be granularity-aligned")
    physical = _vmm().physical.get(_value(handle))
    if physical is None or physical.released:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE, f"cuMemMap: {_value(handle)} is not a live allocation handle")
    if offset + size > physical.size:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemMap: [{offset}, +{size}) lies outside the {physical.size}-byte allocation")
    reservation = _reservation_of(start, size, "cuMemMap")
    if any(m.start < start + size and start < m.start + m.size for m in reservation.mappings):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemMap: [{start:#x}, +{size}) is already mapped")
    address = _libc.mmap(start, size, 0, mmap.MAP_SHARED | _MAP_FIXED, physical.fd, offset)
    if address is None or address == _MAP_FAILED or address != start:
        raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"cuMemMap: mapping failed (errno {ctypes.get_errno()})")
    physical.maps += 1
    mapping = _Mapping(start, size, physical)
    reservation.mappings.insert(bisect.bisect([m.start for m in reservation.mappings], start), mapping)


@_api(context=True)
def cuMemSetAccess(ptr, size, desc, count):
    start, size = _value(ptr), int(size)
    descriptors = list(desc)[: int(count)]
    if not descriptors:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: no access descriptor given")
    for descriptor in descriptors:
        _check_device_location(descriptor.location, "cuMemSetAccess")
    writable = int(descriptors[-1].flags) == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    reservation = _reservation_of(start, size, "cuMemSetAccess")
    covered = [m for m in reservation.mappings if start <= m.start and m.start + m.size <= start + size]
    if sum(m.size for m in covered) != size:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemSetAccess: [{start:#x}, +{size}) is not entirely mapped by whole mappings")
    protection = _RW if writable else (mmap.PROT_READ if int(descriptors[-1].flags) else 0)
    if _libc.mprotect(start, size, protection) != 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemSetAccess: mprotect failed ({ctypes.get_errno()})")
    for mapping in covered:
        mapping.accessible = protection != 0
    _refresh_views(reservation)


@_api(context=True)
def cuMemUnmap(ptr, size):
    start, size = _value(ptr), int(size)
    reservation = _reservation_of(start, size, "cuMemUnmap")
    covered = [m for m in reservation.mappings if start <= m.start and m.start + m.size <= start + size]
    if sum(m.size for m in covered) != size:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemUnmap: [{start:#x}, +{size}) is not exactly a run of whole mappings")
    _drain_all()  # queued work may still read it, as cuMemFree waits for the device
    address = _libc.mmap(start, size, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
    if address != start:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemUnmap: could not unmap ({ctypes.get_errno()})")
    for mapping in covered:
        reservation.mappings.remove(mapping)
        mapping.physical.maps -= 1
        _free_physical(mapping.physical)
    _refresh_views(reservation)


def live_vmm() -> dict[str, int]:
    """Simulator-only: reservations, physical handles and mappings still alive (each must reach 0)."""
    vmm = _vmm()
    return {"reservations": len(vmm.reservations), "handles": len(vmm.physical),
            "mappings": sum(len(r.mappings) for r in vmm.reservations.values())}
