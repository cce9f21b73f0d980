"""Simulated driver calls: stream capture and graphs (instantiate, upload, launch, destroy)."""

from __future__ import annotations

import threading

from .execution import _drain_all, _drop_graph_memory, _end_capture, _submit, _unsafe_while_capturing
from .state import _api, _Capture, _Fail, _Graph, _GraphExec, _lookup, _state, _stream
from .types import (
    CUgraph,
    CUgraphExec,
    CUgraphInstantiate_flags,
    CUresult,
    CUstreamCaptureMode,
    CUstreamCaptureStatus,
)

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
    _unsafe_while_capturing("cuGraphExecDestroy")  # an H200 refuses it on a thread a capture prohibits
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
