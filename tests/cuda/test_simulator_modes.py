"""The simulator's options that make ordering and fault bugs visible: deferred stream execution with events
honoured, page-locked host memory, sticky errors, and shuffled block order (see sim/driver.py's docstring).

Each test switches its option on through ``configure`` (the environment variables do the same for a whole
run) and checks the behaviour a GPU has and the immediate simulator hides.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

OK = cu.CUresult.CUDA_SUCCESS
NON_BLOCKING = cu.CUstream_flags.CU_STREAM_NON_BLOCKING

KERNELS = r"""
extern "C" __global__ void fill_f32(float* y, float value, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = value;
}

extern "C" __global__ void add_f32(const float* x, float* y, float value, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + value;
}

// Each block takes a ticket in the order blocks run: the permutation a launch used.
extern "C" __global__ void block_tickets(unsigned int* counter, unsigned int* order) {
    if (threadIdx.x == 0) order[blockIdx.x] = atomicAdd(counter, 1u);
}

extern "C" __global__ void write_at(float* p) { *p = 1.0f; }
"""


def check(result):
    err, *values = result
    assert err == OK, f"{err!r}: {cu.last_error_message()}"
    return values[0] if len(values) == 1 else tuple(values) if values else None


def fails(result, code):
    err, *values = result
    assert err == code, f"expected {code!r}, got {err!r} ({cu.last_error_message()})"
    return cu.last_error_message()


class Device:
    def __init__(self, **options):
        cu.reset()
        cu.configure(**options)
        check(cu.cuInit(0))
        self.dev = check(cu.cuDeviceGet(0))
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev))
        check(cu.cuCtxSetCurrent(self.ctx))
        self.module = check(cu.cuModuleLoadData(cu.make_image(KERNELS, [])))
        self.a = check(cu.cuStreamCreate(NON_BLOCKING))
        self.b = check(cu.cuStreamCreate(NON_BLOCKING))

    def function(self, name):
        return check(cu.cuModuleGetFunction(self.module, name.encode()))

    def launch(self, name, grid, stream, *args):
        values = tuple(int(v) if isinstance(v, cu.CUdeviceptr) else v for v, _ in args)
        types = tuple(t for _, t in args)
        return cu.cuLaunchKernel(self.function(name), grid, 1, 1, 32, 1, 1, 0, stream, (values, types), 0)

    def fill(self, ptr, value, n, stream):
        check(self.launch("fill_f32", -(-n // 32), stream, (int(ptr), ctypes.c_void_p), (value, ctypes.c_float),
                          (n, ctypes.c_int)))


@pytest.fixture(autouse=True)
def fresh_simulator():
    yield
    cu.reset()  # options and state back to the environment's defaults for the next test


def pinned(nbytes):
    address = check(cu.cuMemHostAlloc(nbytes, 0))
    return address, np.ctypeslib.as_array((ctypes.c_float * (nbytes // 4)).from_address(address))


def test_deferred_work_runs_only_at_a_synchronization_point():
    device = Device(deferred=True)
    n = 64
    y = check(cu.cuMemAllocAsync(4 * n, device.a))
    address, host = pinned(4 * n)
    host[:] = 0
    device.fill(y, 3.0, n, device.a)
    check(cu.cuMemcpyDtoHAsync(address, y, 4 * n, device.a))
    assert (host == 0).all()  # a missing synchronization shows: nothing ran yet
    event = check(cu.cuEventCreate(0))
    check(cu.cuEventRecord(event, device.a))
    fails(cu.cuEventQuery(event), cu.CUresult.CUDA_ERROR_NOT_READY)
    fails(cu.cuStreamQuery(device.a), cu.CUresult.CUDA_ERROR_NOT_READY)
    check(cu.cuEventSynchronize(event))
    assert (host == 3.0).all()
    check(cu.cuEventQuery(event))
    check(cu.cuMemFreeAsync(y, device.a))
    check(cu.cuStreamSynchronize(device.a))
    check(cu.cuMemFreeHost(address))


def test_a_copy_to_pageable_memory_waits_for_its_stream_only():
    device = Device(deferred=True)
    n = 32
    x = check(cu.cuMemAlloc(4 * n))
    y = check(cu.cuMemAlloc(4 * n))
    device.fill(x, 5.0, n, device.a)  # stream a, never synchronized
    device.fill(y, 7.0, n, device.b)
    out = np.zeros(n, np.float32)
    check(cu.cuMemcpyDtoHAsync(out, y, 4 * n, device.b))  # pageable: returns once stream b ran up to it
    assert (out == 7.0).all()
    check(cu.cuMemcpyDtoHAsync(out, x, 4 * n, device.b))  # but stream a's fill is still queued
    assert not (out == 5.0).any()
    check(cu.cuCtxSynchronize())
    check(cu.cuMemFree(x))
    check(cu.cuMemFree(y))


def test_events_order_work_across_streams():
    for wait in (True, False):
        device = Device(deferred=True)
        n = 32
        x = check(cu.cuMemAlloc(4 * n))
        y = check(cu.cuMemAlloc(4 * n))
        check(cu.cuMemsetD32(x, 0, n))
        device.fill(x, 2.0, n, device.a)
        done = check(cu.cuEventCreate(0))
        check(cu.cuEventRecord(done, device.a))
        if wait:
            check(cu.cuStreamWaitEvent(device.b, done, 0))
        check(device.launch("add_f32", 1, device.b, (int(x), ctypes.c_void_p), (int(y), ctypes.c_void_p),
                            (1.0, ctypes.c_float), (n, ctypes.c_int)))
        check(cu.cuStreamSynchronize(device.b))  # stream a is synchronized only through the event
        out = np.empty(n, np.float32)
        check(cu.cuMemcpyDtoHAsync(out, y, 4 * n, device.b))
        # With the wait, b's kernel saw a's fill; without it, the read raced ahead and saw the zeros.
        assert (out == (3.0 if wait else 1.0)).all(), (wait, out[:4])
        check(cu.cuCtxSynchronize())
        cu.reset()


def test_pageable_sources_are_read_at_issue_and_pinned_ones_when_the_copy_runs():
    device = Device(deferred=True)
    n = 16
    d = check(cu.cuMemAlloc(4 * n))
    pageable = np.full(n, 1.0, np.float32)
    check(cu.cuMemcpyHtoDAsync(d, pageable, 4 * n, device.a))
    pageable[:] = 2.0  # the driver staged the old bytes already
    out = np.empty(n, np.float32)
    check(cu.cuMemcpyDtoHAsync(out, d, 4 * n, device.a))
    assert (out == 1.0).all()
    address, staging = pinned(4 * n)
    staging[:] = 4.0
    check(cu.cuMemcpyHtoDAsync(d, address, 4 * n, device.a))
    staging[:] = 8.0  # rewriting a pinned block before its copy ran: the bug a missing event shows
    check(cu.cuMemcpyDtoHAsync(out, d, 4 * n, device.a))
    assert (out == 8.0).all()
    check(cu.cuMemFreeHost(address))
    check(cu.cuMemFree(d))


def test_page_locked_memory_is_freed_exactly_once():
    Device()
    address = check(cu.cuMemHostAlloc(4096, cu.CU_MEMHOSTALLOC_PORTABLE))
    assert cu.live_host_allocations() == {address: 4096}
    check(cu.cuMemFreeHost(address))
    assert "double free" in fails(cu.cuMemFreeHost(address), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert cu.live_host_allocations() == {}
    buffer = np.zeros(1024, np.uint8)
    check(cu.cuMemHostRegister(buffer.ctypes.data, buffer.nbytes, 0))
    fails(cu.cuMemHostRegister(buffer.ctypes.data, 16, 0), cu.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    check(cu.cuMemHostUnregister(buffer.ctypes.data))
    fails(cu.cuMemHostUnregister(buffer.ctypes.data), cu.CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_kernel_fault_is_sticky_until_the_context_is_reset(deferred):
    device = Device(deferred=deferred, sticky_errors=True)
    result = device.launch("write_at", 1, device.a, (16, ctypes.c_void_p))  # an address nothing maps
    if deferred:
        check(result)  # reported later, by the call that waits for it
        message = fails(cu.cuStreamSynchronize(device.a), cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    else:
        message = fails(result, cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    assert "write_at" in message
    # Every later call fails the same way, even ones that have nothing to do with the kernel.
    fails(cu.cuMemAlloc(16), cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    fails(cu.cuStreamSynchronize(device.b), cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    assert "unusable" in cu.last_error_message()
    check(cu.cuGetErrorName(cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS))  # still answered
    check(cu.cuDevicePrimaryCtxReset(device.dev))
    ctx = check(cu.cuDevicePrimaryCtxRetain(device.dev))
    check(cu.cuCtxSetCurrent(ctx))
    check(cu.cuMemFree(check(cu.cuMemAlloc(16))))


def test_without_sticky_errors_a_fault_is_reported_once():
    device = Device()  # the default: tests that provoke faults one after another keep working
    fails(device.launch("write_at", 1, device.a, (16, ctypes.c_void_p)), cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    check(cu.cuMemFree(check(cu.cuMemAlloc(16))))


def test_shuffled_blocks_run_in_a_seeded_permutation():
    blocks = 100
    orders = {}
    for seed in (0, 7, 7, 8):
        device = Device(shuffle_blocks=seed)
        counter = check(cu.cuMemAlloc(4))
        order = check(cu.cuMemAlloc(4 * blocks))
        check(cu.cuMemsetD32(counter, 0, 1))
        check(device.launch("block_tickets", blocks, device.a, (int(counter), ctypes.c_void_p),
                            (int(order), ctypes.c_void_p)))
        out = np.empty(blocks, np.uint32)
        check(cu.cuMemcpyDtoH(out, order, out.nbytes))
        assert sorted(out.tolist()) == list(range(blocks))  # every block ran exactly once
        orders.setdefault(seed, []).append(out.tolist())
        check(cu.cuMemFree(counter))
        check(cu.cuMemFree(order))
    assert orders[0][0] == list(range(blocks))  # row-major by default
    assert orders[7][0] != list(range(blocks))
    assert orders[7][0] == orders[7][1]  # reproducible from the seed
    assert orders[8][0] != orders[7][0]


def test_deferred_launches_capture_and_replay_in_stream_order():
    device = Device(deferred=True)
    n = 32
    x = check(cu.cuMemAlloc(4 * n))
    device.fill(x, 1.0, n, device.a)  # queued before the capture: runs before the graph's launch
    check(cu.cuStreamBeginCapture(device.a, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    check(device.launch("add_f32", 1, device.a, (int(x), ctypes.c_void_p), (int(x), ctypes.c_void_p),
                        (1.0, ctypes.c_float), (n, ctypes.c_int)))
    graph = check(cu.cuStreamEndCapture(device.a))
    executable = check(cu.cuGraphInstantiate(graph, 0))
    for _ in range(3):
        check(cu.cuGraphLaunch(executable, device.a))
    out = np.empty(n, np.float32)
    check(cu.cuMemcpyDtoHAsync(out, x, 4 * n, device.a))
    assert (out == 4.0).all()
    check(cu.cuGraphExecDestroy(executable))
    check(cu.cuGraphDestroy(graph))
    check(cu.cuMemFree(x))
