"""Page-locked (pinned) host staging for host<->device copies.

A copy from pageable host memory is synchronous on a GPU: the driver first copies it into a pinned bounce
buffer of its own, and a copy *to* pageable memory returns only once the stream has run up to it. Staging
through blocks of page-locked memory (cuMemHostAlloc) makes an upload asynchronous: the bytes are copied
into a block on the host, the device copy is enqueued, and an event recorded after it says when the block
may be written again. The caller's array may be reused at once.

Blocks are a small ring of fixed-size chunks, allocated on first use and freed exactly once in ``close``
(``allocated`` and ``freed`` count them). A copy larger than a block goes through the ring chunk by chunk; a
block is only rewritten after the event of its previous copy completed. Lanes share the ring, so the next block
may hold another lane's copy: a block whose copy the event says is complete is taken first (a query, not a wait),
and the host waits only when every block is busy, a whole ring ahead of the device. A lane's synchronization
settles only the blocks its own streams used.

Once the provider adopts the memory governor (``govern``), every block is charged to the device's pinned host
tier (role staging) before it is allocated. A block the budget cannot take is not allocated: the ring stays at
the blocks it has (one at least: a budget that cannot hold one block fails the copy with the governor's error).

A collection may run a finalizer that synchronizes the device (a released device binding) on a thread inside the
ring: its lock is reentrant, and :meth:`PinnedStaging.deliver` passes over a block the calling thread itself holds
(its copy is further up that thread's stack; the next synchronization delivers it) instead of waiting for itself.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import numpy as np
from onnx_runtime.contract.residency import MemoryRole, RawDeviceAllocationSiteStats, Tier
from onnx_runtime.errors import ProviderError

BLOCK_BYTES = 4 << 20  # per block: large enough to keep a copy engine busy, small enough to keep pinned memory low
RING = 4


@dataclass(eq=False)
class _Block:
    address: int
    view: np.ndarray  # the block's bytes (uint8)
    event: object  # recorded after the block's last device copy
    recorded: bool = False  # the event names a copy not yet known to be complete
    pending: np.ndarray | None = None  # a download's destination, filled from the block once the event completed
    lease: object = None  # the governor's charge for the block's pinned bytes, once governed
    stream: object = None  # the stream of its last copy
    held: threading.Lock = field(default_factory=threading.Lock)  # from being handed out until its copy is enqueued
    owner: int = 0  # the thread holding ``held`` (0: none), so that a finalizer on that thread does not wait for it

    def take(self, blocking: bool = True) -> bool:
        if not self.held.acquire(blocking):
            return False
        self.owner = threading.get_ident()
        return True

    def give(self) -> None:
        self.owner = 0
        self.held.release()


class PinnedStaging:
    """The staging ring of one :class:`CudaDevice` (see the module docstring). Lanes on several threads share it:
    a block is held by one copy from the moment it is handed out until its copy is enqueued (or, for a download,
    read back), so a thread a whole ring ahead waits for it instead of overwriting it."""

    def __init__(self, device):
        self.device = device
        self._blocks: list[_Block] = []
        self._next = 0
        self._lock = threading.RLock()  # reentrant: see the module docstring (finalizers)
        self.block_bytes = BLOCK_BYTES
        self.allocated = 0  # cuMemHostAlloc calls; every one is freed once by close
        self.freed = 0
        self._governor = None  # the adopted DeviceGovernor: blocks are charged to its pinned host tier
        self._holder = None
        self._ring = RING  # blocks the ring may hold: fewer when the pinned budget refused one

    def govern(self, governor, holder) -> int:
        """Charge the blocks (those allocated already, and every later one) to ``governor``'s pinned host tier
        for ``holder``; returns the bytes charged now. Adopting the same governor again charges nothing."""
        with self._lock:
            if self._governor is not None and getattr(self._governor, "device", None) == getattr(governor, "device", 0):
                return 0
            self._release_leases()
            self._governor, self._holder, self._ring = governor, holder, RING
            charged = 0
            for block in self._blocks:
                block.lease = governor.reserve(BLOCK_BYTES, Tier.PINNED_HOST, MemoryRole.STAGING, holder)
                charged += BLOCK_BYTES
            return charged

    @property
    def charged(self) -> int:
        """The pinned bytes this ring's blocks have charged to the governor."""
        with self._lock:
            return sum(BLOCK_BYTES for block in self._blocks if block.lease)

    def _release_leases(self) -> None:
        for block in self._blocks:
            lease, block.lease = block.lease, None
            if lease is not None:
                lease.release()

    def _charge(self):
        """A lease for one more block, None when ungoverned; raises only when the ring has no block to reuse."""
        if self._governor is None:
            return None
        try:
            return self._governor.reserve(BLOCK_BYTES, Tier.PINNED_HOST, MemoryRole.STAGING, self._holder)
        except ProviderError:
            if not self._blocks:
                raise
            self._ring = len(self._blocks)  # the budget is full: reuse the blocks there are
            return False

    def site_stats(self) -> list[RawDeviceAllocationSiteStats]:
        """The ring's cuMemHostAlloc calls, for the provider's ``raw_device_allocation_site_stats``."""
        with self._lock:
            count = self.allocated
        if not count:
            return []
        site = PinnedStaging._block.__code__  # where the ring calls cuMemHostAlloc
        return [RawDeviceAllocationSiteStats(site.co_filename, site.co_firstlineno, requests=count,
                                             requested_bytes=count * BLOCK_BYTES, driver_allocations=count,
                                             driver_bytes=count * BLOCK_BYTES)]

    def _check(self, result, call: str):
        return self.device._check(result, call)  # noqa: SLF001 - the device turns a fault into its typed error

    def _block(self) -> _Block:
        """A block no copy is using, else a new one while the ring has room, else the next block of the ring once
        the device is done with its previous copy."""
        d = self.device.driver
        with self._lock:
            block = self._idle_block()
            if block is not None:
                return block
            lease = self._charge() if len(self._blocks) < self._ring else False
            if lease is not False:
                try:
                    event = self._check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                except ProviderError:
                    if lease is not None:
                        lease.release()
                    raise
                try:
                    address = int(self._check(d.cuMemHostAlloc(BLOCK_BYTES, 0), f"cuMemHostAlloc({BLOCK_BYTES})"))
                except ProviderError:
                    self._check(d.cuEventDestroy(event), "cuEventDestroy(staging block)")
                    if lease is not None:
                        lease.release()
                    raise
                self.allocated += 1
                view = np.ctypeslib.as_array((ctypes.c_uint8 * BLOCK_BYTES).from_address(address))
                block = _Block(address, view, event, lease=lease)
                block.take()
                self._blocks.append(block)
                return block
            block = self._blocks[self._next % len(self._blocks)]
            self._next = (self._next + 1) % len(self._blocks)
        block.take()
        try:
            self._settle(block)
        except BaseException:
            block.give()
            raise
        return block

    def _idle_block(self) -> _Block | None:
        """A block no copy is using (its last copy complete), held for the caller, or None. Under ``_lock``."""
        d = self.device.driver
        count = len(self._blocks)
        for step in range(count):
            index = (self._next + step) % count
            block = self._blocks[index]
            if not block.take(blocking=False):
                continue
            if block.recorded:
                (err,) = d.cuEventQuery(block.event)
                if int(err) == int(d.CUresult.CUDA_ERROR_NOT_READY):
                    block.give()
                    continue
                try:
                    self._check((err,), "cuEventQuery(staging block)")
                except BaseException:
                    block.give()
                    raise
                block.recorded = False
            try:
                self._settle(block)  # a download it holds reaches its host array
            except BaseException:
                block.give()
                raise
            self._next = (index + 1) % count
            return block
        return None

    def completed(self, streams) -> None:
        """``streams`` were synchronized: the blocks whose last copy went there are complete (no event wait)."""
        for block in list(self._blocks):
            if block.recorded and any(block.stream is s for s in streams) and block.take(blocking=False):
                try:
                    if any(block.stream is s for s in streams):
                        block.recorded = False
                finally:
                    block.give()

    def _settle(self, block: _Block) -> None:
        if block.recorded:
            self._check(self.device.driver.cuEventSynchronize(block.event), "cuEventSynchronize(staging block)")
            block.recorded = False
        if block.pending is not None:
            target, block.pending = block.pending, None
            target[:] = block.view[: target.size]

    def _recorded(self, block: _Block, stream) -> None:
        self._check(self.device.driver.cuEventRecord(block.event, stream), "cuEventRecord(staging block)")
        block.recorded, block.stream = True, stream

    def upload(self, dst: int, src: np.ndarray, stream) -> None:
        """Enqueue host bytes ``src`` (uint8) into device memory at ``dst`` on ``stream``; returns at once."""
        d = self.device.driver
        for offset in range(0, src.size, BLOCK_BYTES):
            chunk = src[offset: offset + BLOCK_BYTES]
            block = self._block()
            try:
                block.view[: chunk.size] = chunk
                result = d.cuMemcpyHtoDAsync(dst + offset, block.address, chunk.size, stream)
                if int(result[0]):
                    self._check(result, f"cuMemcpyHtoDAsync({chunk.size} B, pinned)")
                self._recorded(block, stream)
            finally:
                block.give()

    def download_async(self, dst: np.ndarray, src: int, stream) -> None:
        """Enqueue device bytes at ``src`` into host array ``dst`` (uint8) through pinned blocks, a block per chunk;
        ``dst`` holds them after :meth:`deliver` (``CudaDevice.sync`` calls it). Past a whole ring the host waits
        for the earliest chunks' copies (and delivers them) as their blocks are reused."""
        self._download(dst, src, stream, wait=False)

    def download(self, dst: np.ndarray, src: int, stream) -> None:
        """Copy device bytes at ``src`` into host array ``dst`` (uint8) and wait for them."""
        self._download(dst, src, stream, wait=True)

    def _download(self, dst: np.ndarray, src: int, stream, wait: bool) -> None:
        """A pinned block per chunk: copied out as each block's copy settles (``wait``), or left pending for
        :meth:`deliver`."""
        d = self.device.driver
        for offset in range(0, dst.size, BLOCK_BYTES):
            chunk = dst[offset: offset + BLOCK_BYTES]
            block = self._block()
            try:
                result = d.cuMemcpyDtoHAsync(block.address, src + offset, chunk.size, stream)
                if int(result[0]):
                    self._check(result, f"cuMemcpyDtoHAsync({chunk.size} B, pinned)")
                self._recorded(block, stream)
                if wait:
                    self._settle(block)
                    chunk[:] = block.view[: chunk.size]
                else:
                    block.pending = chunk
            finally:
                block.give()

    def deliver(self, streams=None) -> None:
        """Finish the staged downloads of ``streams`` (every one when None); after those streams were synchronized
        this waits for nothing."""
        with self._lock:
            blocks = list(self._blocks)
        me = threading.get_ident()
        for block in blocks:
            if block.owner == me:  # a finalizer inside this thread's own copy with the block: delivered after it
                continue
            if block.pending is not None and (streams is None or any(block.stream is s for s in streams)):
                block.take()
                try:
                    self._settle(block)
                finally:
                    block.give()

    def abandon(self) -> None:
        """Forget every block: a context reset (after a device fault) freed them with everything else."""
        with self._lock:
            self.freed += len(self._blocks)
            self._release_leases()
            self._blocks = []

    def close(self) -> None:
        """Free every block and its event exactly once (the device's streams are idle or gone)."""
        d = self.device.driver
        with self._lock:
            blocks, self._blocks = self._blocks, []
        for block in blocks:
            self._check(d.cuEventDestroy(block.event), "cuEventDestroy(staging block)")
            self._check(d.cuMemFreeHost(block.address), "cuMemFreeHost")
            self.freed += 1
            lease, block.lease = block.lease, None
            if lease is not None:  # charged until the pinned bytes are freed
                lease.release()

