"""One CUDA device as the provider uses it: context, streams, memory, copies, fences and kernels.

A :class:`CudaDevice` exists once per device index in the process and is shared by every provider
instance on that device, so allocations, fences and compiled modules are shared too. It works on raw
device addresses; the provider checks DeviceBuffer bounds and ownership before calling it.

Streams. Kernels, allocation and synchronous copies run on the *compute* stream; ``copy_async`` runs
on the *transfer* stream so it can overlap compute. Both are non-blocking streams, so nothing is
implicitly ordered with the legacy default stream and every cross-stream dependency is an explicit
event wait (a :class:`Fence`).

Memory comes from the device's stream-ordered pool (cuMemAllocAsync / cuMemFreeAsync on the compute
stream, or the stream a caller names) when the device supports memory pools, else from cuMemAlloc / cuMemFree.
Each pooled allocation remembers the stream it was allocated on (its *home*): a free issued on another stream
first makes that stream wait on an event recorded on the home stream (once, at the free), so the pool never
hands the memory out again while work queued on the home stream may still touch it. Host bytes move through
page-locked staging blocks (staging.py), so an upload returns without waiting for the device.

Lanes. The streams above are the device's *default lane*. Each provider instance opens a lane of its own (lanes.py:
a compute and a transfer stream), so sessions on different threads run side by side; the methods below take the
``lane`` to work on (the default one when None). A buffer another lane may have touched is ordered by
:meth:`order_access` (lanes.py says how; access.py keeps the records), and a free waits for the lanes that read or
wrote the memory and resets the graphs of other lanes that recorded it. A device graph capture records the *stream*,
whichever thread enqueues on it, so while one thread captures a lane (``begin_capture`` to ``end_capture``, called
by graphs.py) other threads' calls on that lane wait at its gate instead of landing inside the graph (on a GPU) or
invalidating the capture; other lanes run and capture meanwhile. Runs of one session are serialized by its executor
(session/executor.py).

Finalizers. A garbage collection runs finalizers on the thread whose allocation started it, at any point of that
thread's code, so a tensor dropped in a reference cycle frees its device memory (``Tensor.__del__``) while that thread
may hold the device's own locks. Those locks are reentrant, and a free issued on a thread that holds one is kept and
issued at the next allocation, free or sync instead of changing the tables that thread is in the middle of (waiting
for a plain lock the thread itself holds never ends).

Faults. An exception in device code (illegal address, assert, trap) leaves a CUDA context unusable: every
later call fails. The first call that reports it raises :class:`CudaDeviceFaultError` naming the kernel
(the one launching, or the kernels launched most recently when a synchronization reports it), marks this
device closed and resets the primary context, so the next session on the index gets a fresh, working one.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx_runtime.contract.buffers import SIGNALLED, Fence
from onnx_runtime.errors import InvalidArgumentError, OnnxRuntimeError, ProviderError

from . import driver as driver_access
from . import nvrtc
from .access import AccessOrdering
from .driver import STICKY_ERRORS, CudaDeviceFaultError
from .lanes import Lane
from .staging import PinnedStaging

# Live fence events above this count are polled and the completed ones recycled, so a long run that
# never synchronizes still holds a bounded number of events.
_MAX_LIVE_EVENTS = 1024
_FILL_BLOCK = 256
_FILL_MAX_GRID = 1024  # grid-stride kernels: more blocks than this buys no bandwidth
_POOL_ALIGNMENT = 256  # cuMemAlloc and pool allocations are at least this aligned

_tls = threading.local()  # which device's context this thread last made current


@dataclass
class KernelModule:
    """A loaded module and the functions looked up in it so far."""

    handle: object
    name: str
    functions: dict[str, object] = field(default_factory=dict)


class CudaDevice(AccessOrdering):
    """See the module docstring. Use :meth:`get`; never construct directly."""

    _instances: dict[tuple[bool, int], CudaDevice] = {}
    _instances_lock = threading.Lock()

    @classmethod
    def get(cls, index: int = 0) -> CudaDevice:
        # Keyed by the simulator switch too, so a process that flips it (tests) never mixes drivers.
        key = (driver_access.simulated(), index)
        with cls._instances_lock:
            device = cls._instances.get(key)
            if device is None or device.closed:
                device = cls._instances[key] = cls(index)
            return device

    def __init__(self, index: int):
        self.driver = d = driver_access.load_driver_module()
        self.index = index
        self.closed = False
        self.fault = ""  # why the device became unusable (a kernel fault), once it did
        self._lock = threading.RLock()  # reentrant: see "Finalizers" in the module docstring
        self._kernel_names: dict[int, str] = {}  # function handle -> "file.cu:kernel", for fault reports
        self._recent = collections.deque(maxlen=8)  # the functions launched last, newest last
        self._check(d.cuInit(0), "cuInit")
        self.device = self._check(d.cuDeviceGet(index), f"cuDeviceGet({index})")
        self.name = self._check(d.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0", 1)[0].decode()
        major = self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.arch = major * 10 + minor
        self.context = self._check(d.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._bind()
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.compute = self._check(d.cuStreamCreate(flags), "cuStreamCreate(compute)")
        self.transfer = self._check(d.cuStreamCreate(flags), "cuStreamCreate(transfer)")
        self.default_lane = Lane(self, self.compute, self.transfer)
        self._gate = self.default_lane.gate
        self._lanes: dict[int, Lane] = {id(self.compute): self.default_lane}  # id(compute stream) -> lane
        self._idle_lanes: list[Lane] = []  # lanes of closed instances, handed to the next one
        self._order_lock = threading.RLock()  # a lane's capture flag and events recorded on it (lanes.py)
        self._deferred_frees: collections.deque = collections.deque()  # (release, args): see "Finalizers"
        self._init_access()
        self.pooled = bool(self._attribute(d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED))
        if self.pooled:
            # The default release threshold (0) hands freed memory back to the OS at every synchronize;
            # keeping it in the pool is what makes per-run allocation cheap.
            pool = self._check(d.cuDeviceGetDefaultMemPool(self.device), "cuDeviceGetDefaultMemPool")
            self._check(d.cuMemPoolSetAttribute(pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                                d.cuuint64_t(2**64 - 1)), "cuMemPoolSetAttribute")
        self.allocations = 0
        self.frees = 0
        self.bytes_in_use = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}  # address -> size of every allocation not yet freed
        self._live_starts: list[int] = []  # the keys of _live, sorted: which allocation holds an address
        self.cross_stream_frees = 0  # frees ordered after another stream by an event wait
        self._next_fence = 1  # fence ids count up from 1; 0 is the signalled fence
        self._events: dict[int, tuple] = {}  # fence id -> (CUevent not yet known to be complete, its lane)
        self._idle_events: list[object] = []
        self._modules: dict[tuple, KernelModule] = {}
        self.staging = PinnedStaging(self)

    # -- plumbing -----------------------------------------------------------------------------------
    def _check(self, result, call: str):
        try:
            return driver_access.check(self.driver, result, call)
        except ProviderError as error:
            err = result[0] if isinstance(result, tuple) else result
            if int(err) in STICKY_ERRORS:
                self._faulted(error, call)
            raise

    def _failed(self, result, call, *details) -> None:
        """Raise the typed error for a failed hot-path call; ``call`` is a format string for ``details``, so the
        message is built only when something failed (formatting it on every launch costs a microsecond)."""
        self._check(result, call.format(*details))

    def kernel_name(self, function) -> str:
        return self._kernel_names.get(int(function), f"function {int(function):#x}")

    def _faulted(self, error: ProviderError, call: str) -> None:
        """A sticky error: name the kernel, give the context back and reset it, raise CudaDeviceFaultError."""
        recent = ", ".join(self.kernel_name(f) for f in self._recent) or "none"
        where = call if call.startswith("cuLaunchKernel") else (
            f"{call}, which reports a fault of a kernel enqueued before it (launched most recently, newest last: "
            f"{recent})")
        detail = getattr(self.driver, "last_error_message", None)  # the simulator says which kernel and where
        detail = f" [{detail()}]" if callable(detail) and detail() else ""
        message = (f"CUDAExecutionProvider: CUDA device {self.index} faulted in {where}: "
                   f"{str(error).rsplit(' failed with ', 1)[-1]}{detail}")
        with self._lock:
            first = not self.fault
            if first:
                self.fault, self.closed = message, True
        if first:
            self.staging.abandon()
            d = self.driver
            # The context is dead for every user of it; resetting it is the only way back, and what makes the
            # next CudaDevice.get() on this index work. Their results do not matter: nothing else can be done.
            d.cuDevicePrimaryCtxRelease(self.device)
            d.cuDevicePrimaryCtxReset(self.device)
            if getattr(_tls, "device", None) is self:
                _tls.device = None
        raise CudaDeviceFaultError(
            f"{message}. The device's context was reset: every tensor, device graph and session on it is lost; "
            f"create the session again (new sessions get a fresh context)"
        ) from None

    def _attribute(self, attribute) -> int:
        result = self.driver.cuDeviceGetAttribute(attribute, self.device)
        return int(self._check(result, f"cuDeviceGetAttribute({attribute})"))

    def _bind(self) -> None:
        """Make this device's primary context current on the calling thread (contexts are per thread)."""
        if self.closed:
            if self.fault:
                raise CudaDeviceFaultError(f"{self.fault}; the device was reset, create the session again")
            raise ProviderError(f"CUDAExecutionProvider: CUDA device {self.index} was already released")
        if getattr(_tls, "device", None) is not self:
            self._check(self.driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            _tls.device = self

    def _stream(self, stream):
        return self.compute if stream is None else stream

    def _lane(self, stream) -> Lane:
        """The lane whose compute stream ``stream`` is (the default lane for None or a stream of no lane)."""
        return self.default_lane if stream is None else self._lanes.get(id(stream), self.default_lane)

    # -- lanes --------------------------------------------------------------------------------------
    def open_lane(self) -> Lane:
        """A lane for one provider instance: an idle one a closed instance gave back, else two new streams."""
        with self._lock:
            if self._idle_lanes:
                return self._idle_lanes.pop()
        self._bind()
        d = self.driver
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        compute = self._check(d.cuStreamCreate(flags), "cuStreamCreate(lane compute)")
        transfer = self._check(d.cuStreamCreate(flags), "cuStreamCreate(lane transfer)")
        lane = Lane(self, compute, transfer)
        with self._lock:
            self._lanes[id(compute)] = lane
        return lane

    def close_lane(self, lane: Lane) -> None:
        """Give ``lane`` back once its work is done (its streams stay, for the next instance and for the frees
        of tensors that outlive the instance)."""
        if lane is self.default_lane or self.closed:
            return
        self.sync(lane)
        with self._lock:
            if lane not in self._idle_lanes:
                self._idle_lanes.append(lane)

    # -- memory -------------------------------------------------------------------------------------
    def allocate(self, size: int, alignment: int = _POOL_ALIGNMENT, stream=None, lane=None) -> tuple[int, int]:
        """``(address, base)`` of a new allocation of at least ``size`` bytes, stream-ordered on ``stream`` (compute
        by default); free it with ``free(base)``."""
        if size < 0:
            raise InvalidArgumentError(f"CUDAExecutionProvider: allocation size must be non-negative, got {size}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgumentError(f"CUDAExecutionProvider: alignment must be a power of two, got {alignment}")
        self._bind()
        if self._deferred_frees:
            self._free_deferred()
        lane = self._lane(stream) if lane is None else lane
        # Zero-byte allocations still need a unique non-null address; larger alignments than the
        # driver guarantees are met by over-allocating and rounding up.
        padding = alignment - 1 if alignment > _POOL_ALIGNMENT else 0
        nbytes = max(size, 1) + padding
        d = self.driver
        with lane.gate:
            result = d.cuMemAllocAsync(nbytes, self._stream(stream)) if self.pooled else d.cuMemAlloc(nbytes)
        if int(result[0]):
            self._failed(result, "cuMemAllocAsync({})" if self.pooled else "cuMemAlloc({})", nbytes)
        base = int(result[1])
        address = (base + alignment - 1) & ~(alignment - 1)
        if address + size > base + nbytes:
            self._release(base, nbytes)
            raise ProviderError(
                f"CUDAExecutionProvider: the driver returned {base:#x}, which is not {alignment}-byte aligned"
            )
        with self._lock:
            self._live[base] = nbytes
            bisect.insort(self._live_starts, base)
            if stream is not None and self.pooled and stream is not self.compute:
                self._homes[base] = stream
            self.allocations += 1
            self.bytes_in_use += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
            lane.allocated_since_join |= self.pooled
            if lane.capture_thread == threading.get_ident():
                lane.captured_bases.add(base)
        return address, base

    def free(self, base: int, stream=None) -> None:
        """Free the allocation whose ``base`` :meth:`allocate` returned, stream-ordered on ``stream`` (compute by
        default) and after its home stream's work and the lanes that touched it (see the module docstring). Memory
        a capture in progress reached is freed when that capture's graph is recorded (:meth:`settle_capture`)."""
        if self._holds_locks() and self.defer_inside(self.free, base, stream):  # (no bound method on the common path)
            return
        if self._deferred_frees:
            self._free_deferred()
        for attempt in range(3):
            with self._lock:
                nbytes = self._live.get(base)
                home = self._homes.get(base, self.compute)
                records = self._records_in(base, base + nbytes, home) if nbytes is not None else []
            if not records:
                break
            held = self.hold_for_capture(records, lambda: self.free(base, stream))
            if held:
                return
            if held is None or attempt == 2:  # another lane's graph recorded this memory: reset it first
                self._reset_records(records, base, "a free")
                break
            # That capture was recorded meanwhile: its graph is among the records now.
        with self._lock:
            nbytes = self._live.pop(base, None)
            if nbytes is None:
                raise InvalidArgumentError(
                    f"CUDAExecutionProvider: {base:#x} is not a live allocation on CUDA device {self.index}"
                )
            self._live_starts.pop(bisect.bisect_left(self._live_starts, base))
            home = self._homes.pop(base, self.compute)
            marks = self._marks.pop(base, None)
            self._drop_marks(base, base + nbytes)  # marks on addresses inside it (a capture arena's blocks) too
            self.frees += 1
            self.bytes_in_use -= nbytes
        if marks is not None:  # the lanes that read or wrote it are waited for like the home stream
            home = (home, marks.writer, *marks.readers)
        self._release(base, nbytes, self._stream(stream), home)

    def defer_inside(self, release, *args) -> bool:
        """Keep ``release(*args)`` for the next allocation, free or sync when the calling thread holds the device's
        locks (a finalizer that a collection ran inside them: see "Finalizers"); True when it was kept."""
        if self._holds_locks():
            self._deferred_frees.append((release, args))
            return True
        return False

    def _holds_locks(self) -> bool:
        """Whether the calling thread is inside the device's lock or its ordering lock."""
        return self._lock._is_owned() or self._order_lock._is_owned()  # noqa: SLF001

    def _free_deferred(self) -> None:
        """Issue the frees finalizers asked for while their thread held the device's locks (see "Finalizers")."""
        while self._deferred_frees and not self._holds_locks():
            try:
                release, args = self._deferred_frees.popleft()
            except IndexError:  # another thread took the last one
                return
            try:
                release(*args)
            except OnnxRuntimeError:  # as in the finalizer that asked for it: a failed free leaks, raises nowhere else
                pass

    def _release(self, base: int, nbytes: int, stream=None, home=None) -> None:
        self._bind()
        stream = self.compute if stream is None else stream
        lane = self._lane(stream)
        with lane.gate:  # a capturing thread holds it: other threads free after the capture
            if lane.capture_thread == threading.get_ident() and base not in lane.captured_bases:
                # A free on the capturing thread (a garbage-collected tensor of any session) would be recorded
                # into the graph and repeated at every replay, on memory the graph does not own: free it after.
                lane.frees_after_capture.append((base, nbytes, stream, home))
                return
            d = self.driver
            if lane.transfer_since_join:  # a copy_async may still read or write this memory
                self._join_transfer(lane)
            if self.pooled and home is not None:
                homes = home if isinstance(home, tuple) else (home,)
                seen = {int(stream)}
                for other in homes:
                    if other is not None and int(other) not in seen:
                        seen.add(int(other))
                        self._order_after(other, stream)
                        self.cross_stream_frees += 1
            result = d.cuMemFreeAsync(base, stream) if self.pooled else d.cuMemFree(base)
        if int(result[0]):
            call = "cuMemFreeAsync({:#x}, {} B)" if self.pooled else "cuMemFree({:#x}, {} B)"
            self._failed(result, call, base, nbytes)

    # -- copies -------------------------------------------------------------------------------------
    def upload(self, dst: int, src: np.ndarray, lane=None) -> None:
        """Copy the uint8 host array ``src`` to ``dst``, stream-ordered on compute; ``src`` may be reused at once
        (its bytes go through a pinned staging block, so the host does not wait for the device)."""
        if src.size:
            self._bind()
            lane = self.default_lane if lane is None else lane
            with lane.gate:
                if lane.capture_thread == threading.get_ident():
                    # A staged copy would be recorded reading a block the ring rewrites: synchronize instead,
                    # which fails the capture (host data cannot be captured by value).
                    self._check(self.driver.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.size, lane.compute),
                                f"cuMemcpyHtoDAsync({src.size} B)")
                    self._synchronize(lane.compute, "compute")
                    return
                self.staging.upload(dst, src, lane.compute)
                lane.allocated_since_join = True  # a transfer reading dst must wait for compute

    def download(self, dst: np.ndarray, src: int, lane=None) -> None:
        """Copy ``dst.size`` bytes at ``src`` into the writable uint8 host array ``dst``, after all compute."""
        if dst.size:
            self._bind()
            lane = self.default_lane if lane is None else lane
            with lane.gate:
                if lane.capture_thread == threading.get_ident():
                    self._check(self.driver.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.size, lane.compute),
                                f"cuMemcpyDtoHAsync({dst.size} B)")
                    self._synchronize(lane.compute, "compute")
                    return
                self.staging.download(dst, src, lane.compute)

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None, lane=None) -> None:
        """Stream-ordered device-to-device copy (on the compute stream unless ``stream`` is given)."""
        if nbytes:
            self._bind()
            with (self._lane(stream) if lane is None else lane).gate:
                result = self.driver.cuMemcpyDtoDAsync(dst, src, nbytes, self._stream(stream))
            if int(result[0]):
                self._failed(result, "cuMemcpyDtoDAsync({} B)", nbytes)

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  stream=None, lane=None) -> None:
        """Stream-ordered pitched copy of ``height`` rows of ``width`` bytes between device addresses: one
        cuMemcpy2DAsync (on the compute stream unless ``stream`` is given)."""
        if not width or not height:
            return
        self._bind()
        d = self.driver
        copy = d.CUDA_MEMCPY2D()
        copy.srcMemoryType = copy.dstMemoryType = d.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice, copy.srcPitch = d.CUdeviceptr(src), src_pitch
        copy.dstDevice, copy.dstPitch = d.CUdeviceptr(dst), dst_pitch
        copy.WidthInBytes, copy.Height = width, height
        with (self._lane(stream) if lane is None else lane).gate:
            result = d.cuMemcpy2DAsync(copy, self._stream(stream))
        if int(result[0]):
            self._failed(result, "cuMemcpy2DAsync({} rows of {} B)", height, width)

    def copy_async(self, dst: int | np.ndarray, src: int | np.ndarray, nbytes: int, lane=None) -> Fence:
        """Enqueue a copy on the lane's transfer stream and return its fence.

        ``dst``/``src`` are device addresses or uint8 host arrays. A host source goes through pinned staging
        blocks, so it may be reused at once and the copy is really asynchronous. A host destination does too, a
        block per chunk: it holds the bytes after the next :meth:`sync` (the host-visible point) and must stay
        alive until then; past a whole ring of blocks the host waits for the earliest chunks. A zero-byte copy
        needs no event and returns the signalled fence.
        """
        if not nbytes:
            return SIGNALLED
        self._bind()
        d = self.driver
        lane = self.default_lane if lane is None else lane
        transfer = lane.transfer
        with lane.gate:
            if lane.allocated_since_join:
                self._transfer_waits_for_compute(lane)
            if isinstance(src, np.ndarray):
                self.staging.upload(dst, src[:nbytes], transfer)
            elif isinstance(dst, np.ndarray):
                self.staging.download_async(dst[:nbytes], src, transfer)
            else:
                self._check(d.cuMemcpyDtoDAsync(dst, src, nbytes, transfer), f"cuMemcpyDtoDAsync({nbytes} B, transfer "
                            f"stream)")
            lane.transfer_since_join = True
            return self._record(transfer, "transfer", lane)

    def fill(self, dst: int, nbytes: int, value: int = 0, stream=None, lane=None) -> None:
        """Set ``nbytes`` bytes at ``dst`` to the byte ``value``, stream-ordered (fill.cu kernels)."""
        if not nbytes:
            return
        module = self.load("fill.cu")
        value &= 0xFF
        if dst % 4 == 0 and nbytes % 4 == 0:
            function, count, word = self.function(module, "fill_u32"), nbytes // 4, value * 0x01010101
        else:
            function, count, word = self.function(module, "fill_u8"), nbytes, value
        grid = min(-(-count // _FILL_BLOCK), _FILL_MAX_GRID)
        self.launch(function, grid, _FILL_BLOCK,
                    [(dst, ctypes.c_void_p), (word, ctypes.c_uint32), (count, ctypes.c_int64)], stream=stream,
                    lane=lane)

    # -- fences -------------------------------------------------------------------------------------
    def _idle_event(self):
        with self._lock:
            event = self._idle_events.pop() if self._idle_events else None
        if event is None:
            d = self.driver
            event = self._check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return event

    def _record(self, stream, which: str, lane=None) -> Fence:
        event = self._idle_event()
        lane = self.default_lane if lane is None else lane
        with lane.gate:
            self._check(self.driver.cuEventRecord(event, stream), f"cuEventRecord({which} stream)")
        with self._lock:
            fence_id = self._next_fence
            self._next_fence += 1
            self._events[fence_id] = (event, lane)
            crowded = len(self._events) > _MAX_LIVE_EVENTS
        if crowded:
            self._recycle_completed()
        return Fence(fence_id)

    def _event_of(self, fence: Fence):
        """The fence's pending event, or None when it is known to be complete."""
        if fence.is_signalled:
            return None
        with self._lock:
            entry = self._events.get(fence.id)
            issued = 0 < fence.id < self._next_fence
        if entry is None and not issued:
            raise InvalidArgumentError(
                f"CUDAExecutionProvider: fence {fence.id} was not issued by CUDA device {self.index}; pass the "
                f"fence that this provider's copy_async or record_compute_fence returned"
            )
        return None if entry is None else entry[0]  # None: issued and since recycled, once it completed

    def wait_fence(self, fence: Fence, lane=None) -> None:
        """Make the lane's compute stream wait for ``fence`` (no host blocking)."""
        event = self._event_of(fence)
        if event is not None:
            self._bind()
            lane = self.default_lane if lane is None else lane
            with lane.gate:
                self._check(self.driver.cuStreamWaitEvent(lane.compute, event, 0), "cuStreamWaitEvent(compute stream)")

    def copy_wait_fence(self, fence: Fence, lane=None) -> None:
        """Make the lane's transfer stream wait for ``fence`` (write-after-read on a reused staging buffer)."""
        event = self._event_of(fence)
        if event is not None:
            self._bind()
            lane = self.default_lane if lane is None else lane
            with lane.gate:
                self._check(self.driver.cuStreamWaitEvent(lane.transfer, event, 0),
                            "cuStreamWaitEvent(transfer stream)")

    def record_compute_fence(self, lane=None) -> Fence:
        self._bind()
        lane = self.default_lane if lane is None else lane
        return self._record(lane.compute, "compute", lane)

    def _order_after(self, home, stream) -> None:
        """Make ``stream`` wait for what ``home`` has queued so far (lanes.py: a capturing lane stands for the
        work before its capture; a capturing ``stream`` does not wait)."""
        d = self.driver
        source, target = self._lanes.get(id(home)), self._lanes.get(id(stream))
        if target is not None and target.capture_thread is not None:
            return
        event = self._idle_event()
        try:
            with self._order_lock:
                if source is not None and source.capture_thread is not None:
                    recorded = source.precapture
                else:
                    self._check(d.cuEventRecord(event, home), "cuEventRecord(another lane's stream)")
                    recorded = event
                self._check(d.cuStreamWaitEvent(stream, recorded, 0), "cuStreamWaitEvent(ordered after a lane)")
        finally:
            # Reusable at once: a recorded event's later re-record does not disturb the wait already enqueued.
            with self._lock:
                self._idle_events.append(event)
                self.ordered_waits += 1

    def _transfer_waits_for_compute(self, lane) -> None:
        fence = self._record(lane.compute, "compute", lane)
        self.copy_wait_fence(fence, lane)
        lane.allocated_since_join = False

    def _join_transfer(self, lane) -> None:
        self.wait_fence(self._record(lane.transfer, "transfer", lane), lane)
        lane.transfer_since_join = False

    def _recycle_completed(self) -> None:
        d = self.driver
        not_ready = int(d.CUresult.CUDA_ERROR_NOT_READY)
        with self._lock:
            pending = list(self._events.items())
        recycled = 0
        for fence_id, (event, lane) in pending:
            if lane.capture_thread is not None:
                continue  # querying an event of a capturing stream's lane is left to its own sync
            (err,) = d.cuEventQuery(event)
            if int(err) == not_ready:
                continue
            self._check((err,), "cuEventQuery")
            with self._lock:
                if self._events.pop(fence_id, None) is not None:
                    self._idle_events.append(event)
                    recycled += 1
        if not recycled:
            # The host is over a thousand fences ahead of the device; waiting for the lane that holds the most of
            # them bounds the event count and keeps every later record from polling the whole table again.
            with self._lock:
                held = collections.Counter(id(owner) for _event, owner in self._events.values()
                                           if owner.capture_thread is None)
                lanes = {id(owner): owner for _event, owner in self._events.values()}
            if held:
                self.sync(lanes[held.most_common(1)[0][0]])

    def sync(self, lane=None) -> None:
        """Block until the lane's streams are idle (every lane's when None, but a lane that is capturing only up
        to its capture); its fences are then complete, and its staged downloads (every one when None) have reached
        their host arrays. A lane's transfer stream is waited for only when work was queued there since it was
        last joined to compute."""
        self._bind()
        if self._deferred_frees:
            self._free_deferred()
        with self._lock:
            lanes = [lane] if lane is not None else [*{id(x): x for x in self._lanes.values()}.values()]
        me = threading.get_ident()
        for each in lanes:
            capturing = each.capture_thread
            if capturing is not None and capturing != me:  # another thread's capture: what was queued before it
                self._check(self.driver.cuEventSynchronize(each.precapture), "cuEventSynchronize(before capture)")
                continue
            with each.gate:
                if lane is None or each.transfer_since_join:
                    self._synchronize(each.transfer, "transfer")
                self._synchronize(each.compute, "compute")
                with self._lock:
                    done = [k for k, (_event, owner) in self._events.items() if owner is each]
                    self._idle_events.extend(self._events.pop(k)[0] for k in done)
                    each.allocated_since_join = each.transfer_since_join = False
                self.staging.completed((each.compute, each.transfer))
        self.staging.deliver(None if lane is None else (lane.compute, lane.transfer))

    def sync_session(self, lane) -> None:
        """A session's sync (the provider's ``sync`` hook): its own lane, after the lanes that wrote memory homed
        on it since it last waited for them (access.py), and no other lane."""
        self._bind()
        for writer in self.foreign_writers(lane):
            self._order_after(writer, lane.compute)
        self.sync(lane)

    def _host_wait(self, streams) -> None:
        """Block until what ``streams`` queued so far ran (for another thread's capturing lane: what it queued
        before the capture), through one event each."""
        d = self.driver
        for stream in streams:
            event = self._idle_event()
            try:
                with self._order_lock:
                    source = self._lanes.get(id(stream))
                    if source is not None and source.capture_thread is not None:
                        recorded = source.precapture
                    else:
                        self._check(d.cuEventRecord(event, stream), "cuEventRecord(a lane that used the memory)")
                        recorded = event
                self._check(d.cuEventSynchronize(recorded), "cuEventSynchronize(a lane that used the memory)")
            finally:
                with self._lock:
                    self._idle_events.append(event)

    def _synchronize(self, stream, which: str) -> None:
        self._check(self.driver.cuStreamSynchronize(stream), f"cuStreamSynchronize({which} stream)")

    # -- captures -----------------------------------------------------------------------------------
    def begin_capture(self, lane=None) -> None:
        """Take the lane's gate for a capture on this thread (see "Lanes"); :meth:`end_capture` gives it back.
        The event recorded first stands for the lane's earlier work while it captures (lanes.py)."""
        lane = self.default_lane if lane is None else lane
        lane.gate.acquire()
        try:
            self.settle_capture(lane)  # an earlier capture whose graph was never recorded frees what it held back
            if lane.precapture is None:
                lane.precapture = self._idle_event()
            with self._order_lock:
                self._check(self.driver.cuEventRecord(lane.precapture, lane.compute), "cuEventRecord(before capture)")
                lane.capture_thread = threading.get_ident()
                lane.capture_open = True
        except BaseException:
            lane.gate.release()
            raise

    def end_capture(self, lane=None) -> None:
        lane = self.default_lane if lane is None else lane
        if lane.capture_thread == threading.get_ident():  # only the capturing thread holds the gate
            with self._order_lock:
                lane.capture_thread = None
            lane.captured_bases.clear()
            frees, lane.frees_after_capture = lane.frees_after_capture, []
            try:
                for base, nbytes, stream, home in frees:
                    self._release(base, nbytes, stream, home)
            finally:
                lane.gate.release()

    def settle_capture(self, lane=None) -> None:
        """After the lane's capture ended and its graph was recorded (or discarded): release the memory it reached
        that a thread released meanwhile (frees, ends of borrows, reserved releases; access.hold_for_capture), each
        once, resetting the graphs that recorded it (graphs.py calls this). Nothing while the capture is in
        progress."""
        lane = self.default_lane if lane is None else lane
        with self._order_lock:
            if lane.capture_thread is not None or not lane.capture_open:
                return
            lane.capture_open = False
            releases, lane.releases_after_record = lane.releases_after_record, []
        failure = None
        for release in releases:
            try:
                release()
            except OnnxRuntimeError as error:  # the others are still released; the first failure is reported
                failure = failure or error
        if failure is not None:
            raise failure

    def capturing_here(self) -> bool:
        """Whether a device graph capture of the default lane is recording on the calling thread."""
        return self.default_lane.capture_thread == threading.get_ident()

    def capture_gate(self):
        """The default lane's gate, for a driver call on its compute stream outside this class (a graph launch)."""
        return self.default_lane.gate

    # -- kernels ------------------------------------------------------------------------------------
    def load(self, source_file: str | Path, options=()) -> KernelModule:
        """The module compiled from ``kernels/<source_file>`` for this device (cached per file and options)."""
        key = (str(source_file), tuple(options))
        module = self._modules.get(key)
        if module is None:
            name = Path(source_file).name
            image = nvrtc.compile(nvrtc.kernel_source(source_file), name, options, self.arch)
            self._bind()
            handle = self._check(self.driver.cuModuleLoadData(image), f"cuModuleLoadData({name})")
            module = self._modules.setdefault(key, KernelModule(handle, name))
            if module.handle is not handle:  # another thread loaded it first
                self._check(self.driver.cuModuleUnload(handle), f"cuModuleUnload({name})")
        return module

    def function(self, module: KernelModule, name: str):
        """The ``extern "C"`` kernel ``name`` in ``module`` (cached)."""
        function = module.functions.get(name)
        if function is None:
            self._bind()
            function = self._check(self.driver.cuModuleGetFunction(module.handle, name.encode()),
                                   f"cuModuleGetFunction({module.name}:{name})")
            module.functions[name] = function
            self._kernel_names[int(function)] = f"{module.name}:{name}"
        return function

    def launch(self, function, grid, block, args, shared_bytes: int = 0, stream=None, lane=None) -> None:
        """Launch ``function`` over ``grid`` x ``block`` (ints or up-to-3 tuples) on ``stream`` (compute).

        ``args`` are ``(value, ctypes type)`` pairs or ctypes scalars, pointers as ``(int address,
        ctypes.c_void_p)``; they become cuda-python's ``((values...), (types...))`` kernel parameters.
        """
        try:
            values, types = zip(*args) if args else ((), ())  # pairs: split in C, not in a Python loop
        except TypeError:  # a ctypes scalar among them
            values = tuple(a.value if isinstance(a, ctypes._SimpleCData) else a[0] for a in args)
            types = tuple(type(a) if isinstance(a, ctypes._SimpleCData) else a[1] for a in args)
        self.launch_split(function, grid, block, values, types, shared_bytes, stream, lane)

    def launch_split(self, function, grid, block, values: tuple, types: tuple, shared_bytes: int = 0,
                     stream=None, lane=None) -> None:
        """:meth:`launch` with the argument values and their ctypes types already apart (kernels that keep the
        types of a launch site and only change its values)."""
        gx, gy, gz = (grid, 1, 1) if type(grid) is int and grid > 0 else _dims(grid, "grid")
        bx, by, bz = (block, 1, 1) if type(block) is int and block > 0 else _dims(block, "block")
        self._bind()
        self._recent.append(function)
        with (self._lane(stream) if lane is None else lane).gate:
            result = self.driver.cuLaunchKernel(function, gx, gy, gz, bx, by, bz, shared_bytes,
                                                self._stream(stream), (values, types) if values else 0, 0)
        if int(result[0]):
            self._failed(result, "cuLaunchKernel(kernel {}, grid=({},{},{}), block=({},{},{}))",
                         self.kernel_name(function), gx, gy, gz, bx, by, bz)

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Release streams, events, modules and the primary context; outstanding memory goes with it."""
        if self.closed:
            return
        self.sync()
        self.staging.close()
        d = self.driver
        lanes = [*{id(lane): lane for lane in self._lanes.values()}.values()]
        precaptures = [lane.precapture for lane in lanes if lane.precapture is not None]
        for event in [*self._idle_events, *(event for event, _lane in self._events.values()), *precaptures]:
            self._check(d.cuEventDestroy(event), "cuEventDestroy")
        self._idle_events.clear()
        self._events.clear()
        for module in self._modules.values():
            self._check(d.cuModuleUnload(module.handle), f"cuModuleUnload({module.name})")
        self._modules.clear()
        for lane in lanes:
            lane.precapture = None
            self._check(d.cuStreamDestroy(lane.transfer), "cuStreamDestroy(transfer)")
            self._check(d.cuStreamDestroy(lane.compute), "cuStreamDestroy(compute)")
        self._lanes = {id(self.compute): self.default_lane}
        self._idle_lanes.clear()
        self._clear_access()
        self._live_starts.clear()
        self._check(d.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")
        self.closed = True
        self._live.clear()
        if getattr(_tls, "device", None) is self:
            _tls.device = None

    @classmethod
    def close_all(cls) -> None:
        with cls._instances_lock:
            devices, cls._instances = list(cls._instances.values()), {}
        for device in devices:
            device.close()


def _dims(value, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(int(v) for v in value)
    if not 1 <= len(dims) <= 3 or any(v < 1 for v in dims):
        raise InvalidArgumentError(f"CUDAExecutionProvider: {what} must be 1 to 3 positive sizes, got {value!r}")
    return (dims + (1, 1))[:3]


def _release_at_exit() -> None:
    try:
        CudaDevice.close_all()
    except ProviderError:
        # The process is exiting and the driver may already be tearing down; the OS reclaims the
        # context either way, so a failed release must not turn a clean exit into a traceback.
        pass


atexit.register(_release_at_exit)
