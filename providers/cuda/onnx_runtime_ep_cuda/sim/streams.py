"""Simulated driver calls: streams and events (ordering, waits, synchronization, timing)."""

from __future__ import annotations

import threading
import time

from .execution import _capturing, _check_legacy, _dispatch, _drain, _invalidate, _unsafe_while_capturing
from .state import _api, _Event, _event, _Fail, _state, _Stream, _stream, _value
from .types import _DEFAULT_STREAMS, CUevent, CUevent_flags, CUresult, CUstream

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
    _unsafe_while_capturing("cuStreamSynchronize")  # any stream, from a thread a capture prohibits (as an H200 does)
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
    if _state.trace is not None:
        _state.trace.append(("cuStreamWaitEvent", stream.handle, threading.get_ident()))
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
    if _state.trace is not None:
        _state.trace.append(("cuEventRecord", stream.handle, threading.get_ident()))
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
