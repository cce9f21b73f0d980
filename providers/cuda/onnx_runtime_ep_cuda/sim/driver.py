"""A CPU simulator of the subset of ``cuda.bindings.driver`` the CUDA provider calls.

Same names, argument order and return convention as cuda-python: every call returns ``(CUresult, *values)``
(values are None when the call fails), handles are opaque objects with ``int()`` and ``getPtr()``, device
pointers are ``CUdeviceptr``. Kernels are CUDA C++ compiled for the host (see compiler.py and cuda_emu.h).

Semantics the provider can rely on being the same as on a GPU:
- cuInit first, then a current context on the calling thread for context-scoped calls (allocation, stream and
  event creation, module loads, synchronous copies, work on the NULL stream), else CUDA_ERROR_INVALID_CONTEXT;
- stream work runs immediately in issue order, so every stream and event is complete as soon as it is issued;
  with the *deferred* option (``configure(deferred=True)`` or ``ONNX_RUNTIME_CUDA_SIM_DEFERRED=1``) work queues on
  its stream instead and runs only at a synchronization point (cuStreamSynchronize, cuCtxSynchronize,
  cuEventSynchronize, a copy to pageable host memory, cuMemFree, ...) or when a stream waiting on an event needs
  it, so a missing synchronization or event wait shows as a wrong result, as on a GPU; an asynchronous copy from
  pageable host memory reads it at issue time (the driver stages it), one from page-locked memory
  (cuMemHostAlloc, cuMemHostRegister) when the copy runs;
- with *sticky errors* (``configure(sticky_errors=True)``, ``ONNX_RUNTIME_CUDA_SIM_STICKY_ERRORS=1``, and always
  for work that failed deferred) a kernel fault leaves the context unusable: every later call returns the same
  error until the primary context is reset (cuDevicePrimaryCtxReset) or released;
- ``configure(shuffle_blocks=SEED)`` (``ONNX_RUNTIME_CUDA_SIM_SHUFFLE_BLOCKS=SEED``) runs each launch's blocks in
  a seeded pseudo-random order, so a kernel that assumes block order fails here as it may on a GPU;
- stream capture records kernels, copies, memsets, allocations and frees into a graph instead of running them;
  kernel arguments are captured by value; calls that are illegal while capturing (synchronizing a capturing
  stream, synchronous copies or cuMemAlloc in global mode, using the legacy stream beside a capturing blocking
  stream, waiting on uncaptured events) invalidate the capture exactly as CUDA does; work forked onto another
  stream must be joined back before cuStreamEndCapture (else CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
- a graph's replay reads host buffers of captured copies at replay time, as CUDA graphs do.

Stricter than a GPU, so bugs show up here rather than as silent corruption there: copies must lie inside one
live allocation and host buffers must be large enough (and writable for device-to-host), kernel arguments
must match the kernel's parameter sizes and kinds, kernels that run off a buffer fault with
CUDA_ERROR_ILLEGAL_ADDRESS, and new device memory holds 0xFF bytes rather than zeros.

Simulator-only helpers: ``make_image`` (what ``nvrtc.compile`` returns here), ``live_allocations()``,
``live_host_allocations()``, ``last_error_message()`` (why the last failing call failed), ``configure()`` (the
options above) and ``reset()`` (drop all driver state; the options return to their environment defaults).
"""

from __future__ import annotations

import collections
import ctypes
import enum
import functools
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import compiler
from .compiler import make_image
from .memory import Allocation, DeviceMemory

__all__ = ["make_image", "live_allocations", "live_host_allocations", "last_error_message", "configure", "reset"]

MEMORY_ENV = "ONNX_RUNTIME_CUDA_SIM_MEMORY"  # simulated device memory in bytes (default 16 GiB)
DEFERRED_ENV = "ONNX_RUNTIME_CUDA_SIM_DEFERRED"
STICKY_ENV = "ONNX_RUNTIME_CUDA_SIM_STICKY_ERRORS"
SHUFFLE_ENV = "ONNX_RUNTIME_CUDA_SIM_SHUFFLE_BLOCKS"
DRIVER_VERSION = 13000
DEVICE_NAME = b"CUDA Simulator (CPU emulation of sm_90)"
DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what a launch may use before cuFuncSetAttribute raises the limit
MAX_DYNAMIC_SHARED = 232448  # sm_90's opt-in maximum


# ---- enums (values are CUDA's) --------------------------------------------------------------------------------


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_SOURCE = 300
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
    CUDA_ERROR_ASSERT = 710
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
    CUDA_ERROR_CAPTURED_EVENT = 907
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908
    CUDA_ERROR_UNKNOWN = 999


_ERROR_STRINGS = {
    CUresult.CUDA_SUCCESS: "no error",
    CUresult.CUDA_ERROR_INVALID_VALUE: "invalid argument",
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: "out of memory",
    CUresult.CUDA_ERROR_NOT_INITIALIZED: "initialization error",
    CUresult.CUDA_ERROR_DEINITIALIZED: "driver shutting down",
    CUresult.CUDA_ERROR_NO_DEVICE: "no CUDA-capable device is detected",
    CUresult.CUDA_ERROR_INVALID_DEVICE: "invalid device ordinal",
    CUresult.CUDA_ERROR_INVALID_IMAGE: "device kernel image is invalid",
    CUresult.CUDA_ERROR_INVALID_CONTEXT: "invalid device context",
    CUresult.CUDA_ERROR_INVALID_SOURCE: "device kernel image is invalid",
    CUresult.CUDA_ERROR_INVALID_HANDLE: "invalid resource handle",
    CUresult.CUDA_ERROR_ILLEGAL_STATE: "the operation cannot be performed in the present state",
    CUresult.CUDA_ERROR_NOT_FOUND: "named symbol not found",
    CUresult.CUDA_ERROR_NOT_READY: "device not ready",
    CUresult.CUDA_ERROR_ILLEGAL_ADDRESS: "an illegal memory access was encountered",
    CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: "too many resources requested for launch",
    CUresult.CUDA_ERROR_ASSERT: "device-side assert triggered",
    CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
    CUresult.CUDA_ERROR_LAUNCH_FAILED: "unspecified launch failure",
    CUresult.CUDA_ERROR_NOT_SUPPORTED: "operation not supported",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: "operation not permitted when stream is capturing",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: "operation failed due to a previous error during capture",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_MERGE: "operation would result in a merge of separate capture sequences",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: "capture was not initiated in this stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED: "capturing stream has unjoined work",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION: "dependency created on uncaptured work in another stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
        "operation would make the legacy stream depend on a capturing blocking stream",
    CUresult.CUDA_ERROR_CAPTURED_EVENT: "operation not permitted on an event last recorded in a capturing stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
        "attempt to terminate a thread-local capture sequence from another thread",
    CUresult.CUDA_ERROR_UNKNOWN: "unknown error",
}


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
    CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
    CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT = 14
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT = 17
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18
    CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19
    CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20
    CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31
    CU_DEVICE_ATTRIBUTE_ECC_ENABLED = 32
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
    CU_DEVICE_ATTRIBUTE_TCC_DRIVER = 35
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39
    CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78
    CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED = 79
    CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED = 80
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82
    CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83
    CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD = 84
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88
    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89
    CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR = 106
    CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
    CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115


