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

Threads. Every session on a device shares its compute stream, which keeps the order of everything they
enqueue (a tensor one session leaves on the device is safe for another to read). A device graph capture
records the *stream*, whichever thread enqueues on it, so while one thread captures (``begin_capture`` to
``end_capture``, called by graphs.py) every other thread's device call waits at the device's gate instead
of landing inside the graph (on a GPU) or invalidating the capture (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
from a synchronization). Outside captures the gate is held only for the duration of one driver call.
Runs of one session are serialized by its executor (session/executor.py).

Faults. An exception in device code (illegal address, assert, trap) leaves a CUDA context unusable: every
later call fails. The first call that reports it raises :class:`CudaDeviceFaultError` naming the kernel
(the one launching, or the kernels launched most recently when a synchronization reports it), marks this
device closed and resets the primary context, so the next session on the index gets a fresh, working one.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx_runtime.contract.buffers import SIGNALLED, Fence
from onnx_runtime.errors import InvalidArgumentError, ProviderError

from . import driver as driver_access
from . import nvrtc
from .driver import STICKY_ERRORS, CudaDeviceFaultError
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


class CudaDevice:
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
        self._lock = threading.Lock()
        self._gate = threading.RLock()  # see "Threads" in the module docstring
        self._capture_thread: int | None = None
        self._captured_bases: set[int] = set()  # allocated during the capture: the graph's own memory
        self._frees_after_capture: list[tuple] = []  # (base, nbytes, stream, home)
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
        self._homes: dict[int, object] = {}  # address -> the stream a pooled allocation was made on, if not compute
        self.cross_stream_frees = 0  # frees ordered after another stream by an event wait
        self._next_fence = 1  # fence ids count up from 1; 0 is the signalled fence
        self._events: dict[int, object] = {}  # fence id -> CUevent not yet known to be complete
        self._idle_events: list[object] = []
        # Pool memory is ordered on the compute stream: a transfer touching a buffer allocated since
        # the last join must first wait for compute, and a free must wait for transfers still in flight.
        self._allocated_since_join = False
        self._transfer_since_join = False
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

    # -- memory -------------------------------------------------------------------------------------
    def allocate(self, size: int, alignment: int = _POOL_ALIGNMENT, stream=None) -> tuple[int, int]:
        """``(address, base)`` of a new allocation of at least ``size`` bytes, stream-ordered on ``stream`` (compute
        by default); free it with ``free(base)``."""
        if size < 0:
            raise InvalidArgumentError(f"CUDAExecutionProvider: allocation size must be non-negative, got {size}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgumentError(f"CUDAExecutionProvider: alignment must be a power of two, got {alignment}")
        self._bind()
        # Zero-byte allocations still need a unique non-null address; larger alignments than the
        # driver guarantees are met by over-allocating and rounding up.
        padding = alignment - 1 if alignment > _POOL_ALIGNMENT else 0
        nbytes = max(size, 1) + padding
        d = self.driver
        with self._gate:
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
            if stream is not None and self.pooled and stream is not self.compute:
                self._homes[base] = stream
            self.allocations += 1
            self.bytes_in_use += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
            self._allocated_since_join |= self.pooled
            if self._capture_thread == threading.get_ident():
                self._captured_bases.add(base)
        return address, base

    def free(self, base: int, stream=None) -> None:
        """Free the allocation whose ``base`` :meth:`allocate` returned, stream-ordered on ``stream`` (compute by
        default) and after its home stream's work (see the module docstring)."""
        with self._lock:
            nbytes = self._live.pop(base, None)
            if nbytes is None:
                raise InvalidArgumentError(
                    f"CUDAExecutionProvider: {base:#x} is not a live allocation on CUDA device {self.index}"
                )
            home = self._homes.pop(base, self.compute)
            self.frees += 1
            self.bytes_in_use -= nbytes
        self._release(base, nbytes, self._stream(stream), home)

    def _release(self, base: int, nbytes: int, stream=None, home=None) -> None:
        self._bind()
        stream = self.compute if stream is None else stream
        if self._capture_thread == threading.get_ident() and base not in self._captured_bases:
            # A free on the capturing thread (a garbage-collected tensor of any session) would be recorded into
            # the graph and repeated at every replay, on memory the graph does not own: free it after the capture.
            self._frees_after_capture.append((base, nbytes, stream, home))
            return
        d = self.driver
        with self._gate:
            if self._transfer_since_join:  # a copy_async may still read or write this memory
                self._join_transfer()
            if self.pooled and home is not None and int(home) != int(stream):
                self._order_after(home, stream)
            result = d.cuMemFreeAsync(base, stream) if self.pooled else d.cuMemFree(base)
        if int(result[0]):
            call = "cuMemFreeAsync({:#x}, {} B)" if self.pooled else "cuMemFree({:#x}, {} B)"
            self._failed(result, call, base, nbytes)

    # -- copies -------------------------------------------------------------------------------------
    def upload(self, dst: int, src: np.ndarray) -> None:
        """Copy the uint8 host array ``src`` to ``dst``, stream-ordered on compute; ``src`` may be reused at once
        (its bytes go through a pinned staging block, so the host does not wait for the device)."""
        if src.size:
            self._bind()
            with self._gate:
                if self._capture_thread == threading.get_ident():
                    # A staged copy would be recorded reading a block the ring rewrites: synchronize instead,
                    # which fails the capture (host data cannot be captured by value).
                    self._check(self.driver.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.size, self.compute),
                                f"cuMemcpyHtoDAsync({src.size} B)")
                    self._synchronize(self.compute, "compute")
                    return
                self.staging.upload(dst, src, self.compute)
                self._allocated_since_join = True  # a transfer reading dst must wait for compute

    def download(self, dst: np.ndarray, src: int) -> None:
        """Copy ``dst.size`` bytes at ``src`` into the writable uint8 host array ``dst``, after all compute."""
        if dst.size:
            self._bind()
            with self._gate:
                if self._capture_thread == threading.get_ident():
                    self._check(self.driver.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.size, self.compute),
                                f"cuMemcpyDtoHAsync({dst.size} B)")
                    self._synchronize(self.compute, "compute")
                    return
                self.staging.download(dst, src, self.compute)

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        """Stream-ordered device-to-device copy (on the compute stream unless ``stream`` is given)."""
        if nbytes:
            self._bind()
            with self._gate:
                result = self.driver.cuMemcpyDtoDAsync(dst, src, nbytes, self._stream(stream))
            if int(result[0]):
                self._failed(result, "cuMemcpyDtoDAsync({} B)", nbytes)

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                  stream=None) -> None:
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
        with self._gate:
            result = d.cuMemcpy2DAsync(copy, self._stream(stream))
        if int(result[0]):
            self._failed(result, "cuMemcpy2DAsync({} rows of {} B)", height, width)

    def copy_async(self, dst: int | np.ndarray, src: int | np.ndarray, nbytes: int) -> Fence:
        """Enqueue a copy on the transfer stream and return its fence.

        ``dst``/``src`` are device addresses or uint8 host arrays. A host source goes through a pinned staging
        block, so it may be reused at once and the copy is really asynchronous. A host destination of up to a
        staging block also does: it holds the bytes after the next :meth:`sync` (the host-visible point);
        a larger one is written by the driver (pageable memory: synchronously on a GPU) and must stay alive
        until then. A zero-byte copy needs no event and returns the signalled fence.
        """
        if not nbytes:
            return SIGNALLED
        self._bind()
        d = self.driver
        with self._gate:
            if self._allocated_since_join:
                self._transfer_waits_for_compute()
            if isinstance(src, np.ndarray):
                self.staging.upload(dst, src[:nbytes], self.transfer)
            elif isinstance(dst, np.ndarray) and nbytes <= self.staging.block_bytes:
                self.staging.download_async(dst[:nbytes], src, self.transfer)
            else:
                if isinstance(dst, np.ndarray):
                    result, call = d.cuMemcpyDtoHAsync(dst.ctypes.data, src, nbytes, self.transfer), "cuMemcpyDtoHAsync"
                else:
                    result, call = d.cuMemcpyDtoDAsync(dst, src, nbytes, self.transfer), "cuMemcpyDtoDAsync"
                self._check(result, f"{call}({nbytes} B, transfer stream)")
            self._transfer_since_join = True
            return self._record(self.transfer, "transfer")

    def fill(self, dst: int, nbytes: int, value: int = 0, stream=None) -> None:
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
                    [(dst, ctypes.c_void_p), (word, ctypes.c_uint32), (count, ctypes.c_int64)], stream=stream)

    # -- fences -------------------------------------------------------------------------------------
    def _record(self, stream, which: str) -> Fence:
        d = self.driver
        with self._lock:
            event = self._idle_events.pop() if self._idle_events else None
        if event is None:
            event = self._check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        with self._gate:
            self._check(d.cuEventRecord(event, stream), f"cuEventRecord({which} stream)")
        with self._lock:
            fence_id = self._next_fence
            self._next_fence += 1
            self._events[fence_id] = event
            crowded = len(self._events) > _MAX_LIVE_EVENTS
        if crowded:
            self._recycle_completed()
        return Fence(fence_id)

    def _event_of(self, fence: Fence):
        """The fence's pending event, or None when it is known to be complete."""
        if fence.is_signalled:
            return None
        with self._lock:
            event = self._events.get(fence.id)
            issued = 0 < fence.id < self._next_fence
        if event is None and not issued:
            raise InvalidArgumentError(
                f"CUDAExecutionProvider: fence {fence.id} was not issued by CUDA device {self.index}; pass the "
                f"fence that this provider's copy_async or record_compute_fence returned"
            )
        return event  # None: issued and since recycled, which happens only once it completed

    def wait_fence(self, fence: Fence) -> None:
        """Make the compute stream wait for ``fence`` (no host blocking)."""
        event = self._event_of(fence)
        if event is not None:
            self._bind()
            with self._gate:
                self._check(self.driver.cuStreamWaitEvent(self.compute, event, 0), "cuStreamWaitEvent(compute stream)")

    def copy_wait_fence(self, fence: Fence) -> None:
        """Make the transfer stream wait for ``fence`` (write-after-read on a reused staging buffer)."""
        event = self._event_of(fence)
        if event is not None:
            self._bind()
            with self._gate:
                self._check(self.driver.cuStreamWaitEvent(self.transfer, event, 0),
                            "cuStreamWaitEvent(transfer stream)")

    def record_compute_fence(self) -> Fence:
        self._bind()
        return self._record(self.compute, "compute")

    def _order_after(self, home, stream) -> None:
        """Make ``stream`` wait for what ``home`` has queued so far (a free of memory allocated there)."""
        d = self.driver
        with self._lock:
            event = self._idle_events.pop() if self._idle_events else None
        if event is None:
            event = self._check(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        try:
            self._check(d.cuEventRecord(event, home), "cuEventRecord(home stream of a freed allocation)")
            self._check(d.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent(stream freeing an allocation)")
        finally:
            # Reusable at once: a recorded event's later re-record does not disturb the wait already enqueued.
            with self._lock:
                self._idle_events.append(event)
        self.cross_stream_frees += 1

    def _transfer_waits_for_compute(self) -> None:
        fence = self._record(self.compute, "compute")
        self.copy_wait_fence(fence)
        self._allocated_since_join = False

    def _join_transfer(self) -> None:
        self.wait_fence(self._record(self.transfer, "transfer"))
        self._transfer_since_join = False

    def _recycle_completed(self) -> None:
        d = self.driver
        not_ready = int(d.CUresult.CUDA_ERROR_NOT_READY)
        with self._lock:
            pending = list(self._events.items())
        recycled = 0
        for fence_id, event in pending:
            (err,) = d.cuEventQuery(event)
            if int(err) == not_ready:
                continue
            self._check((err,), "cuEventQuery")
            with self._lock:
                if self._events.pop(fence_id, None) is not None:
                    self._idle_events.append(event)
                    recycled += 1
        if not recycled:
            # The host is over a thousand fences ahead of the device; waiting bounds the event count
            # and keeps every later record from polling the whole table again.
            self.sync()

    def sync(self) -> None:
        """Block until both streams are idle; every fence issued so far is then complete, and every staged
        download of copy_async has reached its host array."""
        self._bind()
        with self._gate:
            self._synchronize(self.transfer, "transfer")
            self._synchronize(self.compute, "compute")
            with self._lock:
                self._idle_events.extend(self._events.values())
                self._events.clear()
                self._allocated_since_join = self._transfer_since_join = False
            self.staging.deliver()

    def _synchronize(self, stream, which: str) -> None:
        with self._gate:
            self._check(self.driver.cuStreamSynchronize(stream), f"cuStreamSynchronize({which} stream)")

    # -- captures -----------------------------------------------------------------------------------
    def begin_capture(self) -> None:
        """Take the gate for a capture on this thread (see "Threads"); :meth:`end_capture` gives it back."""
        self._gate.acquire()
        self._capture_thread = threading.get_ident()

    def end_capture(self) -> None:
        if self._capture_thread == threading.get_ident():  # only the capturing thread holds the gate
            self._capture_thread = None
            self._captured_bases.clear()
            frees, self._frees_after_capture = self._frees_after_capture, []
            try:
                for base, nbytes, stream, home in frees:
                    self._release(base, nbytes, stream, home)
            finally:
                self._gate.release()

    def capturing_here(self) -> bool:
        """Whether a device graph capture is recording on the calling thread."""
        return self._capture_thread == threading.get_ident()

    def capture_gate(self):
        """The gate, for a driver call on the compute stream outside this class (a graph launch)."""
        return self._gate

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

    def launch(self, function, grid, block, args, shared_bytes: int = 0, stream=None) -> None:
        """Launch ``function`` over ``grid`` x ``block`` (ints or up-to-3 tuples) on ``stream`` (compute).

        ``args`` are ``(value, ctypes type)`` pairs or ctypes scalars, pointers as ``(int address,
        ctypes.c_void_p)``; they become cuda-python's ``((values...), (types...))`` kernel parameters.
        """
        try:
            values, types = zip(*args) if args else ((), ())  # pairs: split in C, not in a Python loop
        except TypeError:  # a ctypes scalar among them
            values = tuple(a.value if isinstance(a, ctypes._SimpleCData) else a[0] for a in args)
            types = tuple(type(a) if isinstance(a, ctypes._SimpleCData) else a[1] for a in args)
        self.launch_split(function, grid, block, values, types, shared_bytes, stream)

    def launch_split(self, function, grid, block, values: tuple, types: tuple, shared_bytes: int = 0,
                     stream=None) -> None:
        """:meth:`launch` with the argument values and their ctypes types already apart (kernels that keep the
        types of a launch site and only change its values)."""
        gx, gy, gz = (grid, 1, 1) if type(grid) is int and grid > 0 else _dims(grid, "grid")
        bx, by, bz = (block, 1, 1) if type(block) is int and block > 0 else _dims(block, "block")
        self._bind()
        self._recent.append(function)
        with self._gate:
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
        for event in [*self._idle_events, *self._events.values()]:
            self._check(d.cuEventDestroy(event), "cuEventDestroy")
        self._idle_events.clear()
        self._events.clear()
        for module in self._modules.values():
            self._check(d.cuModuleUnload(module.handle), f"cuModuleUnload({module.name})")
        self._modules.clear()
        self._check(d.cuStreamDestroy(self.transfer), "cuStreamDestroy(transfer)")
        self._check(d.cuStreamDestroy(self.compute), "cuStreamDestroy(compute)")
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
