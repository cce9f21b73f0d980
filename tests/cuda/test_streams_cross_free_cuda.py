"""Frees across streams: pooled memory freed on a stream other than the one it was allocated on (its home) must
wait for the home stream's queued work, or the pool hands it out (a GPU) or unmaps it (the simulator) while a
kernel still uses it. The simulator's deferred mode shows the bug; CudaDevice.free orders such a free after an
event recorded on the home stream, waited on exactly once."""

from __future__ import annotations

import ctypes

import pytest

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

OK = cu.CUresult.CUDA_SUCCESS
NON_BLOCKING = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
FILL = r"""
extern "C" __global__ void fill_f32(float* y, float value, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}
"""
N = 64


def check(result):
    err, *values = result
    assert err == OK, f"{err!r}: {cu.last_error_message()}"
    return values[0] if len(values) == 1 else tuple(values) if values else None


@pytest.fixture
def raw():
    """The simulated driver alone, deferred, with two streams and the fill kernel; reset afterwards."""
    cu.reset()
    cu.configure(deferred=True)
    check(cu.cuInit(0))
    context = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(context))
    module = check(cu.cuModuleLoadData(cu.make_image(FILL, [])))
    function = check(cu.cuModuleGetFunction(module, b"fill_f32"))
    a, b = check(cu.cuStreamCreate(NON_BLOCKING)), check(cu.cuStreamCreate(NON_BLOCKING))

    def fill(pointer, stream):
        return cu.cuLaunchKernel(function, 2, 1, 1, 32, 1, 1, 0, stream,
                                 ((int(pointer), 1.0, N), (ctypes.c_void_p, ctypes.c_float, ctypes.c_int)), 0)

    yield a, b, fill
    cu.reset()


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "event-ordered"])
def test_the_simulator_reports_a_kernel_on_memory_another_stream_freed(raw, ordered):
    a, b, fill = raw
    memory = check(cu.cuMemAllocAsync(4 * N, a))
    check(fill(memory, a))  # queued on a: nothing ran yet
    if ordered:  # what CudaDevice.free does for a free away from the home stream
        event = check(cu.cuEventCreate(0))
        check(cu.cuEventRecord(event, a))
        check(cu.cuStreamWaitEvent(b, event, 0))
    check(cu.cuMemFreeAsync(memory, b))
    check(cu.cuStreamSynchronize(b))  # b reaches its free first
    (err,) = cu.cuStreamSynchronize(a)
    if ordered:
        assert err == OK, cu.last_error_message()
    else:  # the fill ran on unmapped memory: a use after free, reported as a GPU reports an illegal access
        assert err != OK and "fill_f32" in cu.last_error_message(), (err, cu.last_error_message())


def test_a_free_away_from_the_home_stream_waits_for_it_once(cuda_driver_mode):
    from onnx_runtime_ep_cuda import CudaDevice

    device = CudaDevice.get(0)
    previous = cu.configure(deferred=True)
    home = check(device.driver.cuStreamCreate(NON_BLOCKING))
    try:
        waits, frees = [], device.cross_stream_frees
        address, base = device.allocate(4 * N, stream=home)
        device.fill(address, 4 * N, 0x3F, stream=home)  # queued on the home stream
        wait = device.driver.cuStreamWaitEvent

        def counted(*args):
            waits.append(args)
            return wait(*args)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(device.driver, "cuStreamWaitEvent", counted)
            device.free(base)  # on the compute stream: ordered after the home stream's fill
        assert len(waits) == 1 and device.cross_stream_frees == frees + 1
        check(device.driver.cuStreamSynchronize(device.compute))  # runs the home stream up to the fill, then frees
        check(device.driver.cuStreamSynchronize(home))
        _same, base_same = device.allocate(4 * N)  # compute-homed memory freed on compute needs no wait
        device.free(base_same)
        assert device.cross_stream_frees == frees + 1
        keep, keep_base = device.allocate(4, stream=home)
        device.fill(keep, 4, 0x11, stream=home)
        device.free(keep_base, stream=home)  # freed at home: no wait
        assert device.cross_stream_frees == frees + 1
        check(device.driver.cuStreamSynchronize(home))
    finally:
        device.sync()
        check(device.driver.cuStreamSynchronize(home))
        check(device.driver.cuStreamDestroy(home))
        cu.configure(**previous)