# An H100 SXM's answers: kernels and launch heuristics see a plausible sm_90 device.
_ATTRIBUTES = {
    "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024, "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": DEFAULT_DYNAMIC_SHARED, "TOTAL_CONSTANT_MEMORY": 65536, "WARP_SIZE": 32,
    "MAX_PITCH": 2**31 - 1, "MAX_REGISTERS_PER_BLOCK": 65536, "CLOCK_RATE": 1980000, "TEXTURE_ALIGNMENT": 512,
    "MULTIPROCESSOR_COUNT": 132, "KERNEL_EXEC_TIMEOUT": 0, "INTEGRATED": 0, "CAN_MAP_HOST_MEMORY": 1,
    "COMPUTE_MODE": 0, "CONCURRENT_KERNELS": 1, "ECC_ENABLED": 1, "PCI_BUS_ID": 0, "PCI_DEVICE_ID": 0,
    "TCC_DRIVER": 0, "MEMORY_CLOCK_RATE": 2619000, "GLOBAL_MEMORY_BUS_WIDTH": 5120, "L2_CACHE_SIZE": 52428800,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048, "ASYNC_ENGINE_COUNT": 3, "UNIFIED_ADDRESSING": 1, "PCI_DOMAIN_ID": 0,
    "COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "STREAM_PRIORITIES_SUPPORTED": 1,
    "GLOBAL_L1_CACHE_SUPPORTED": 1, "LOCAL_L1_CACHE_SUPPORTED": 1, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MANAGED_MEMORY": 1, "MULTI_GPU_BOARD": 0,
    "PAGEABLE_MEMORY_ACCESS": 0, "CONCURRENT_MANAGED_ACCESS": 1, "COOPERATIVE_LAUNCH": 1,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": MAX_DYNAMIC_SHARED, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
    "MAX_BLOCKS_PER_MULTIPROCESSOR": 32, "MAX_PERSISTING_L2_CACHE_SIZE": 32505856,
    "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024, "MEMORY_POOLS_SUPPORTED": 1,
}


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4
    CU_FUNC_ATTRIBUTE_PTX_VERSION = 5
    CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


class CUstream_flags(enum.IntEnum):
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2
    CU_EVENT_INTERPROCESS = 4


class CUstreamCaptureMode(enum.IntEnum):
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CUstreamCaptureStatus(enum.IntEnum):
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2


class CUmemPool_attribute(enum.IntEnum):
    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8


class CUgraphInstantiate_flags(enum.IntEnum):
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2
    CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8


CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTALLOC_DEVICEMAP = 2
CU_MEMHOSTALLOC_WRITECOMBINED = 4
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTREGISTER_DEVICEMAP = 2

# Errors after which a GPU's context is unusable (an exception in a kernel): every later call returns them.
_STICKY = frozenset({CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, CUresult.CUDA_ERROR_ASSERT,
                     CUresult.CUDA_ERROR_LAUNCH_FAILED})

CU_STREAM_LEGACY = 1
CU_STREAM_PER_THREAD = 2
_DEFAULT_STREAMS = (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD)


# ---- handles -----------------------------------------------------------------------------------------------------


class _Handle:
    """An opaque driver handle: ``int()`` gives its value, ``getPtr()`` the address of the stored value."""

    __slots__ = ("_storage",)

    def __init__(self, init_value=0):
        self._storage = ctypes.c_uint64(0 if init_value is None else int(init_value))

    def __int__(self) -> int:
        return self._storage.value

    __index__ = __int__

    def getPtr(self) -> int:  # noqa: N802 - cuda-python's name
        return ctypes.addressof(self._storage)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and int(other) == int(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, int(self)))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} 0x{int(self):x}>"


class CUdevice(_Handle):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<CUdevice {int(self)}>"


class CUdeviceptr(_Handle):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<CUdeviceptr {int(self)}>"


class CUcontext(_Handle):
    __slots__ = ()


class CUstream(_Handle):
    __slots__ = ()


class CUevent(_Handle):
    __slots__ = ()


class CUmodule(_Handle):
    __slots__ = ()


class CUfunction(_Handle):
    __slots__ = ()


class CUgraph(_Handle):
    __slots__ = ()


class CUgraphExec(_Handle):
    __slots__ = ()


class CUmemoryPool(_Handle):
    __slots__ = ()


class cuuint64_t(_Handle):  # noqa: N801 - cuda-python's name for a boxed 64-bit value
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<cuuint64_t {int(self)}>"


# ---- driver state --------------------------------------------------------------------------------------------------


class _Fail(Exception):
    def __init__(self, code: CUresult, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(eq=False)
class _Capture:
    """One stream-capture sequence: the nodes recorded so far and which streams take part.

    Every participating stream carries a vector clock ({stream: ops of that stream it depends on}); events
    copy the clock of the stream they are recorded on and waits merge it, so at the end the origin stream's
    clock shows whether every forked stream's last operation was joined back.
    """

    origin: _Stream
    mode: CUstreamCaptureMode
    thread: int
    nodes: list = field(default_factory=list)
    clocks: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    allocations: list = field(default_factory=list)
    invalidated: str = ""  # why, once the capture is invalid

    def join(self, stream: _Stream, clock: dict) -> None:
        stream.capture = self
        self.counts.setdefault(stream.handle, 0)
        self.clocks[stream.handle] = dict(clock)

    def record(self, stream: _Stream, node: tuple) -> None:
        self.nodes.append(node)
        self.counts[stream.handle] += 1
        self.clocks[stream.handle][stream.handle] = self.counts[stream.handle]


@dataclass(eq=False)
class _Stream:
    handle: int
    flags: int = 0
    capture: _Capture | None = None
    queue: collections.deque = field(default_factory=collections.deque)  # deferred (seq, node), oldest first
    issued: int = 0  # sequence number of the last operation queued


@dataclass(eq=False)
class _Event:
    handle: int
    flags: int
    time: float | None = None  # perf_counter() when last recorded outside a capture
    capture: _Capture | None = None  # the capture it was last recorded in
    clock: dict = field(default_factory=dict)
    stream: _Stream | None = None  # deferred: complete once this stream ran operation `seq`
    seq: int = 0


@dataclass(eq=False)
class _Module:
    handle: int
    library: compiler.Library
    loaded: bool = True


@dataclass(eq=False)
class _Function:
    handle: int
    module: _Module
    name: str
    params: tuple
    max_threads: int
    max_dynamic_shared: int = DEFAULT_DYNAMIC_SHARED
    carveout: int = -1


@dataclass(eq=False)
class _Graph:
    handle: int
    nodes: list
    allocations: list  # graph-owned memory: allocated during the capture
    execs: int = 0


@dataclass(eq=False)
class _GraphExec:
    handle: int
    graph: _Graph
    nodes: list
    allocations: list
    auto_free: bool


class _State:
    def __init__(self):
        capacity = int(os.environ.get(MEMORY_ENV) or 16 * 2**30)
        self.initialized = False
        self.primary_refs = 0
        self.context_handle = 0
        self.memory = DeviceMemory(capacity)
        self.streams: dict[int, _Stream] = {}
        self.events: dict[int, _Event] = {}
        self.modules: dict[int, _Module] = {}
        self.functions: dict[int, _Function] = {}
        self.graphs: dict[int, _Graph] = {}
        self.execs: dict[int, _GraphExec] = {}
        self.captures: list[_Capture] = []
        self.legacy = _Stream(0)
        self.next_handle = 0x5100
        self.pool_handle = self.new_handle()
        self.pool_flags = {a: 1 for a in list(CUmemPool_attribute)[:3]}  # the reuse policies, all on
        self.pool_threshold = 0
        self.pool_used_high = 0
        self.current = threading.local()
        self.last_error = ""
        self.deferred = _env_flag(DEFERRED_ENV)
        self.sticky_errors = _env_flag(STICKY_ENV)
        self.shuffle_seed = int(os.environ.get(SHUFFLE_ENV) or 0)
        self.launches = 0
        self.sticky: tuple[CUresult, str] | None = None  # the error that made the context unusable
        self.host_allocations: dict[int, ctypes.Array] = {}  # cuMemHostAlloc: address -> its buffer
        self.pinned: dict[int, int] = {}  # page-locked host ranges (allocated or registered): start -> size
        self.registered: set[int] = set()

    def new_handle(self) -> int:
        self.next_handle += 0x10  # distinct values for every object, so a stream passed as an event is invalid
        return self.next_handle

    def require_context(self) -> None:
        if not self.primary_refs or getattr(self.current, "context", 0) != self.context_handle:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT,
                        "no current context on this thread (cuDevicePrimaryCtxRetain + cuCtxSetCurrent)")

    def destroy_context(self) -> None:
        """What releasing the last primary-context reference does on a GPU: every resource in it is gone."""
        self.memory.release_all()
        for table in (self.streams, self.events, self.modules, self.functions, self.graphs, self.execs):
            table.clear()
        self.captures.clear()
        self.legacy = _Stream(0)
        self.context_handle = 0
        self.host_allocations.clear()
        self.pinned.clear()
        self.registered.clear()
        self.sticky = None

    def is_pinned(self, address: int, nbytes: int) -> bool:
        return any(start <= address and address + nbytes <= start + size for start, size in self.pinned.items())


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


