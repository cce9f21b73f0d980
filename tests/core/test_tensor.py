"""Tensor: owned and device-aware, numpy in and out, DLPack, clones, zeros, raw bits, overflow."""

from __future__ import annotations

import gc
import weakref

import ml_dtypes
import numpy as np
import onnx_runtime as ort
import pytest
from onnx_runtime import DataType, Tensor
from onnx_runtime.discovery import registry
from onnx_runtime.errors import InvalidArgumentError, NotSupportedError, ShapeOverflowError
from onnx_runtime.host import host_allocator

DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.int64,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.int4,
    ml_dtypes.uint4,
    ml_dtypes.int2,
    ml_dtypes.uint2,
    ml_dtypes.float4_e2m1fn,
    ml_dtypes.float8_e8m0fnu,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_round_trip_for_every_onnx_type(dtype):
    source = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    with Tensor.from_numpy(source) as tensor:
        assert tensor.dtype is DataType.from_numpy(np.dtype(dtype))
        assert tensor.shape == (3, 4) and tensor.numel == 12
        assert tensor.as_bytes() == source.tobytes()
        assert tensor.numpy().dtype == np.dtype(dtype)
        assert tensor.device == ort.DeviceId.cpu() and tensor.device_ptr % 64 == 0


def test_strings_live_on_the_host():
    tensor = Tensor.from_numpy(np.array(["a", "bc"], dtype=object))
    assert tensor.dtype is DataType.STRING and tensor.numpy().tolist() == ["a", "bc"]
    with pytest.raises(InvalidArgumentError, match="no raw byte form"):
        tensor.as_bytes()


def test_zeros_are_zero_even_over_dirty_memory():
    Tensor.from_raw(DataType.FLOAT, [2, 8], b"\xab" * 64).close()
    zeroed = Tensor.zeros(DataType.FLOAT, [2, 8])
    assert zeroed.numpy().tolist() == [[0.0] * 8] * 2


def test_zero_element_tensors_are_valid():
    empty = Tensor.zeros("float32", [1, 8, 0, 4])
    assert empty.shape == (1, 8, 0, 4) and empty.numpy().size == 0 and empty.device_ptr == 0 and empty.nbytes == 0


def test_from_raw_checks_the_byte_count_and_geometry_overflow():
    with pytest.raises(InvalidArgumentError, match="3 bytes given for shape \\(1,\\) of FLOAT; expected 4"):
        Tensor.from_raw(DataType.FLOAT, [1], b"abc")
    with pytest.raises(ShapeOverflowError):
        Tensor.from_raw(DataType.FLOAT, [2**62, 4], b"")
    with pytest.raises(ShapeOverflowError):
        Tensor.zeros(DataType.DOUBLE, [2**61, 2**3])
    with pytest.raises(InvalidArgumentError, match="negative"):
        Tensor.zeros(DataType.FLOAT, [2, -1])


def test_raw_bits_of_half_and_bfloat16():
    half = Tensor.from_raw(DataType.FLOAT16, [2], np.array([0x3C00, 0x4000], np.uint16).tobytes())
    assert half.raw_bits().tolist() == [0x3C00, 0x4000] and half.numpy().tolist() == [1.0, 2.0]
    bf16 = Tensor.from_numpy(np.array([1.0, -2.0], ml_dtypes.bfloat16))
    assert bf16.raw_bits().tolist() == [0x3F80, 0xC000]
    with pytest.raises(InvalidArgumentError, match="float16 or bfloat16"):
        Tensor.zeros("float32", [1]).raw_bits()


def test_try_clone_is_deep():
    tensor = Tensor.from_numpy(np.arange(4, dtype=np.float32).reshape(2, 2))
    clone = tensor.try_clone()
    assert clone.dtype is tensor.dtype and clone.shape == tensor.shape and clone.as_bytes() == tensor.as_bytes()
    assert clone.device_ptr != tensor.device_ptr
    tensor.numpy()[0, 0] = 42
    assert clone.numpy()[0, 0] == 0


def test_close_frees_exactly_once_through_the_provider():
    host = host_allocator()
    before = host.allocation_counts()
    tensor = Tensor.zeros("float32", [16])
    buffer = tensor.buffer
    tensor.close()
    tensor.close()  # idempotent
    after = host.allocation_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert buffer.released and tensor.closed
    with pytest.raises(InvalidArgumentError, match="closed"):
        tensor.numpy()
    with pytest.raises(InvalidArgumentError, match="already freed"):
        host.deallocate(buffer)


def test_garbage_collection_frees_once():
    host = host_allocator()
    before = host.allocation_counts()
    Tensor.zeros("int64", [3])
    gc.collect()
    after = host.allocation_counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)


def test_dlpack_import_is_zero_copy_and_releases_the_guard_exactly_once():
    source = np.arange(6, dtype=np.float32)
    alive = weakref.ref(source)
    host = host_allocator()
    before = host.allocation_counts()
    tensor = Tensor.from_dlpack(source)
    assert tensor.is_borrowed and tensor.device_ptr == source.ctypes.data  # aliases, no copy
    source[0] = 100.0
    assert tensor.numpy()[0] == 100.0
    del source
    gc.collect()
    assert alive() is not None  # the import guard keeps the producer's memory alive
    tensor.close()
    gc.collect()
    assert alive() is None  # guard released: the producer's deleter ran
    assert host.allocation_counts() == before  # a borrowed buffer is never allocated or freed here


def test_dlpack_export_shares_memory():
    tensor = Tensor.from_numpy(np.arange(5, dtype=np.int32))
    assert tensor.__dlpack_device__() == (1, 0)
    view = np.from_dlpack(tensor)
    assert view.ctypes.data == tensor.device_ptr and view.tolist() == [0, 1, 2, 3, 4]
    tensor.close()
    assert view.tolist() == [0, 1, 2, 3, 4]  # the exported view keeps the bytes alive


def test_dlpack_rejects_non_dlpack_objects():
    with pytest.raises(InvalidArgumentError, match="does not implement __dlpack__"):
        Tensor.from_dlpack([1, 2, 3])


@pytest.fixture
def device():
    handle = registry().require("sample").create()
    handle.initialize({})
    yield handle
    handle.shutdown()


def test_a_tensor_on_a_non_host_device(device):
    source = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = Tensor.from_numpy(source, provider=device)
    assert tensor.device == device.device_id and not tensor.device.is_host_accessible
    assert tensor.buffer.host is None  # the host cannot read it directly
    np.testing.assert_array_equal(tensor.numpy(), source)  # numpy() downloads a copy
    clone = tensor.try_clone()
    np.testing.assert_array_equal(clone.numpy(), source)
    assert Tensor.zeros("float32", [4], provider=device).numpy().tolist() == [0, 0, 0, 0]
    assert tensor.__dlpack_device__() == (12, 7)  # kDLExtDev
    with pytest.raises(NotSupportedError, match="DLPack export of a tensor on other:7"):
        tensor.__dlpack__()
    allocations, frees = device.allocation_counts()
    tensor.close()
    clone.close()
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations == frees == 3
