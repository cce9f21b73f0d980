"""The simulator's stream capture modes, as CUDA defines them: a GLOBAL capture is invalidated by an unsafe call
(cuMemAlloc, a synchronization) on any thread; a THREAD_LOCAL capture only by one on its own thread, so another
thread working on its own stream runs at once and is not recorded; RELAXED permits them everywhere. What
per-session streams need from the driver: one session's capture left alone by another session's thread."""

from __future__ import annotations

import ctypes
import threading

import pytest

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

OK = cu.CUresult.CUDA_SUCCESS
NON_BLOCKING = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
MODES = cu.CUstreamCaptureMode
FILL = r"""
extern "C" __global__ void fill_u32(unsigned int* y, unsigned int value) { y[threadIdx.x] = value; }
"""


def check(result):
    err, *values = result
    assert err == OK, f"{err!r}: {cu.last_error_message()}"
    return values[0] if len(values) == 1 else tuple(values) if values else None


@pytest.fixture
def streams():
    cu.reset()
    check(cu.cuInit(0))
    context = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(context))
    module = check(cu.cuModuleLoadData(cu.make_image(FILL, [])))
    function = check(cu.cuModuleGetFunction(module, b"fill_u32"))

    def fill(pointer, value, stream):
        check(cu.cuLaunchKernel(function, 1, 1, 1, 4, 1, 1, 0, stream,
                                ((int(pointer), value), (ctypes.c_void_p, ctypes.c_uint32)), 0))

    yield context, check(cu.cuStreamCreate(NON_BLOCKING)), check(cu.cuStreamCreate(NON_BLOCKING)), fill
    cu.reset()


def _on_another_thread(context, work):
    """Run ``work()`` on a new thread (its context made current there); what it returned or raised."""
    outcome: list = []

    def body():
        check(cu.cuCtxSetCurrent(context))
        try:
            outcome.append(work())
        except AssertionError as error:
            outcome.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    return outcome[0]


@pytest.mark.parametrize("mode", ["GLOBAL", "THREAD_LOCAL", "RELAXED"])
def test_another_threads_unsafe_calls_break_only_a_global_capture(streams, mode):
    context, mine, theirs, fill = streams
    memory = check(cu.cuMemAlloc(16))
    other = check(cu.cuMemAlloc(16))
    check(cu.cuStreamBeginCapture(mine, getattr(MODES, f"CU_STREAM_CAPTURE_MODE_{mode}")))
    fill(memory, 7, mine)  # recorded, not run

    def their_session():
        fill(other, 5, theirs)  # their own stream: runs now, outside the capture
        err = cu.cuMemAlloc(16)[0]
        if err == OK:  # a synchronization of their own stream is as unsafe as an allocation
            check(cu.cuStreamSynchronize(theirs))
        return err

    err = _on_another_thread(context, their_session)
    assert (err == OK) == (mode != "GLOBAL"), err
    out = (ctypes.c_uint32 * 4)()
    result = cu.cuStreamEndCapture(mine)
    if mode == "GLOBAL":
        assert result[0] == cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, result[0]
        return
    graph = check(result)
    check(cu.cuMemcpyDtoH(out, other, 16))
    assert list(out) == [5] * 4  # their work ran at once
    check(cu.cuMemcpyDtoH(out, memory, 16))
    assert list(out) != [7] * 4  # the captured fill has not run yet
    executable = check(cu.cuGraphInstantiate(graph, 0))
    check(cu.cuGraphLaunch(executable, mine))
    check(cu.cuStreamSynchronize(mine))
    check(cu.cuMemcpyDtoH(out, memory, 16))
    assert list(out) == [7] * 4


@pytest.mark.parametrize("mode", ["THREAD_LOCAL", "RELAXED"])
def test_the_capturing_threads_own_allocation_breaks_only_a_thread_local_capture(streams, mode):
    _context, mine, _theirs, fill = streams
    memory = check(cu.cuMemAlloc(16))
    check(cu.cuStreamBeginCapture(mine, getattr(MODES, f"CU_STREAM_CAPTURE_MODE_{mode}")))
    fill(memory, 1, mine)
    err = cu.cuMemAlloc(16)[0]
    result = cu.cuStreamEndCapture(mine)
    if mode == "THREAD_LOCAL":
        assert err == cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, err
        assert result[0] == cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, result[0]
    else:
        assert err == OK and result[0] == OK, (err, result[0])