_state = _State()
_lock = threading.RLock()  # the driver is one big critical section; kernels run inside it
# Calls a GPU still answers after a sticky error: error names, device queries, and what resets the context.
_ANSWERED_WHEN_STICKY = frozenset({
    "cuGetErrorName", "cuGetErrorString", "cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuDeviceGet",
    "cuDeviceGetName", "cuDeviceGetAttribute", "cuDeviceTotalMem", "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxGetState", "cuCtxSetCurrent",
    "cuCtxGetCurrent",
})


def _api(outputs: int = 0, *, initialized: bool = True, context: bool = False):
    """Wraps an implementation into cuda-python's calling convention: (CUresult, *outputs)."""

    def wrap(impl):
        @functools.wraps(impl)
        def call(*args, **kwargs):
            with _lock:
                try:
                    if initialized and not _state.initialized:
                        raise _Fail(CUresult.CUDA_ERROR_NOT_INITIALIZED, "cuInit has not been called")
                    if context:
                        _state.require_context()
                    if _state.sticky is not None and impl.__name__ not in _ANSWERED_WHEN_STICKY:
                        code, why = _state.sticky
                        raise _Fail(code, f"the context is unusable after an earlier error ({why}); reset it")
                    values = impl(*args, **kwargs)
                except _Fail as failure:
                    _state.last_error = f"{impl.__name__}: {failure.message}"
                    return (failure.code, *([None] * outputs))
            if outputs == 0:
                return (CUresult.CUDA_SUCCESS,)
            if outputs == 1:
                return (CUresult.CUDA_SUCCESS, values)
            return (CUresult.CUDA_SUCCESS, *values)

        return call

    return wrap


# ---- simulator-only helpers ------------------------------------------------------------------------------------


def live_allocations() -> dict[int, int]:
    """``{device address: size}`` of every allocation not yet freed (graph-internal memory excluded)."""
    with _lock:
        return _state.memory.live()


def last_error_message() -> str:
    """Why the most recent failing driver call failed, in words (compiler output, kernel faults, ...)."""
    with _lock:
        return _state.last_error


def live_host_allocations() -> dict[int, int]:
    """``{host address: size}`` of every cuMemHostAlloc allocation not yet freed with cuMemFreeHost."""
    with _lock:
        return {address: _state.pinned[address] for address in _state.host_allocations}


def configure(deferred: bool | None = None, sticky_errors: bool | None = None,
              shuffle_blocks: int | None = None) -> dict:
    """Switch the options of the module docstring (None leaves one as it is); returns the previous values,
    which ``configure(**previous)`` restores. Turning deferred execution off first runs what is queued."""
    with _lock:
        previous = {"deferred": _state.deferred, "sticky_errors": _state.sticky_errors,
                    "shuffle_blocks": _state.shuffle_seed}
        if deferred is not None:
            if not deferred:
                _drain_all()
            _state.deferred = bool(deferred)
        if sticky_errors is not None:
            _state.sticky_errors = bool(sticky_errors)
        if shuffle_blocks is not None:
            _state.shuffle_seed = int(shuffle_blocks)
        return previous


def reset() -> None:
    """Frees all simulated device memory and forgets every handle, as if the process had just started."""
    global _state
    with _lock:
        _state.memory.release_all()
        _state = _State()


# ---- argument helpers ------------------------------------------------------------------------------------------


def _value(handle) -> int:
    """The integer behind a handle argument; None is 0, as in cuda-python."""
    if handle is None:
        return 0
    try:
        return int(handle)
    except (TypeError, ValueError):
        raise TypeError(f"expected a driver handle or int, got {type(handle).__name__}") from None


def _lookup(table: dict, handle, what: str, code=CUresult.CUDA_ERROR_INVALID_HANDLE):
    item = table.get(_value(handle))
    if item is None:
        raise _Fail(code, f"{_value(handle):#x} is not a live {what}")
    return item


def _stream(handle) -> _Stream:
    value = _value(handle)
    if value in _DEFAULT_STREAMS:
        _state.require_context()  # the NULL stream means the current context's stream
        return _state.legacy
    return _lookup(_state.streams, value, "stream")


def _event(handle) -> _Event:
    return _lookup(_state.events, handle, "event")


def _host_buffer(obj, nbytes: int, writable: bool) -> int:
    """The address behind a host argument: an int, or any contiguous buffer-protocol object (numpy arrays,
    bytes, bytearray, memoryview, ctypes arrays), as cuda-python accepts. Buffers must hold ``nbytes``."""
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        if int(obj) == 0:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "host pointer is NULL")
        return int(obj)
    if obj is None:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "host pointer is NULL")
    if isinstance(obj, np.ndarray):  # also dtypes memoryview cannot describe (ml_dtypes' bfloat16)
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            raise BufferError("host buffer is not contiguous")
        size, readonly, address = obj.nbytes, not obj.flags.writeable, obj.ctypes.data
    else:
        size, readonly, address = _buffer_address(obj)
    if size < nbytes:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"host buffer holds {size} bytes, the copy {nbytes}")
    if writable and readonly:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "destination host buffer is read-only")
    return address


def _buffer_address(obj) -> tuple[int, bool, int]:
    """(size, read-only, address) of a buffer-protocol object."""
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"Provided argument is of type {type(obj)} but expected Type {type(None)}, {int} "
                        f"or object with Buffer Protocol") from None
    if not view.contiguous:
        raise BufferError("host buffer is not contiguous")
    try:
        address = np.asarray(view).__array_interface__["data"][0]
    except (TypeError, ValueError):  # a format numpy cannot parse: a C-contiguous byte view has the same start
        address = np.frombuffer(view.cast("B"), np.uint8).__array_interface__["data"][0]
    return view.nbytes, view.readonly, address


