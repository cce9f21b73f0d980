"""Sealed constants: a weight uploaded once per device and provider context, shared by every session of the
same model there.

A provider opts in by implementing ``upload_sealed_constant`` and a non-None ``runtime_identity``. The
registry keys each constant by the provider context that owns it and the weight's identity (for a mapped
weight: its file, inode, modification time and byte range; otherwise a digest of its bytes, dtype and shape).
The first session uploads it and the registry charges its bytes to one holder per device ("sealed constants on
cuda:0"); later sessions take a reference; the memory is freed, and its charge returned, when the last
reference goes. Sessions read it through borrowed buffers, which they never free.
"""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np

from ..contract.buffers import DeviceBuffer, Ownership
from ..contract.residency import HolderId, MemoryLease, MemoryRole, Tier
from ..dtypes import DataType
from ..records import Record
from ..tensor import Tensor
from .governor import DeviceGovernor
from .mapped import mapped_region

__all__ = ["SealedWeights", "live_sealed_constants", "provider_seals"]


class _Entry(Record):
    __match_args__ = ("allocation", "lease", "refs")
    allocation: object  # the provider's SealedDeviceAllocation
    lease: MemoryLease
    refs: int

    def __init__(self, allocation: object, lease: MemoryLease, refs: int = 0) -> None:
        self.allocation = allocation
        self.lease = lease
        self.refs = refs


_LOCK = threading.Lock()
_REGISTRY: dict[tuple, _Entry] = {}
_HOLDERS: dict[str, HolderId] = {}


def provider_seals(handle) -> bool:
    """Whether ``handle``'s provider takes part in sealed constants."""
    return bool(handle.implements("upload_sealed_constant")) and handle.hook.runtime_identity() is not None


def weight_identity(array: np.ndarray) -> tuple:
    region = mapped_region(array)
    if region is not None:
        source, offset = region
        stat = os.stat(source.path)
        return ("file", os.path.realpath(source.path), stat.st_ino, stat.st_mtime_ns, offset, int(array.nbytes),
                str(array.dtype), tuple(array.shape))
    digest = hashlib.blake2b(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data, digest_size=20).digest()
    return ("bytes", digest, str(array.dtype), tuple(array.shape))


def live_sealed_constants() -> int:
    """How many sealed constants the process holds (each freed when its last session goes)."""
    with _LOCK:
        return len(_REGISTRY)


class SealedWeights:
    """One session's references to the sealed constants of its weights on one device provider."""

    def __init__(self, handle, governor: DeviceGovernor):
        self.handle = handle
        self.governor = governor
        self.context = handle.hook.provider_context_identity()
        self._keys: list[tuple] = []
        self.shared = 0  # weights this session found already sealed by another

    def key(self, array: np.ndarray) -> tuple:
        return (self.context, weight_identity(array))

    def is_sealed(self, key: tuple) -> bool:
        with _LOCK:
            return key in _REGISTRY

    def acquire(self, array: np.ndarray, key: tuple | None = None) -> Tensor:
        """A tensor over the sealed copy of ``array``, uploaded now when no session has sealed it yet."""
        key = key or self.key(array)
        with _LOCK:
            entry = _REGISTRY.get(key)
            if entry is None:
                device = self.governor.device
                holder = _HOLDERS.setdefault(device, HolderId(f"sealed constants on {device}"))
                lease = self.governor.reserve(max(int(array.nbytes), 1), Tier.DEVICE, MemoryRole.WEIGHTS, holder)
                try:
                    allocation = self.handle.hook.upload_sealed_constant(
                        data=np.ascontiguousarray(array), alignment=256)
                except BaseException:
                    lease.release()
                    raise
                entry = _REGISTRY[key] = _Entry(allocation, lease)
            else:
                self.shared += 1
            entry.refs += 1
            self._keys.append(key)
            allocation = entry.allocation
        return self._tensor(array, allocation)

    def borrow(self, array: np.ndarray, key: tuple) -> Tensor | None:
        """A tensor over the constant another session sealed for ``array``, referenced like :meth:`acquire`'s;
        None (and nothing uploaded) when none is sealed: a paged session reads sealed constants, never seals."""
        with _LOCK:
            entry = _REGISTRY.get(key)
            if entry is None:
                return None
            self.shared += 1
            entry.refs += 1
            self._keys.append(key)
            allocation = entry.allocation
        return self._tensor(array, allocation)

    def _tensor(self, array: np.ndarray, allocation) -> Tensor:
        buffer = DeviceBuffer(allocation.device, int(array.nbytes), 256, allocation.ptr, Ownership.BORROWED)
        return Tensor(DataType.from_numpy(array.dtype), array.shape, buffer, self.handle)

    def close(self) -> None:
        """Drop this session's references; a constant no session holds is freed and its charge returned."""
        with _LOCK:
            keys, self._keys = self._keys, []
            freed = []
            for key in keys:
                entry = _REGISTRY[key]
                entry.refs -= 1
                if entry.refs == 0:
                    freed.append(_REGISTRY.pop(key))
        for entry in freed:
            try:
                entry.allocation.release()  # type: ignore[attr-defined]
            finally:
                entry.lease.release()
