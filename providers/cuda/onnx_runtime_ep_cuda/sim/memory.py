"""Simulated device memory: host pages whose addresses are the device pointers emulated kernels dereference.

Each allocation is its own anonymous mapping with an inaccessible page on either side and the data placed so
that it ends at the upper guard page (the start stays 256-byte aligned, as cuMemAlloc guarantees). A kernel
that runs off the end of a buffer, or touches one after it was freed (the mapping is gone), faults, and the
launch reports CUDA_ERROR_ILLEGAL_ADDRESS instead of silently corrupting a neighbour. New allocations are
filled with 0xFF bytes (NaN floats, -1 integers) unless ONNX_RUNTIME_CUDA_SIM_POISON=0, because device memory
from a pool holds stale data and code that reads it before writing must not pass by luck.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
from dataclasses import dataclass

ALIGNMENT = 256
POISON_ENV = "ONNX_RUNTIME_CUDA_SIM_POISON"
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # large buffers cost nothing until touched
_PROT_NONE = 0


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(eq=False)
class Allocation:
    address: int
    size: int
    mapping: int  # start and length of the whole mapping, guard pages included
    length: int
    live: bool = True
    graph_refs: int = 0  # graphs and executable graphs whose allocation nodes own this mapping
    captured: bool = False  # allocated while a stream was being captured: the graph's memory
    pooled: bool = False  # stream-ordered (cuMemAllocAsync): counted in the default pool's statistics
    free_pending: bool = False  # a deferred stream holds its cuMemFreeAsync: freeing it again is a double free


class DeviceMemory:
    """The device's address space: allocations by start address, with containment lookup for copies."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.mapped = 0
        self._by_address: dict[int, Allocation] = {}
        self._starts: list[int] = []

    def allocate(self, size: int) -> Allocation | None:
        """A fresh allocation of ``size`` bytes, or None when the simulated device is out of memory."""
        data = _round_up(size, ALIGNMENT)
        body = _round_up(data, _PAGE)
        length = body + 2 * _PAGE
        if self.mapped + data > self.capacity:
            return None
        base = _libc.mmap(None, length, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base is None or base == _MAP_FAILED:
            return None
        if _libc.mprotect(base + _PAGE, body, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            _libc.munmap(base, length)
            return None
        address = base + _PAGE + body - data
        if os.environ.get(POISON_ENV, "1") != "0":
            ctypes.memset(address, 0xFF, size)
        allocation = Allocation(address, size, base, length)
        self.mapped += data
        self._by_address[address] = allocation
        bisect.insort(self._starts, address)
        return allocation

    def release(self, allocation: Allocation) -> None:
        """Unmaps ``allocation``; later kernel accesses fault and driver calls no longer find it."""
        if self._by_address.pop(allocation.address, None) is None:
            return
        self._starts.pop(bisect.bisect_left(self._starts, allocation.address))
        self.mapped -= _round_up(allocation.size, ALIGNMENT)
        allocation.live = False
        _libc.munmap(allocation.mapping, allocation.length)

    def register(self, allocation: Allocation) -> None:
        """Make memory mapped elsewhere (virtual memory management, sim/vmm.py) visible as an allocation; its
        owner unregisters it and keeps the mapping and the capacity count."""
        self._by_address[allocation.address] = allocation
        bisect.insort(self._starts, allocation.address)

    def unregister(self, allocation: Allocation) -> None:
        if self._by_address.pop(allocation.address, None) is not None:
            self._starts.pop(bisect.bisect_left(self._starts, allocation.address))
        allocation.live = False

    def at(self, address: int) -> Allocation | None:
        """The allocation starting exactly at ``address`` (what cuMemFree needs)."""
        return self._by_address.get(address)

    def containing(self, address: int, size: int = 1) -> Allocation | None:
        """The live allocation holding all of ``[address, address + size)``, or None."""
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0:
            return None
        allocation = self._by_address[self._starts[index]]
        if not allocation.live or address + max(size, 1) > allocation.address + allocation.size:
            return None
        return allocation

    def live_allocations(self) -> list[Allocation]:
        return [a for a in self._by_address.values() if a.live]

    def live(self) -> dict[int, int]:
        return {a.address: a.size for a in self.live_allocations()}

    def release_all(self) -> None:
        for allocation in list(self._by_address.values()):
            self.release(allocation)
