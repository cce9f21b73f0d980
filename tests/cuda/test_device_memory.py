"""CUDAExecutionProvider memory, copies and fences through a ProviderHandle.

Runs on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``) by default; with ``ONNX_RUNTIME_CUDA_TESTS=real``
the same tests run against the real driver on a GPU machine.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

import ml_dtypes
import numpy as np
import pytest
from onnx_runtime import DeviceId, DeviceType, ProviderHandle, Tensor
from onnx_runtime.contract.buffers import DeviceBuffer, Fence, Ownership
from onnx_runtime.errors import InvalidArgumentError, ProviderError, ProviderNotAvailableError

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda import CUDAExecutionProvider  # noqa: E402

REAL = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() == "real"


def _simulator_missing() -> bool:
    try:
        return importlib.util.find_spec("onnx_runtime_ep_cuda.sim.driver") is None
    except ModuleNotFoundError:  # no sim package at all
        return True


SIM_MISSING = _simulator_missing()


@pytest.fixture
def mode(monkeypatch):
    """The simulator unless the real driver was asked for; skips when the chosen one is not usable."""
    if REAL:
        monkeypatch.delenv(driver.SIM_ENV, raising=False)
    else:
        if SIM_MISSING:
            pytest.skip("the CUDA simulator (onnx_runtime_ep_cuda/sim/driver.py) is not importable")
        monkeypatch.setenv(driver.SIM_ENV, "1")
    reason = driver.probe()
    if reason:
        pytest.skip(f"the CUDA {'driver' if REAL else 'simulator'} is not usable: {reason}")


@pytest.fixture
def handle(mode):
    h = ProviderHandle(CUDAExecutionProvider())
    h.initialize({})
    yield h
    h.shutdown()


def host_buffer(array: np.ndarray, ownership=Ownership.BORROWED_MUT) -> DeviceBuffer:
    return DeviceBuffer.from_host_array(array, DeviceId.cpu(), ownership)


# -- availability ---------------------------------------------------------------------------------
@pytest.fixture
def real_driver_absent(monkeypatch):
    monkeypatch.delenv(driver.SIM_ENV, raising=False)
    monkeypatch.setattr(driver, "_libcuda_present", lambda: False)
    driver._probe.cache_clear()
    yield
    driver._probe.cache_clear()  # forget the faked answer before the real probe comes back


def test_without_a_driver_and_without_the_switch_the_reason_is_given(real_driver_absent):
    availability = ProviderHandle(CUDAExecutionProvider()).availability()
    assert not availability.available
    assert "no NVIDIA driver found (libcuda)" in availability.reason
    with pytest.raises(ProviderNotAvailableError, match="no NVIDIA driver found"):
        ProviderHandle(CUDAExecutionProvider()).initialize({})


def test_the_switched_on_simulator_is_available(monkeypatch):
    if SIM_MISSING:
        pytest.skip("the CUDA simulator (onnx_runtime_ep_cuda/sim/driver.py) is not importable")
    monkeypatch.setenv(driver.SIM_ENV, "1")
    assert driver.load_driver_module().__name__ == "onnx_runtime_ep_cuda.sim.driver"
    assert ProviderHandle(CUDAExecutionProvider()).availability().available


def test_options_are_checked(mode):
    with pytest.raises(InvalidArgumentError, match="does not accept option 'cuda.arena'"):
        ProviderHandle(CUDAExecutionProvider()).initialize({"cuda.arena": "1"})
    with pytest.raises(InvalidArgumentError, match="device_id=99 is out of range"):
        ProviderHandle(CUDAExecutionProvider()).initialize({"device_id": "99"})


# -- allocation and round trips -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int8, np.bool_])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5, 2)])
def test_numpy_round_trip(handle, dtype, shape):
    x = (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 1.5 - 3).astype(dtype)
    with Tensor.from_numpy(x, provider=handle) as t:
        assert t.device == DeviceId(DeviceType.CUDA, 0)
        assert t.buffer.host is None, "device memory is not host-accessible"
        got = t.numpy()
    assert got.dtype == x.dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, x)


def test_device_buffers_are_opaque_and_aligned(handle):
    buffer = handle.allocate(100, 512)
    try:
        assert buffer.ptr % 512 == 0 and buffer.size == 100 and buffer.device == handle.device_id
        with pytest.raises(InvalidArgumentError, match="not host-accessible"):
            buffer.host_view()
    finally:
        handle.deallocate(buffer)


def test_zeros_clone_and_ranged_upload(handle):
    with Tensor.zeros("float32", (4, 4), provider=handle) as zeros:
        np.testing.assert_array_equal(zeros.numpy(), np.zeros((4, 4), np.float32))
        handle.hook.copy_from_host_at(src=np.full(4, 7, np.float32), dst=zeros.buffer, byte_offset=16)
        with zeros.try_clone() as clone:
            expected = np.zeros((4, 4), np.float32)
            expected[1] = 7
            np.testing.assert_array_equal(clone.numpy(), expected)


def test_host_and_device_buffers_mix_in_copy(handle):
    x = np.arange(32, dtype=np.uint8)
    device = handle.allocate(32, 64)
    back = np.zeros(32, np.uint8)
    try:
        handle.hook.copy(src=host_buffer(x), dst=device, size=32)
        handle.hook.copy(src=device, dst=host_buffer(back), size=20)
        np.testing.assert_array_equal(back[:20], x[:20])
        assert not back[20:].any()
    finally:
        handle.deallocate(device)


# -- bounds and ownership -------------------------------------------------------------------------
def test_out_of_bounds_copies_are_refused(handle):
    a, b = handle.allocate(16, 64), handle.allocate(8, 64)
    try:
        with pytest.raises(InvalidArgumentError, match="exceeds the destination's 16 bytes"):
            handle.copy_from_host(np.zeros(17, np.uint8), a)
        with pytest.raises(InvalidArgumentError, match="exceeds the 16-byte buffer"):
            handle.hook.copy_from_host_at(src=b"abcd", dst=a, byte_offset=13)
        with pytest.raises(InvalidArgumentError, match="negative"):
            handle.hook.copy_from_host_at(src=b"abcd", dst=a, byte_offset=-1)
        with pytest.raises(InvalidArgumentError, match="exceeds the source's 8 bytes"):
            handle.copy_to_host(b, np.zeros(9, np.uint8))
        with pytest.raises(InvalidArgumentError, match="exceeds the source"):
            handle.hook.copy(src=b, dst=a, size=9)
        with pytest.raises(InvalidArgumentError, match="exceeds the source"):
            handle.hook.copy_async(src=b, dst=a, size=9)
        with pytest.raises(InvalidArgumentError, match="destination range 4..12 exceeds the 8-byte buffer"):
            handle.hook.copy_device_to_device(src=a, src_offset=0, dst=b, dst_offset=4, nbytes=8)
        with pytest.raises(InvalidArgumentError, match="overlap"):
            handle.hook.copy_device_to_device(src=a, src_offset=0, dst=a, dst_offset=4, nbytes=8)
        with pytest.raises(InvalidArgumentError, match="read-only"):
            handle.copy_from_host(b"ab", a.alias(0, 4))
        with pytest.raises(InvalidArgumentError, match="host destination is read-only"):
            handle.copy_to_host(a, b"immutable")
        with pytest.raises(InvalidArgumentError, match="cuda:3"):
            foreign = DeviceBuffer(DeviceId(DeviceType.CUDA, 3), 8, 64, a.ptr, Ownership.BORROWED)
            handle.copy_to_host(foreign, np.zeros(8, np.uint8))
    finally:
        handle.deallocate(a)
        handle.deallocate(b)
    with pytest.raises(InvalidArgumentError, match="already freed"):
        handle.copy_to_host(a, np.zeros(4, np.uint8))


def test_device_to_device_with_offsets(handle):
    pattern = np.arange(64, dtype=np.uint8)
    src, dst = handle.allocate(64, 64), handle.allocate(64, 64)
    try:
        handle.copy_from_host(pattern, src)
        handle.copy_from_host(np.zeros(64, np.uint8), dst)
        handle.hook.copy_device_to_device(src=src, src_offset=8, dst=dst, dst_offset=16, nbytes=24)
        handle.hook.copy_device_to_device(src=src, src_offset=0, dst=src, dst_offset=40, nbytes=8)
        expected = np.zeros(64, np.uint8)
        expected[16:40] = pattern[8:32]
        np.testing.assert_array_equal(handle.download(dst), expected)
        np.testing.assert_array_equal(handle.download(src)[40:48], pattern[:8])
        handle.hook.copy_device_to_device(src=src, src_offset=0, dst=dst, dst_offset=0, nbytes=0)
    finally:
        handle.deallocate(src)
        handle.deallocate(dst)


# -- fences ---------------------------------------------------------------------------------------
def test_copy_async_then_wait_fence_orders_the_consumer(handle):
    x = np.arange(256, dtype=np.uint8)
    staging, result = handle.allocate(256, 256), handle.allocate(256, 256)
    try:
        fence = handle.hook.copy_async(src=host_buffer(x), dst=staging, size=256)
        assert isinstance(fence, Fence) and not fence.is_signalled
        handle.hook.wait_fence(fence=fence)  # the compute-stream copy below must see the upload
        handle.hook.copy_device_to_device(src=staging, src_offset=0, dst=result, dst_offset=0, nbytes=256)

        # Write-after-read: the transfer that overwrites the staging buffer waits for that compute.
        handle.hook.copy_wait_fence(fence=handle.hook.record_compute_fence())
        refill = handle.hook.copy_async(src=host_buffer(np.zeros(256, np.uint8)), dst=staging, size=256)
        handle.hook.wait_fence(fence=refill)
        np.testing.assert_array_equal(handle.download(result), x)
        assert not handle.download(staging).any()

        back = np.zeros(256, np.uint8)
        done = handle.hook.copy_async(src=result, dst=host_buffer(back), size=256)
        handle.sync()
        np.testing.assert_array_equal(back, x)
        handle.hook.wait_fence(fence=done)  # fences stay valid (and complete) after a sync
        handle.hook.copy_wait_fence(fence=fence)
    finally:
        handle.deallocate(staging)
        handle.deallocate(result)


def test_device_to_device_copy_async_and_trivial_fences(handle):
    src, dst = handle.allocate(32, 64), handle.allocate(32, 64)
    try:
        handle.copy_from_host(np.full(32, 5, np.uint8), src)
        fence = handle.hook.copy_async(src=src, dst=dst, size=32)
        handle.hook.wait_fence(fence=fence)
        np.testing.assert_array_equal(handle.download(dst), np.full(32, 5, np.uint8))
        assert handle.hook.copy_async(src=src, dst=dst, size=0).is_signalled
        handle.hook.wait_fence(fence=Fence(0))
        handle.hook.copy_wait_fence(fence=Fence.signalled())
        with pytest.raises(InvalidArgumentError, match="was not issued"):
            handle.hook.wait_fence(fence=Fence(10**12))
    finally:
        handle.deallocate(src)
        handle.deallocate(dst)


def test_many_fences_without_a_sync_recycle_their_events(handle):
    src, dst = handle.allocate(4, 64), handle.allocate(4, 64)
    device = handle.provider.cuda_device()
    try:
        fences = [handle.hook.copy_async(src=src, dst=dst, size=4) for _ in range(1100)]
        assert len(device._events) <= 1025, "completed events are recycled once 1024 are live"
        for fence in fences:
            handle.hook.wait_fence(fence=fence)
    finally:
        handle.deallocate(src)
        handle.deallocate(dst)


# -- accounting and ownership ---------------------------------------------------------------------
def test_allocation_counters_balance_after_freeing(handle):
    device = handle.provider.cuda_device()
    allocations, frees = handle.allocation_counts()
    in_use = device.bytes_in_use
    tensors = [Tensor.from_numpy(np.ones((8, 8), np.float32), provider=handle) for _ in range(5)]
    after_alloc = handle.allocation_counts()
    assert after_alloc == (allocations + 5, frees)
    assert device.bytes_in_use > in_use
    for tensor in tensors:
        tensor.close()
    assert handle.allocation_counts() == (allocations + 5, frees + 5)
    assert device.bytes_in_use == in_use


def test_double_free_is_refused_by_the_handle(handle):
    buffer = handle.allocate(64, 64)
    handle.deallocate(buffer)
    counts = handle.allocation_counts()
    with pytest.raises(InvalidArgumentError, match="already freed"):
        handle.deallocate(buffer)
    assert handle.allocation_counts() == counts


def test_borrowed_aliases_are_never_freed(handle):
    owner = handle.allocate(64, 64)
    allocations, frees = handle.allocation_counts()
    alias = owner.alias(16, 16, writable=True)
    handle.copy_from_host(np.full(16, 9, np.uint8), alias)
    handle.deallocate(alias)
    assert alias.released and not owner.released
    assert handle.allocation_counts() == (allocations, frees)
    np.testing.assert_array_equal(handle.download(owner)[16:32], np.full(16, 9, np.uint8))
    handle.deallocate(owner)
    assert handle.allocation_counts() == (allocations, frees + 1)


# -- kernels --------------------------------------------------------------------------------------
def test_fill_zeroes_and_splats_aligned_and_unaligned_ranges(handle):
    buffer = handle.allocate(1000, 256)
    try:
        handle.copy_from_host(np.full(1000, 0xEE, np.uint8), buffer)
        handle.provider.fill(buffer, 0)  # whole words: fill_u32
        handle.provider.fill(buffer, 0xAB, offset=3, nbytes=10)  # unaligned: fill_u8
        expected = np.zeros(1000, np.uint8)
        expected[3:13] = 0xAB
        np.testing.assert_array_equal(handle.download(buffer), expected)
    finally:
        handle.deallocate(buffer)


def test_launch_builds_kernel_parameters(handle):
    device = handle.provider.cuda_device()
    copy_rows = device.function(device.load("fill.cu"), "copy_rows")
    src = np.arange(24, dtype=np.uint8)
    a, b = handle.allocate(24, 64), handle.allocate(12, 64)
    try:
        handle.copy_from_host(src, a)
        # Rows 0..2 of 4 bytes out of an 8-byte pitch: a strided gather into a packed buffer.
        device.launch(copy_rows, (2, 1), (8,), [(a.ptr, ctypes.c_void_p), ctypes.c_int64(8), (b.ptr, ctypes.c_void_p),
                                                (4, ctypes.c_int64), (4, ctypes.c_int64), (3, ctypes.c_int64)])
        np.testing.assert_array_equal(handle.download(b), src.reshape(3, 8)[:, :4].reshape(-1))
        with pytest.raises(InvalidArgumentError, match="grid must be"):
            device.launch(copy_rows, (0,), 8, [])
    finally:
        handle.deallocate(a)
        handle.deallocate(b)


def test_a_kernel_that_does_not_compile_names_its_file_and_line(handle, tmp_path):
    (tmp_path / "broken_kernel.cu").write_text('extern "C" __global__ void broken(int* x) {\n    x[0] = ;\n}\n')
    with pytest.raises(ProviderError, match=r"broken_kernel\.cu[(:]2") as caught:
        handle.provider.cuda_device().load(tmp_path / "broken_kernel.cu")
    assert "error" in str(caught.value)
