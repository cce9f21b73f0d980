"""Sealed constants on CUDA: a graph constant uploaded once into device memory that every session of the model
on the device shares (the core's registry, onnx_runtime.memory.sealed, decides what to share and when to free).

All sessions on a device use its primary context, so the context is both the runtime identity a kernel checks
and the provider context that owns the memory. The memory belongs to the device, not to a session's provider
instance: it outlives the session that uploaded it and is freed exactly once by ``release``. Its upload is waited
for before the constant is handed out, since the sessions that share it run on streams of their own.
"""

from __future__ import annotations

import threading

from onnx_runtime import hookimpl
from onnx_runtime.contract.buffers import DeviceBuffer, Ownership
from onnx_runtime.contract.defaults import host_bytes_of
from onnx_runtime.contract.residency import ProviderContextIdentity, RawDeviceAllocationSiteStats

__all__ = ["SealedConstants", "SealedCudaAllocation", "sealed_site_stats"]

_UPLOADS: dict[int, list[int]] = {}  # id(CudaDevice) -> [constants uploaded, their bytes], for the site stats
_UPLOADS_LOCK = threading.Lock()


def sealed_site_stats(cuda_device) -> list[RawDeviceAllocationSiteStats]:
    """The sealed constants uploaded on ``cuda_device`` (allocated outside the ``allocate`` hook), as one site."""
    with _UPLOADS_LOCK:
        count, nbytes = _UPLOADS.get(id(cuda_device), (0, 0))
    if not count:
        return []
    site = SealedConstants.upload_sealed_constant.__code__
    return [RawDeviceAllocationSiteStats(site.co_filename, site.co_firstlineno, requests=count, requested_bytes=nbytes,
                                         driver_allocations=count, driver_bytes=nbytes)]

NAME = "CUDAExecutionProvider"


class SealedCudaAllocation:
    """Immutable device memory holding one constant (the contract's ``SealedDeviceAllocation``)."""

    def __init__(self, cuda_device, device_id, address: int, base: int, size: int,
                 context: ProviderContextIdentity, runtime: int):
        self._cuda_device = cuda_device
        self._device_id = device_id
        self._address = address
        self._base = base
        self._size = size
        self._context = context
        self._runtime = runtime
        self._released = False
        self._lock = threading.Lock()

    @property
    def ptr(self) -> int:
        return self._address

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self):
        return self._device_id

    @property
    def provider_context(self) -> ProviderContextIdentity:
        return self._context

    @property
    def runtime_identity(self) -> int:
        return self._runtime

    def buffer(self) -> DeviceBuffer:
        """A borrowed view for a kernel input: never freed through a session."""
        return DeviceBuffer(self._device_id, self._size, 256, self._address, Ownership.BORROWED)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Free the memory; idempotent (the registry calls it once, when no session holds the constant)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        if not self._cuda_device.closed:  # after process-exit release the memory went with the context
            self._cuda_device.free(self._base)


class SealedConstants:
    """The sealed-constant hooks of :class:`CUDAExecutionProvider` (a mixin: it needs ``cuda_device()`` and
    ``_device_id``)."""

    @hookimpl
    def runtime_identity(self):
        return int(self.cuda_device().context)

    @hookimpl
    def provider_context_identity(self):
        return ProviderContextIdentity(NAME, int(self.cuda_device().context))

    @hookimpl
    def upload_sealed_constant(self, data, alignment):
        source = host_bytes_of(data)
        device = self.cuda_device()
        address, base = device.allocate(max(int(source.size), 1), max(int(alignment), 1))
        try:
            device.upload(address, source)
            # Other sessions read the constant on their own streams, where no event orders them after this
            # upload (a kernel's weights are not ordered per run): it is complete before anyone can read it.
            device.sync()
        except BaseException:
            device.free(base)
            raise
        with _UPLOADS_LOCK:
            counts = _UPLOADS.setdefault(id(device), [0, 0])
            counts[0] += 1
            counts[1] += int(source.size)
        context = int(device.context)
        return SealedCudaAllocation(device, self._device_id, address, base, int(source.size),
                                    ProviderContextIdentity(NAME, context), context)
