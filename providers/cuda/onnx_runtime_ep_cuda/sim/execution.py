"""How simulated work runs: recorded into a stream capture, executed at once, or (deferred mode) queued
on its stream until a synchronization point; sticky errors poison the context."""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from .memory import Allocation
from .state import _Capture, _device_range, _Fail, _state, _Stream, _stream
from .types import _STICKY, CUresult, CUstream_flags, CUstreamCaptureMode

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


def _run(node: tuple) -> None:  # noqa: C901 - one branch per kind of recorded work
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
    elif kind == "copy2d":
        _, dst, dst_pitch, src, src_pitch, width, height = node
        _device_range(src, (height - 1) * src_pitch + width, "source")
        _device_range(dst, (height - 1) * dst_pitch + width, "destination")
        for row in range(height):
            ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
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
    if _state.trace is not None:
        _state.trace.append((call, stream.handle, threading.get_ident()))
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
