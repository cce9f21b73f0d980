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

The driver is split by concern; this module is its face (``load_driver_module`` imports it) and re-exports
every name of: ``types.py`` (constants, enums, handles), ``state.py`` (the driver's state, the ``_api``
wrapper, argument helpers), ``execution.py`` (capture recording, immediate and deferred execution, sticky
errors), ``contexts.py`` (init, device, primary context), ``streams.py`` (streams, events), ``memory_api.py``
(device memory, pool, copies, memsets, page-locked host memory), ``kernels.py`` (modules, launches) and
``graphs.py`` (stream capture, graphs). A module adding calls imports the internals from ``state.py`` and
``execution.py`` and is re-exported here.

Simulator-only helpers: ``make_image`` (what ``nvrtc.compile`` returns here), ``live_allocations()``,
``live_host_allocations()``, ``live_events()``, ``stream_trace()`` (which stream and thread issued each
operation), ``last_error_message()`` (why the last failing call failed), ``configure()`` (the options above)
and ``reset()`` (drop all driver state; the options return to their environment defaults).
"""

from __future__ import annotations

from .compiler import make_image
from .contexts import (  # noqa: F401
    _device,
    cuCtxGetCurrent,
    cuCtxGetDevice,
    cuCtxSetCurrent,
    cuCtxSynchronize,
    cuDeviceGet,
    cuDeviceGetAttribute,
    cuDeviceGetCount,
    cuDeviceGetName,
    cuDevicePrimaryCtxGetState,
    cuDevicePrimaryCtxRelease,
    cuDevicePrimaryCtxReset,
    cuDevicePrimaryCtxRetain,
    cuDeviceTotalMem,
    cuDriverGetVersion,
    cuGetErrorName,
    cuGetErrorString,
    cuInit,
)
from .execution import (  # noqa: F401
    _capturing,
    _check_legacy,
    _dispatch,
    _drain,
    _drain_all,
    _drop_graph_memory,
    _end_capture,
    _enqueue,
    _execute,
    _invalidate,
    _poison,
    _run,
    _submit,
    _unsafe_while_capturing,
)
from .graphs import (  # noqa: F401
    cuGraphDestroy,
    cuGraphExecDestroy,
    cuGraphInstantiate,
    cuGraphLaunch,
    cuGraphUpload,
    cuStreamBeginCapture,
    cuStreamEndCapture,
    cuStreamIsCapturing,
)
from .kernels import (  # noqa: F401
    _CTYPES,
    _KIND_NAMES,
    _kernel_params,
    _param,
    cuFuncGetAttribute,
    cuFuncSetAttribute,
    cuLaunchKernel,
    cuModuleGetFunction,
    cuModuleLoadData,
    cuModuleUnload,
)
from .memory_api import (  # noqa: F401
    _allocate,
    _copy,
    _free,
    _memset,
    _pool,
    _pool_used,
    cuDeviceGetDefaultMemPool,
    cuDeviceGetMemPool,
    cuMemAlloc,
    cuMemAllocAsync,
    cuMemcpy2DAsync,
    cuMemcpyDtoD,
    cuMemcpyDtoDAsync,
    cuMemcpyDtoH,
    cuMemcpyDtoHAsync,
    cuMemcpyHtoD,
    cuMemcpyHtoDAsync,
    cuMemFree,
    cuMemFreeAsync,
    cuMemFreeHost,
    cuMemGetAddressRange,
    cuMemGetInfo,
    cuMemHostAlloc,
    cuMemHostRegister,
    cuMemHostUnregister,
    cuMemPoolGetAttribute,
    cuMemPoolSetAttribute,
    cuMemPoolTrimTo,
    cuMemsetD8,
    cuMemsetD8Async,
    cuMemsetD16,
    cuMemsetD16Async,
    cuMemsetD32,
    cuMemsetD32Async,
)
from .state import (  # noqa: F401
    _ANSWERED_WHEN_STICKY,
    _api,
    _buffer_address,
    _Capture,
    _device_range,
    _env_flag,
    _Event,
    _event,
    _Fail,
    _Function,
    _Graph,
    _GraphExec,
    _host_buffer,
    _lock,
    _lookup,
    _Module,
    _State,
    _state,
    _Stream,
    _stream,
    _value,
)
from .streams import (  # noqa: F401
    _captured,
    _event_pending,
    cuEventCreate,
    cuEventDestroy,
    cuEventElapsedTime,
    cuEventQuery,
    cuEventRecord,
    cuEventSynchronize,
    cuStreamCreate,
    cuStreamCreateWithPriority,
    cuStreamDestroy,
    cuStreamQuery,
    cuStreamSynchronize,
    cuStreamWaitEvent,
)
from .types import (  # noqa: F401
    _ATTRIBUTES,
    _DEFAULT_STREAMS,
    _ERROR_STRINGS,
    _STICKY,
    CU_MEMHOSTALLOC_DEVICEMAP,
    CU_MEMHOSTALLOC_PORTABLE,
    CU_MEMHOSTALLOC_WRITECOMBINED,
    CU_MEMHOSTREGISTER_DEVICEMAP,
    CU_MEMHOSTREGISTER_PORTABLE,
    CU_STREAM_LEGACY,
    CU_STREAM_PER_THREAD,
    CUDA_MEMCPY2D,
    DEFAULT_DYNAMIC_SHARED,
    DEFERRED_ENV,
    DEVICE_NAME,
    DRIVER_VERSION,
    MAX_DYNAMIC_SHARED,
    MEMORY_ENV,
    SHUFFLE_ENV,
    STICKY_ENV,
    CUcontext,
    CUdevice,
    CUdevice_attribute,
    CUdeviceptr,
    CUevent,
    CUevent_flags,
    CUfunction,
    CUfunction_attribute,
    CUgraph,
    CUgraphExec,
    CUgraphInstantiate_flags,
    CUmemoryPool,
    CUmemorytype,
    CUmemPool_attribute,
    CUmodule,
    CUresult,
    CUstream,
    CUstream_flags,
    CUstreamCaptureMode,
    CUstreamCaptureStatus,
    _Handle,
    cuuint64_t,
)

__all__ = ["make_image", "live_allocations", "live_host_allocations", "last_error_message", "configure", "reset"]


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
              shuffle_blocks: int | None = None, trace: bool | None = None) -> dict:
    """Switch the options of the module docstring (None leaves one as it is); returns the previous values,
    which ``configure(**previous)`` restores. Turning deferred execution off first runs what is queued.
    ``trace=True`` starts a fresh record of stream work (see :func:`stream_trace`), ``False`` drops it."""
    with _lock:
        previous = {"deferred": _state.deferred, "sticky_errors": _state.sticky_errors,
                    "shuffle_blocks": _state.shuffle_seed, "trace": _state.trace is not None}
        if trace is not None:
            _state.trace = [] if trace else None
        if deferred is not None:
            if not deferred:
                _drain_all()
            _state.deferred = bool(deferred)
        if sticky_errors is not None:
            _state.sticky_errors = bool(sticky_errors)
        if shuffle_blocks is not None:
            _state.shuffle_seed = int(shuffle_blocks)
        return previous


def stream_trace() -> list[tuple[str, int, int]]:
    """``(call, stream handle, thread id)`` of every operation enqueued on a stream (launches, copies, memsets,
    frees, graph launches, event records and waits) since ``configure(trace=True)``, in issue order."""
    with _lock:
        return list(_state.trace or ())


def live_events() -> int:
    """How many events exist (created and not destroyed)."""
    with _lock:
        return len(_state.events)


def reset() -> None:
    """Frees all simulated device memory and forgets every handle, as if the process had just started."""
    with _lock:
        _state.memory.release_all()
        _state.__init__()


# Virtual memory management (reserve, create, map, set access) lives in its own module; imported last because
# it builds on the state and calling convention above.
from .vmm import (  # noqa: E402, F401
    CUmemAccess_flags,
    CUmemAccessDesc,
    CUmemAllocationGranularity_flags,
    CUmemAllocationProp,
    CUmemAllocationType,
    CUmemGenericAllocationHandle,
    CUmemLocation,
    CUmemLocationType,
    cuMemAddressFree,
    cuMemAddressReserve,
    cuMemCreate,
    cuMemGetAllocationGranularity,
    cuMemMap,
    cuMemRelease,
    cuMemSetAccess,
    cuMemUnmap,
    live_vmm,
)