def _device_range(address, nbytes: int, what: str) -> int:
    address = _value(address)
    if _state.memory.containing(address, nbytes) is None:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"{what} range [{address:#x}, +{nbytes}) is not inside one live device allocation")
    return address


# ---- capture bookkeeping --------------------------------------------------------------------------------------


def _invalidate(capture: _Capture, why: str) -> None:
    if not capture.invalidated:
        capture.invalidated = why


def _unsafe_while_capturing(call: str) -> None:
    """Synchronous calls and cuMemAlloc/cuMemFree are illegal while a global (or this thread's thread-local)
    capture is active: CUDA fails them and invalidates the capture."""
    for capture in _state.captures:
        mode = capture.mode
        if mode == CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL or (
            mode == CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL and capture.thread == threading.get_ident()
        ):
            _invalidate(capture, f"{call} was called during the capture")
            raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, f"{call} is not permitted while capturing")


def _check_legacy(stream: _Stream, call: str) -> None:
    """Work on the legacy stream would implicitly wait for a capturing blocking stream: CUDA forbids it."""
    if stream is not _state.legacy:
        return
    for capture in _state.captures:
        if not capture.origin.flags & CUstream_flags.CU_STREAM_NON_BLOCKING:
            _invalidate(capture, f"{call} used the legacy stream during the capture")
            raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                        f"{call} on the legacy stream while a blocking stream is capturing")


def _capturing(stream: _Stream) -> _Capture | None:
    """The capture ``stream`` records into (failing if it was invalidated), or None."""
    capture = stream.capture
    if capture is not None and capture.invalidated:
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, f"the capture is invalid: {capture.invalidated}")
    return capture


def _enqueue(stream: _Stream, node: tuple, call: str) -> bool:
    """Records ``node`` when ``stream`` is capturing (returns True), else checks it may run now (False)."""
    capture = _capturing(stream)
    if capture is not None:
        capture.record(stream, node)
        return True
    _check_legacy(stream, call)
    return False


def _end_capture(capture: _Capture) -> None:
    for handle in capture.clocks:
        stream = _state.legacy if handle == 0 else _state.streams.get(handle)
        if stream is not None and stream.capture is capture:
            stream.capture = None
    if capture in _state.captures:
        _state.captures.remove(capture)


# ---- executing work ----------------------------------------------------------------------------------------------


def _run(node: tuple) -> None:
    kind = node[0]
    if kind == "kernel":
        _, function, grid, block, shared, params = node
        if not function.module.loaded:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE, f"kernel {function.name}'s module was unloaded")
        seed = 0
        if _state.shuffle_seed:  # a different order at every launch, reproducible from the seed
            _state.launches += 1
            seed = (_state.shuffle_seed * 0x9E3779B97F4A7C15 + _state.launches) & (2**64 - 1) or 1
        code, message = function.module.library.launch(function.name, grid, block, shared, params, seed)
        if code:
            raise _Fail(CUresult(code) if code in CUresult._value2member_map_ else CUresult.CUDA_ERROR_UNKNOWN, message)
    elif kind == "copy":
        _, direction, dst, src, nbytes, _keep = node
        if direction != "htod":
            _device_range(src, nbytes, "source")
        if direction != "dtoh":
            _device_range(dst, nbytes, "destination")
        ctypes.memmove(dst, src, nbytes)
    elif kind == "memset":
        _, dst, value, width, count = node
        _device_range(dst, width * count, "memset")
        if width == 1:
            ctypes.memset(dst, value, count)
        else:
            ctype = ctypes.c_uint16 if width == 2 else ctypes.c_uint32
            np.ctypeslib.as_array((ctype * count).from_address(dst))[:] = value
    elif kind == "alloc":
        allocation = node[1]
        if allocation.live:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"graph allocation {allocation.address:#x} from a previous launch was never freed")
        allocation.live = True
    elif kind == "free":
        allocation = node[1]
        if not allocation.live:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"graph frees {allocation.address:#x}, which is not live")
        allocation.live = False
        if not allocation.graph_refs:
            _state.memory.release(allocation)
    elif kind == "graph":
        for inner in node[1].nodes:
            _run(inner)
    elif kind == "wait":  # deferred cuStreamWaitEvent: the other stream's work up to the event runs first
        _drain(node[1], node[2])
    elif kind == "release":  # deferred cuMemFreeAsync
        allocation = node[1]
        allocation.live = allocation.free_pending = False
        if not allocation.graph_refs:
            _state.memory.release(allocation)


def _execute(node: tuple) -> None:
    """Run ``node`` now; a fault in it is sticky when that option is on."""
    try:
        _run(node)
    except _Fail as failure:
        if _state.sticky_errors and failure.code in _STICKY:
            _poison(failure)
        raise


def _poison(failure: _Fail) -> None:
    """What a GPU does after an exception in a kernel: the context is unusable and queued work never runs."""
    _state.sticky = (failure.code, failure.message)
    for stream in (*_state.streams.values(), _state.legacy):
        stream.queue.clear()


def _drain(stream: _Stream, upto: int | None = None) -> None:
    """Run ``stream``'s queued work in order, up to operation ``upto`` (all of it by default). A failure
    there is reported by the call that waited for it, and every later one: deferred errors are sticky."""
    queue = stream.queue
    while queue and (upto is None or queue[0][0] <= upto):
        _, node = queue.popleft()
        try:
            _run(node)
        except _Fail as failure:
            _poison(failure)
            raise


def _drain_all() -> None:
    for stream in list(_state.streams.values()):
        _drain(stream)


def _dispatch(stream: _Stream, node: tuple, call: str, host_waits: bool = False) -> None:
    """Record ``node`` into the stream's capture, run it, or (deferred) queue it; ``host_waits`` for an
    operation the host waits for (a copy into pageable memory): its stream runs up to it at once."""
    if _enqueue(stream, node, call):
        return
    if not _state.deferred:
        _execute(node)
        return
    if stream is _state.legacy:  # the legacy stream waits for the blocking streams and runs at once
        for other in list(_state.streams.values()):
            if not other.flags & CUstream_flags.CU_STREAM_NON_BLOCKING:
                _drain(other)
        _execute(node)
        return
    stream.issued += 1
    stream.queue.append((stream.issued, node))
    if host_waits:
        _drain(stream)


def _submit(stream_handle, node: tuple, call: str) -> None:
    _dispatch(_stream(stream_handle), node, call)


def _drop_graph_memory(allocations: list[Allocation]) -> None:
    for allocation in allocations:
        allocation.graph_refs -= 1
        if allocation.graph_refs == 0 and not allocation.live:
            _state.memory.release(allocation)


# ---- initialization, devices, contexts ---------------------------------------------------------------------------


@_api(1, initialized=False)
def cuGetErrorName(error):
    if int(error) not in CUresult._value2member_map_:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{int(error)} is not a CUresult")
    return CUresult(int(error)).name.encode()


@_api(1, initialized=False)
def cuGetErrorString(error):
    if int(error) not in CUresult._value2member_map_:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{int(error)} is not a CUresult")
    return _ERROR_STRINGS[CUresult(int(error))].encode()


@_api(initialized=False)
def cuInit(Flags):
    if int(Flags) != 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuInit flags must be 0")
    _state.initialized = True


@_api(1, initialized=False)
def cuDriverGetVersion():
    return DRIVER_VERSION


