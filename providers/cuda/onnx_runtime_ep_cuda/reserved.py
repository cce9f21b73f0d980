"""Allocations that reserve address space and commit a prefix of it (the committed-range hooks of the contract),
on :class:`~onnx_runtime_ep_cuda.vmm.MappedGrowthBuffer`: what a ``DeviceIoBinding`` asks for when its spec gives
``committed_ranges`` (a KV cache allocated at its capacity, of which only the rows written so far need memory).

A mapped-growth buffer backs its address range from the start, one granule-rounded step at a time, so a
committed range is served by growing the prefix up to its end, and only a tail (from an offset to the committed
end) can be decommitted. An allocation whose committed ranges cover it all, or that fits in one granule (mapping
would round it up to one anyway), comes whole from the stream-ordered pool, as ``allocate`` does, and the session's
account charges it; a mapped-growth buffer's granules are charged by their grants (``allocation_charged_by_provider``).
The buffer's address never changes, so a captured graph that recorded it stays valid while the binding grows.
"""

from __future__ import annotations

from onnx_runtime import hookimpl
from onnx_runtime.contract.buffers import DeviceBuffer
from onnx_runtime.contract.defaults import check_range
from onnx_runtime.errors import InvalidArgumentError, NotSupportedError

from .vmm import MappedGrowthBuffer, granularity

__all__ = ["ReservedAllocations"]


class ReservedAllocations:
    """The committed-range hooks of :class:`CUDAExecutionProvider` (a mixin: it needs ``cuda_device()``)."""

    @hookimpl
    def allocate_committed(self, size, alignment, committed_ranges):
        ranges = [(0, size)] if committed_ranges is None else [(int(a), int(b)) for a, b in committed_ranges]
        for start, stop in ranges:
            if not 0 <= start <= stop <= size:
                raise InvalidArgumentError(
                    f"{self.name()}: committed range {start}..{stop} is outside the {size}-byte allocation")
        if any(start == 0 and stop == size for start, stop in ranges) or size <= granularity(self.cuda_device()):
            return self.allocate(size, alignment)  # all of it committed, or one granule at most: the pool
        reserved = MappedGrowthBuffer(self.cuda_device(), size, **self.growth_governance())
        try:
            reserved.grow(max((stop for _start, stop in ranges), default=0))
        except BaseException:
            reserved.close()
            raise
        self._allocations += 1
        self.cuda_device().note_home(id(reserved), self.cuda_device(), reserved.ptr, reserved.capacity)
        return DeviceBuffer(self.device_id(), size, alignment, reserved.ptr, host=None, provider_state=reserved)

    @hookimpl
    def commit_allocation_range(self, buffer, offset, nbytes):
        check_range(self.name(), "commit", buffer, offset, nbytes)
        reserved = buffer.provider_state
        if isinstance(reserved, MappedGrowthBuffer):  # a pool buffer is committed already
            reserved.grow(int(offset) + int(nbytes))

    @hookimpl
    def decommit_allocation_range(self, buffer, offset, nbytes):
        check_range(self.name(), "decommit", buffer, offset, nbytes)
        reserved = buffer.provider_state
        if not isinstance(reserved, MappedGrowthBuffer):
            raise NotSupportedError(
                f"{self.name()}: the buffer at {buffer.ptr:#x} was allocated whole from the pool and has nothing to "
                f"decommit; allocate it with committed_ranges to reserve its addresses instead")
        if int(offset) + int(nbytes) < min(reserved.committed, buffer.size):
            raise InvalidArgumentError(
                f"{self.name()}: decommit of {offset}..{offset + nbytes} would leave memory committed after it; a "
                f"reserved allocation is backed from its start, so only its tail (up to {reserved.committed} bytes "
                f"committed now) can be decommitted: decommit from {offset} to the end")
        reserved.shrink(int(offset))

    @hookimpl
    def allocation_charged_by_provider(self, buffer):
        reserved = buffer.provider_state  # mapped growth is granted by the adopted governor as it maps
        return isinstance(reserved, MappedGrowthBuffer) and reserved.governor is not None

    @hookimpl
    def allocation_committed_bytes(self, buffer):
        reserved = buffer.provider_state
        return min(reserved.committed, buffer.size) if isinstance(reserved, MappedGrowthBuffer) else buffer.size

    def release_reserved(self, buffer: DeviceBuffer) -> bool:
        """Unmap and free a reserved allocation (``deallocate``); False for a pool buffer."""
        reserved = buffer.provider_state
        if not isinstance(reserved, MappedGrowthBuffer):
            return False
        lane = self.cuda_device()
        if not lane.shared.defer_inside(self._release_mapped, lane, reserved):  # a finalizer inside the device's locks
            self._release_mapped(lane, reserved)
        return True

    @staticmethod
    def _release_mapped(lane, reserved: MappedGrowthBuffer) -> None:
        lane.shared.wait_for_users(lane, id(reserved))  # no queued work of a lane that touched it may still run
        lane.forget_access(id(reserved), reserved.close)  # after a capture that reached it, when one is open
