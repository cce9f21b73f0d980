"""The simulated driver's state (one process-wide context, its streams, events, modules, graphs and
memory), the ``_api`` wrapper that gives every call cuda-python's ``(CUresult, *values)`` convention
under the driver's one lock, and the argument helpers the calls share."""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from . import compiler
from .memory import DeviceMemory
from .types import (
    _DEFAULT_STREAMS,
    DEFAULT_DYNAMIC_SHARED,
    DEFERRED_ENV,
    MEMORY_ENV,
    SHUFFLE_ENV,
    STICKY_ENV,
    CUmemPool_attribute,
    CUresult,
    CUstreamCaptureMode,
)

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
        self.trace: list | None = None  # configure(trace=True): (call, stream handle, thread) of stream work
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


_state = _State()  # reset() reinitializes it in place: every module holds this object
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