@_api(1)
def cuDeviceGetCount():
    return 1


def _device(dev) -> None:
    if _value(dev) != 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {_value(dev)} does not exist (there is one)")


@_api(1)
def cuDeviceGet(ordinal):
    _device(ordinal)
    return CUdevice(0)


@_api(1)
def cuDeviceGetName(length, dev):
    _device(dev)
    length = int(length)
    # cuda-python hands back its whole length-byte buffer: the NUL-terminated name, then the unwritten spaces.
    written = (DEVICE_NAME[: max(length - 1, 0)] + b"\x00")[:length]
    return written + b" " * (length - len(written))


@_api(1)
def cuDeviceGetAttribute(attrib, dev):
    _device(dev)
    try:
        name = CUdevice_attribute(int(attrib)).name.removeprefix("CU_DEVICE_ATTRIBUTE_")
    except ValueError:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"device attribute {int(attrib)} is not simulated") from None
    return _ATTRIBUTES[name]


@_api(1)
def cuDeviceTotalMem(dev):
    _device(dev)
    return _state.memory.capacity


@_api(1)
def cuDevicePrimaryCtxRetain(dev):
    _device(dev)
    if not _state.primary_refs:
        _state.context_handle = _state.new_handle()
    _state.primary_refs += 1
    return CUcontext(_state.context_handle)


@_api()
def cuDevicePrimaryCtxRelease(dev):
    _device(dev)
    if not _state.primary_refs:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, "the primary context is not retained")
    _state.primary_refs -= 1
    if not _state.primary_refs:
        _state.destroy_context()


@_api()
def cuDevicePrimaryCtxReset(dev):
    """Destroys the primary context and everything in it (memory, streams, modules, graphs); the next retain
    creates a fresh one. The way out of a sticky error."""
    _device(dev)
    _state.primary_refs = 0
    _state.destroy_context()


@_api(2)
def cuDevicePrimaryCtxGetState(dev):
    _device(dev)
    return 0, int(_state.primary_refs > 0)


@_api()
def cuCtxSetCurrent(ctx):
    value = _value(ctx)
    if value and (not _state.primary_refs or value != _state.context_handle):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{value:#x} is not a live context")
    _state.current.context = value


@_api(1)
def cuCtxGetCurrent():
    value = getattr(_state.current, "context", 0)
    return CUcontext(value if value == _state.context_handle and _state.primary_refs else 0)


@_api(1, context=True)
def cuCtxGetDevice():
    return CUdevice(0)


@_api(context=True)
def cuCtxSynchronize():
    _unsafe_while_capturing("cuCtxSynchronize")
    _drain_all()


# ---- streams and events -------------------------------------------------------------------------------------------


@_api(1, context=True)
def cuStreamCreate(Flags):
    stream = _Stream(_state.new_handle(), int(Flags))
    _state.streams[stream.handle] = stream
    return CUstream(stream.handle)


@_api(1, context=True)
def cuStreamCreateWithPriority(flags, priority):
    stream = _Stream(_state.new_handle(), int(flags))
    _state.streams[stream.handle] = stream
    return CUstream(stream.handle)


@_api()
def cuStreamDestroy(hStream):
    if _value(hStream) in _DEFAULT_STREAMS:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "the NULL stream cannot be destroyed")
    stream = _stream(hStream)
    if stream.capture is not None:
        _invalidate(stream.capture, "a capturing stream was destroyed")
    _drain(stream)  # a GPU finishes the stream's work before releasing it
    del _state.streams[stream.handle]


@_api()
def cuStreamSynchronize(hStream):
    stream = _stream(hStream)
    if stream.capture is not None:
        _invalidate(stream.capture, "cuStreamSynchronize was called on a capturing stream")
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuStreamSynchronize on a capturing stream")
    _drain(stream)


@_api()
def cuStreamQuery(hStream):
    stream = _stream(hStream)
    if stream.capture is not None:
        _invalidate(stream.capture, "cuStreamQuery was called on a capturing stream")
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuStreamQuery on a capturing stream")
    if stream.queue:
        raise _Fail(CUresult.CUDA_ERROR_NOT_READY, "the stream has queued work")


@_api()
def cuStreamWaitEvent(hStream, hEvent, Flags):
    stream, event = _stream(hStream), _event(hEvent)
    source = event.capture if event.capture is not None and event.capture in _state.captures else None
    target = stream.capture
    if source is None:
        if target is not None:  # a captured stream may not depend on work outside the capture
            _invalidate(target, "a capturing stream waited on an event recorded outside the capture")
            raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                        "cuStreamWaitEvent: the event was not recorded in this capture")
        pending = event.stream is not None and event.stream is not stream and event.stream.queue \
            and event.stream.queue[0][0] <= event.seq
        if pending:  # deferred: the wait is queued and runs the event's stream up to the event first
            _dispatch(stream, ("wait", event.stream, event.seq), "cuStreamWaitEvent")
        return  # otherwise everything it waits for already ran
    if target is None:
        source.join(stream, event.clock)  # the waiting stream joins the capture (a fork)
    elif target is source:
        clock = source.clocks[stream.handle]
        for key, count in event.clock.items():
            clock[key] = max(clock.get(key, 0), count)
    else:
        _invalidate(target, "two capture sequences were merged")
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_MERGE, "the event belongs to another capture sequence")


@_api(1, context=True)
def cuEventCreate(Flags):
    event = _Event(_state.new_handle(), int(Flags))
    _state.events[event.handle] = event
    return CUevent(event.handle)


@_api()
def cuEventRecord(hEvent, hStream):
    event, stream = _event(hEvent), _stream(hStream)
    capture = _capturing(stream)
    event.stream, event.seq = None, 0
    if capture is not None:
        event.capture, event.clock, event.time = capture, dict(capture.clocks[stream.handle]), None
    else:
        _check_legacy(stream, "cuEventRecord")
        event.capture, event.clock, event.time = None, {}, time.perf_counter()
        if stream.queue:
            event.stream, event.seq = stream, stream.issued


def _event_pending(event: _Event) -> bool:
    stream = event.stream
    return stream is not None and bool(stream.queue) and stream.queue[0][0] <= event.seq


def _captured(event: _Event) -> bool:
    return event.capture is not None and event.capture in _state.captures


@_api()
def cuEventQuery(hEvent):
    event = _event(hEvent)
    if _captured(event):
        raise _Fail(CUresult.CUDA_ERROR_CAPTURED_EVENT, "the event was recorded in an active capture")
    if _event_pending(event):
        raise _Fail(CUresult.CUDA_ERROR_NOT_READY, "the work before the event is still queued")


@_api()
def cuEventSynchronize(hEvent):
    event = _event(hEvent)
    if _captured(event):
        raise _Fail(CUresult.CUDA_ERROR_CAPTURED_EVENT, "the event was recorded in an active capture")
    if event.stream is not None:
        _drain(event.stream, event.seq)


@_api(1)
def cuEventElapsedTime(hStart, hEnd):
    start, end = _event(hStart), _event(hEnd)
    for event in (start, end):
        if event.flags & CUevent_flags.CU_EVENT_DISABLE_TIMING or event.time is None:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_HANDLE, "both events must be recorded, with timing enabled")
    return (end.time - start.time) * 1000.0


@_api()
def cuEventDestroy(hEvent):
    del _state.events[_event(hEvent).handle]


# ---- memory ------------------------------------------------------------------------------------------------------


def _allocate(size) -> Allocation:
    size = int(size)
    if size <= 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "allocation size must be positive")
    allocation = _state.memory.allocate(size)
    if allocation is None:
        free = _state.memory.capacity - _state.memory.mapped
        raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"{size} bytes requested, {free} of "
                    f"{_state.memory.capacity} free (set {MEMORY_ENV} to simulate a larger device)")
    return allocation


def _free(dptr, call: str) -> None:
    address = _value(dptr)
    allocation = _state.memory.at(address)
    if allocation is None or not allocation.live or allocation.free_pending:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"{call}: {address:#x} is not the start of a live allocation (double free or foreign pointer)")
    allocation.live = False
    if not allocation.graph_refs:
        _state.memory.release(allocation)


@_api(1, context=True)
def cuMemAlloc(bytesize):
    _unsafe_while_capturing("cuMemAlloc")
    return CUdeviceptr(_allocate(bytesize).address)


@_api(context=True)
def cuMemFree(dptr):
    if _value(dptr) == 0:
        return
    _unsafe_while_capturing("cuMemFree")
    _drain_all()  # cuMemFree waits for the device: work still queued may use the memory
    _free(dptr, "cuMemFree")


@_api(1)
def cuMemAllocAsync(bytesize, hStream):
    stream = _stream(hStream)
    capture = _capturing(stream)
    if capture is None:
        _check_legacy(stream, "cuMemAllocAsync")
    allocation = _allocate(bytesize)
    allocation.pooled = True
    _pool_used()
    if capture is not None:
        allocation.captured = True
        capture.allocations.append(allocation)
        capture.record(stream, ("alloc", allocation))
    return CUdeviceptr(allocation.address)


@_api()
def cuMemFreeAsync(dptr, hStream):
    stream = _stream(hStream)
    address = _value(dptr)
    allocation = _state.memory.at(address)
    if allocation is None or not allocation.live or allocation.free_pending:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemFreeAsync: {address:#x} is not the start of a live allocation (double free or foreign "
                    f"pointer)")
    capture = _capturing(stream)
    if capture is None:
        _check_legacy(stream, "cuMemFreeAsync")
        if _state.deferred and stream is not _state.legacy:  # freed when the stream reaches it
            allocation.free_pending = True
            _dispatch(stream, ("release", allocation), "cuMemFreeAsync")
            return
        _free(dptr, "cuMemFreeAsync")
        return
    capture.record(stream, ("free", allocation))
    if allocation in capture.allocations:
        allocation.live = False  # the graph's own memory: gone for the rest of the capture


@_api(1)
def cuDeviceGetDefaultMemPool(dev):
    _device(dev)
    return CUmemoryPool(_state.pool_handle)


cuDeviceGetMemPool = cuDeviceGetDefaultMemPool


def _pool(pool, attr) -> CUmemPool_attribute:
    if _value(pool) != _state.pool_handle:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{_value(pool):#x} is not the device's memory pool")
    try:
        return CUmemPool_attribute(int(attr))
    except ValueError:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"memory pool attribute {int(attr)} is not simulated") from None


def _pool_used() -> int:
    used = sum(a.size for a in _state.memory.live_allocations() if a.pooled)
    _state.pool_used_high = max(_state.pool_used_high, used)
    return used


@_api(1)
def cuMemPoolGetAttribute(pool, attr):
    """The simulated pool keeps nothing in reserve: reserved memory is the memory in use."""
    attr = _pool(pool, attr)
    if attr in _state.pool_flags:
        return _state.pool_flags[attr]
    used = _pool_used()
    values = {
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: _state.pool_threshold,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: used,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT: used,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: _state.pool_used_high,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH: _state.pool_used_high,
    }
    return cuuint64_t(values[attr])


@_api()
def cuMemPoolSetAttribute(pool, attr, value):
    attr = _pool(pool, attr)
    if attr in _state.pool_flags:
        _state.pool_flags[attr] = int(value)
    elif attr == CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        _state.pool_threshold = int(value)
    elif attr in (CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                  CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH) and int(value) == 0:
        _state.pool_used_high = 0  # resetting the high-water mark is the only write CUDA allows
        _pool_used()
    else:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{attr.name} cannot be set to {int(value)}")


@_api()
def cuMemPoolTrimTo(pool, minBytesToKeep):
    _pool(pool, CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)


@_api(2, context=True)
def cuMemGetInfo():
    memory = _state.memory
    return memory.capacity - memory.mapped, memory.capacity


@_api(2)
def cuMemGetAddressRange(dptr):
    allocation = _state.memory.containing(_value(dptr))
    if allocation is None:
        raise _Fail(CUresult.CUDA_ERROR_NOT_FOUND, f"{_value(dptr):#x} is not inside a live allocation")
    return CUdeviceptr(allocation.address), allocation.size


def _copy(direction: str, dst, src, nbytes, stream, call: str, sync: bool) -> None:
    nbytes = int(nbytes)
    if sync:
        _state.require_context()
        _unsafe_while_capturing(call)
    if nbytes == 0:
        return
    keep = None
    if direction == "htod":
        keep, src = src, _host_buffer(src, nbytes, writable=False)
        dst = _device_range(dst, nbytes, "destination")
    elif direction == "dtoh":
        keep, dst = dst, _host_buffer(dst, nbytes, writable=True)
        src = _device_range(src, nbytes, "source")
    else:
        src, dst = _device_range(src, nbytes, "source"), _device_range(dst, nbytes, "destination")
    handle = _stream(stream)
    pageable = _state.deferred and handle.capture is None and direction != "dtod" and \
        not _state.is_pinned(src if direction == "htod" else dst, nbytes)
    if pageable and direction == "htod":  # the driver stages pageable memory at issue time
        keep = ctypes.create_string_buffer(ctypes.string_at(src, nbytes), nbytes)
        src = ctypes.addressof(keep)
    _dispatch(handle, ("copy", direction, dst, src, nbytes, keep), call, host_waits=pageable and direction == "dtoh")


@_api()
def cuMemcpyHtoD(dstDevice, srcHost, ByteCount):
    _copy("htod", dstDevice, srcHost, ByteCount, 0, "cuMemcpyHtoD", True)


@_api()
def cuMemcpyDtoH(dstHost, srcDevice, ByteCount):
    _copy("dtoh", dstHost, srcDevice, ByteCount, 0, "cuMemcpyDtoH", True)


@_api()
def cuMemcpyDtoD(dstDevice, srcDevice, ByteCount):
    _copy("dtod", dstDevice, srcDevice, ByteCount, 0, "cuMemcpyDtoD", True)


@_api()
def cuMemcpyHtoDAsync(dstDevice, srcHost, ByteCount, hStream):
    _copy("htod", dstDevice, srcHost, ByteCount, hStream, "cuMemcpyHtoDAsync", False)


@_api()
def cuMemcpyDtoHAsync(dstHost, srcDevice, ByteCount, hStream):
    _copy("dtoh", dstHost, srcDevice, ByteCount, hStream, "cuMemcpyDtoHAsync", False)


@_api()
def cuMemcpyDtoDAsync(dstDevice, srcDevice, ByteCount, hStream):
    _copy("dtod", dstDevice, srcDevice, ByteCount, hStream, "cuMemcpyDtoDAsync", False)


def _memset(dst, value: int, width: int, count, stream, call: str, sync: bool) -> None:
    count = int(count)
    address = _value(dst)
    if sync:
        _state.require_context()
        _unsafe_while_capturing(call)
    if address % width:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{call}: {address:#x} is not {width}-byte aligned")
    if count == 0:
        return
    _device_range(address, width * count, "memset")
    _submit(stream, ("memset", address, int(value) & ((1 << (8 * width)) - 1), width, count), call)


@_api()
def cuMemsetD8(dstDevice, uc, N):
    _memset(dstDevice, uc, 1, N, 0, "cuMemsetD8", True)


@_api()
def cuMemsetD16(dstDevice, us, N):
    _memset(dstDevice, us, 2, N, 0, "cuMemsetD16", True)


@_api()
def cuMemsetD32(dstDevice, ui, N):
    _memset(dstDevice, ui, 4, N, 0, "cuMemsetD32", True)


@_api()
def cuMemsetD8Async(dstDevice, uc, N, hStream):
    _memset(dstDevice, uc, 1, N, hStream, "cuMemsetD8Async", False)


@_api()
def cuMemsetD16Async(dstDevice, us, N, hStream):
    _memset(dstDevice, us, 2, N, hStream, "cuMemsetD16Async", False)


@_api()
def cuMemsetD32Async(dstDevice, ui, N, hStream):
    _memset(dstDevice, ui, 4, N, hStream, "cuMemsetD32Async", False)


# ---- modules and kernels ---------------------------------------------------------------------------------------


@_api(1, context=True)
def cuModuleLoadData(image):
    parsed = compiler.parse_image(image)
    if parsed is None:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_IMAGE,
                    "not a simulator image (compile kernels with the simulator selected: ONNX_RUNTIME_CUDA_SIM=1)")
    try:
        library = compiler.load(*parsed)
    except compiler.CompileError as exc:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_IMAGE, str(exc)) from None
    module = _Module(_state.new_handle(), library)
    _state.modules[module.handle] = module
    return CUmodule(module.handle)


@_api(1)
def cuModuleGetFunction(hmod, name):
    if not isinstance(name, bytes):
        raise TypeError(f"expected bytes, {type(name).__name__} found")
    module = _lookup(_state.modules, hmod, "module")
    text = name.decode()
    for function in _state.functions.values():
        if function.module is module and function.name == text:
            return CUfunction(function.handle)
    if text not in module.library.kernels:
        raise _Fail(CUresult.CUDA_ERROR_NOT_FOUND, f"no extern \"C\" __global__ function {text!r} in the module "
                    f"(it has: {', '.join(sorted(module.library.kernels)) or 'none'})")
    function = _Function(_state.new_handle(), module, text, module.library.kernels[text],
                         module.library.max_threads[text])
    _state.functions[function.handle] = function
    return CUfunction(function.handle)


@_api()
def cuModuleUnload(hmod):
    module = _lookup(_state.modules, hmod, "module")
    _drain_all()
    module.loaded = False
    del _state.modules[module.handle]
    for handle in [h for h, f in _state.functions.items() if f.module is module]:
        del _state.functions[handle]


@_api(1)
def cuFuncGetAttribute(attrib, hfunc):
    function = _lookup(_state.functions, hfunc, "function")
    values = {
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: function.max_threads,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS: 32,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_PTX_VERSION: 90,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_BINARY_VERSION: 90,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: function.max_dynamic_shared,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: function.carveout,
    }
    return values.get(int(attrib), 0)  # static/const/local sizes are unknown on the host: 0


@_api()
def cuFuncSetAttribute(hfunc, attrib, value):
    function = _lookup(_state.functions, hfunc, "function")
    value = int(value)
    if int(attrib) == CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        if not 0 <= value <= MAX_DYNAMIC_SHARED:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"dynamic shared memory {value} > {MAX_DYNAMIC_SHARED}")
        function.max_dynamic_shared = value
    elif int(attrib) == CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        function.carveout = value
    else:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {int(attrib)} cannot be set")


_CTYPES = {
    ctypes.c_bool: "u", ctypes.c_char: "i", ctypes.c_wchar: "i", ctypes.c_byte: "i", ctypes.c_ubyte: "u",
    ctypes.c_short: "i", ctypes.c_ushort: "u", ctypes.c_int: "i", ctypes.c_uint: "u", ctypes.c_long: "i",
    ctypes.c_ulong: "u", ctypes.c_longlong: "i", ctypes.c_ulonglong: "u", ctypes.c_size_t: "u",
    ctypes.c_float: "f", ctypes.c_double: "f",
}
_KIND_NAMES = {"p": "pointer", "i": "signed integer", "u": "unsigned integer", "f": "floating-point", "s": "struct"}


def _param(value, ctype, expected: compiler.Param) -> tuple[bytes, str]:
    """One kernel argument in cuda-python's tuple form as (bytes, kind), converted the way cuda-python does."""
    if ctype is None:
        if isinstance(value, _Handle):  # e.g. a CUdeviceptr: the kernel receives the stored value
            return bytes(value._storage), "p"
        if callable(getattr(value, "getPtr", None)):
            return ctypes.string_at(value.getPtr(), expected.size), "s"
        if isinstance(value, ctypes.Structure):
            return bytes(value), "s"
        if isinstance(value, enum.Enum):
            return bytes(ctypes.c_int(int(value.value))), "i"
        raise TypeError(f"Provided argument is of type {type(value)} but expected Type {ctypes.Structure}, "
                        f"{ctypes.c_void_p} or CUDA Binding structure with getPtr() attribute")
    if ctype is ctypes.c_void_p:
        if isinstance(value, ctypes.c_void_p):
            value = value.value or 0
        if not isinstance(value, int) or isinstance(value, _Handle):
            # cuda-python would pass getPtr(), the host address of the handle object: garbage on the GPU.
            raise TypeError(f"a c_void_p kernel argument must be an int (pass int(ptr)), got {type(value).__name__}")
        return int(value).to_bytes(8, "little", signed=value < 0), "p"
    if ctype not in _CTYPES:
        raise TypeError(f"Unsupported type: {ctype}")
    if ctype is ctypes.c_double and isinstance(value, ctypes.c_float):
        value = value.value
    return bytes(value if isinstance(value, ctype) else ctype(value)), _CTYPES[ctype]


def _kernel_params(function: _Function, kernelParams) -> list[bytes]:
    expected = function.params
    if kernelParams is None or (isinstance(kernelParams, int) and kernelParams == 0):
        supplied: list[tuple[bytes, str]] = []
    elif isinstance(kernelParams, tuple) and len(kernelParams) == 2 and all(isinstance(p, tuple) for p in kernelParams):
        values, types = kernelParams
        if len(values) != len(types):
            raise TypeError("Argument 'kernelParams' has tuples with different length")
        if len(values) != len(expected):
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"kernel {function.name} takes {len(expected)} parameters, {len(values)} were passed")
        supplied = [_param(v, t, p) for v, t, p in zip(values, types, expected)]
    else:
        # A raw void** (an int address or a buffer of pointers): each points at its parameter's bytes.
        address = int(kernelParams) if isinstance(kernelParams, int) else _host_buffer(kernelParams, 8 * len(expected),
                                                                                       writable=False)
        pointers = (ctypes.c_void_p * len(expected)).from_address(address) if expected else []
        return [ctypes.string_at(pointer, p.size) for pointer, p in zip(pointers, expected)]
    if len(supplied) != len(expected):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"kernel {function.name} takes {len(expected)} parameters, {len(supplied)} were passed")
    for index, ((data, kind), want) in enumerate(zip(supplied, expected)):
        compatible = want.kind == "s" or kind == "s" or (kind == "f") == (want.kind == "f")
        if len(data) != want.size or not compatible:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"kernel {function.name} parameter {index} is a {want.size}-byte {_KIND_NAMES[want.kind]}, "
                        f"the argument is a {len(data)}-byte {_KIND_NAMES[kind]}")
    return [data for data, _ in supplied]


@_api()
def cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                   kernelParams, extra):
    function = _lookup(_state.functions, f, "function")
    grid = (int(gridDimX), int(gridDimY), int(gridDimZ))
    block = (int(blockDimX), int(blockDimY), int(blockDimZ))
    shared = int(sharedMemBytes)
    if extra not in (None, 0):
        raise _Fail(CUresult.CUDA_ERROR_NOT_SUPPORTED, "the simulator takes kernel arguments via kernelParams only")
    threads = block[0] * block[1] * block[2]
    if min(grid) < 1 or min(block) < 1 or threads > 1024 or block[2] > 64 or grid[0] >= 2**31 or max(grid[1:]) > 65535:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"invalid launch: grid {grid}, block {block}")
    if threads > function.max_threads:
        raise _Fail(CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                    f"{function.name}: {threads} threads exceed its __launch_bounds__ ({function.max_threads})")
    if shared > function.max_dynamic_shared:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"{function.name}: {shared} bytes of dynamic shared memory exceed the kernel's limit "
                    f"{function.max_dynamic_shared} (raise it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)")
    params = _kernel_params(function, kernelParams)
    _submit(hStream, ("kernel", function, grid, block, shared, params), "cuLaunchKernel")


# ---- stream capture and graphs --------------------------------------------------------------------------------


@_api()
def cuStreamBeginCapture(hStream, mode):
    stream = _stream(hStream)
    if stream is _state.legacy:
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "the legacy NULL stream cannot be captured")
    if stream.capture is not None:
        raise _Fail(CUresult.CUDA_ERROR_ILLEGAL_STATE, "the stream is already capturing")
    try:
        mode = CUstreamCaptureMode(int(mode))
    except ValueError:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{mode} is not a capture mode") from None
    capture = _Capture(stream, mode, threading.get_ident())
    capture.join(stream, {})
    _state.captures.append(capture)


@_api(1)
def cuStreamEndCapture(hStream):
    stream = _stream(hStream)
    capture = stream.capture
    if capture is None:
        raise _Fail(CUresult.CUDA_ERROR_ILLEGAL_STATE, "the stream is not capturing")
    if capture.origin is not stream:
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "the capture was begun on another stream")
    if capture.mode == CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL and \
            capture.thread != threading.get_ident():
        raise _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "a thread-local capture ends on its own thread")
    _end_capture(capture)
    origin = capture.clocks[stream.handle]
    unjoined = [h for h, count in capture.counts.items() if h != stream.handle and origin.get(h, 0) < count]
    failure = None
    if capture.invalidated:
        failure = _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, capture.invalidated)
    elif unjoined:
        failure = _Fail(CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
                        f"work forked onto stream(s) {', '.join(hex(h) for h in unjoined)} was never joined back")
    if failure is not None:
        for allocation in capture.allocations:
            _state.memory.release(allocation)
        raise failure
    for allocation in capture.allocations:  # the graph owns them; they exist while a launch has them live
        allocation.live = False
        allocation.graph_refs += 1
    graph = _Graph(_state.new_handle(), capture.nodes, capture.allocations)
    _state.graphs[graph.handle] = graph
    return CUgraph(graph.handle)


@_api(1)
def cuStreamIsCapturing(hStream):
    capture = _stream(hStream).capture
    if capture is None:
        return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    if capture.invalidated:
        return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED
    return CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


@_api(1)
def cuGraphInstantiate(hGraph, flags):
    graph = _lookup(_state.graphs, hGraph, "graph", CUresult.CUDA_ERROR_INVALID_VALUE)
    if graph.allocations and graph.execs:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    "a graph with allocation nodes can have only one executable graph at a time")
    auto_free = bool(int(flags) & CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
    execution = _GraphExec(_state.new_handle(), graph, list(graph.nodes), list(graph.allocations), auto_free)
    for allocation in execution.allocations:
        allocation.graph_refs += 1
    graph.execs += 1
    _state.execs[execution.handle] = execution
    return CUgraphExec(execution.handle)


@_api()
def cuGraphUpload(hGraphExec, hStream):
    _lookup(_state.execs, hGraphExec, "executable graph", CUresult.CUDA_ERROR_INVALID_VALUE)
    _stream(hStream)


@_api()
def cuGraphLaunch(hGraphExec, hStream):
    execution = _lookup(_state.execs, hGraphExec, "executable graph", CUresult.CUDA_ERROR_INVALID_VALUE)
    if execution.auto_free:
        for allocation in execution.allocations:
            allocation.live = False
    _submit(hStream, ("graph", execution), "cuGraphLaunch")


@_api()
def cuGraphExecDestroy(hGraphExec):
    execution = _lookup(_state.execs, hGraphExec, "executable graph", CUresult.CUDA_ERROR_INVALID_VALUE)
    _drain_all()  # queued launches of it run first
    del _state.execs[execution.handle]
    execution.graph.execs -= 1
    _drop_graph_memory(execution.allocations)


@_api()
def cuGraphDestroy(hGraph):
    graph = _lookup(_state.graphs, hGraph, "graph", CUresult.CUDA_ERROR_INVALID_VALUE)
    _drain_all()
    del _state.graphs[graph.handle]
    _drop_graph_memory(graph.allocations)


# ---- page-locked host memory ---------------------------------------------------------------------------------


@_api(1, context=True)
def cuMemHostAlloc(bytesize, Flags):
    size = int(bytesize)
    if size <= 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc size must be positive")
    if int(Flags) & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemHostAlloc flags {int(Flags):#x} are not valid")
    buffer = (ctypes.c_uint8 * size)()
    ctypes.memset(buffer, 0xFF, size)  # like device memory: never reads as zeros by accident
    address = ctypes.addressof(buffer)
    _state.host_allocations[address] = buffer
    _state.pinned[address] = size
    return address


@_api(context=True)
def cuMemFreeHost(p):
    address = _value(p)
    if address not in _state.host_allocations:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemFreeHost: {address:#x} is not a live cuMemHostAlloc allocation (double free or foreign "
                    f"pointer)")
    _drain_all()  # freeing page-locked memory waits for the device, as cudaFreeHost does
    del _state.host_allocations[address]
    del _state.pinned[address]


@_api(context=True)
def cuMemHostRegister(p, bytesize, Flags):
    address, size = _value(p), int(bytesize)
    if not address or size <= 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemHostRegister needs a non-null range")
    if any(start < address + size and address < start + length for start, length in _state.pinned.items()):
        raise _Fail(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                    f"[{address:#x}, +{size}) overlaps page-locked memory")
    _state.pinned[address] = size
    _state.registered.add(address)


@_api(context=True)
def cuMemHostUnregister(p):
    address = _value(p)
    if address not in _state.registered:
        raise _Fail(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, f"{address:#x} was not registered")
    _drain_all()
    _state.registered.discard(address)
    del _state.pinned[address]
