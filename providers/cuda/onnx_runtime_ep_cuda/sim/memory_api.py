"""Simulated driver calls: device memory (allocation, the stream-ordered pool, copies, memsets) and
page-locked host memory."""

from __future__ import annotations

import ctypes

from .contexts import _device
from .execution import _capturing, _check_legacy, _dispatch, _drain_all, _submit, _unsafe_while_capturing
from .memory import Allocation
from .state import _api, _device_range, _Fail, _host_buffer, _state, _stream, _value
from .types import (
    CU_MEMHOSTALLOC_DEVICEMAP,
    CU_MEMHOSTALLOC_PORTABLE,
    CU_MEMHOSTALLOC_WRITECOMBINED,
    MEMORY_ENV,
    CUdeviceptr,
    CUmemoryPool,
    CUmemorytype,
    CUmemPool_attribute,
    CUresult,
    cuuint64_t,
)

# ---- memory ------------------------------------------------------------------------------------------------------


def _allocate(size) -> Allocation:
    size = int(size)
    if size <= 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "allocation size must be positive")
    allocation = _state.memory.allocate(size)
    if allocation is None:
        free = _state.memory.capacity - _state.memory.mapped
        raise _Fail(CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"{size} bytes requested, {free} of "
                    f"{_state.memory.capacity} free (set {MEMORY_ENV} to simulate a larger device)")
    return allocation


def _free(dptr, call: str) -> None:
    address = _value(dptr)
    allocation = _state.memory.at(address)
    if allocation is None or not allocation.live or allocation.free_pending:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"{call}: {address:#x} is not the start of a live allocation (double free or foreign pointer)")
    allocation.live = False
    if not allocation.graph_refs:
        _state.memory.release(allocation)


@_api(1, context=True)
def cuMemAlloc(bytesize):
    _unsafe_while_capturing("cuMemAlloc")
    return CUdeviceptr(_allocate(bytesize).address)


@_api(context=True)
def cuMemFree(dptr):
    if _value(dptr) == 0:
        return
    _unsafe_while_capturing("cuMemFree")
    _drain_all()  # cuMemFree waits for the device: work still queued may use the memory
    _free(dptr, "cuMemFree")


@_api(1)
def cuMemAllocAsync(bytesize, hStream):
    stream = _stream(hStream)
    capture = _capturing(stream)
    if capture is None:
        _check_legacy(stream, "cuMemAllocAsync")
    allocation = _allocate(bytesize)
    allocation.pooled = True
    _pool_used()
    if capture is not None:
        allocation.captured = True
        capture.allocations.append(allocation)
        capture.record(stream, ("alloc", allocation))
    return CUdeviceptr(allocation.address)


@_api()
def cuMemFreeAsync(dptr, hStream):
    stream = _stream(hStream)
    address = _value(dptr)
    allocation = _state.memory.at(address)
    if allocation is None or not allocation.live or allocation.free_pending:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemFreeAsync: {address:#x} is not the start of a live allocation (double free or foreign "
                    f"pointer)")
    capture = _capturing(stream)
    if capture is None:
        _check_legacy(stream, "cuMemFreeAsync")
        if _state.deferred and stream is not _state.legacy:  # freed when the stream reaches it
            allocation.free_pending = True
            _dispatch(stream, ("release", allocation), "cuMemFreeAsync")
            return
        _free(dptr, "cuMemFreeAsync")
        return
    capture.record(stream, ("free", allocation))
    if allocation in capture.allocations:
        allocation.live = False  # the graph's own memory: gone for the rest of the capture


@_api(1)
def cuDeviceGetDefaultMemPool(dev):
    _device(dev)
    return CUmemoryPool(_state.pool_handle)


cuDeviceGetMemPool = cuDeviceGetDefaultMemPool


def _pool(pool, attr) -> CUmemPool_attribute:
    if _value(pool) != _state.pool_handle:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{_value(pool):#x} is not the device's memory pool")
    try:
        return CUmemPool_attribute(int(attr))
    except ValueError:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"memory pool attribute {int(attr)} is not simulated") from None


def _pool_used() -> int:
    used = sum(a.size for a in _state.memory.live_allocations() if a.pooled)
    _state.pool_used_high = max(_state.pool_used_high, used)
    return used


@_api(1)
def cuMemPoolGetAttribute(pool, attr):
    """The simulated pool keeps nothing in reserve: reserved memory is the memory in use."""
    attr = _pool(pool, attr)
    if attr in _state.pool_flags:
        return _state.pool_flags[attr]
    used = _pool_used()
    values = {
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: _state.pool_threshold,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: used,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT: used,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: _state.pool_used_high,
        CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH: _state.pool_used_high,
    }
    return cuuint64_t(values[attr])


@_api()
def cuMemPoolSetAttribute(pool, attr, value):
    attr = _pool(pool, attr)
    if attr in _state.pool_flags:
        _state.pool_flags[attr] = int(value)
    elif attr == CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        _state.pool_threshold = int(value)
    elif attr in (CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                  CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH) and int(value) == 0:
        _state.pool_used_high = 0  # resetting the high-water mark is the only write CUDA allows
        _pool_used()
    else:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{attr.name} cannot be set to {int(value)}")


@_api()
def cuMemPoolTrimTo(pool, minBytesToKeep):
    _pool(pool, CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)


@_api(2, context=True)
def cuMemGetInfo():
    memory = _state.memory
    return memory.capacity - memory.mapped, memory.capacity


@_api(2)
def cuMemGetAddressRange(dptr):
    allocation = _state.memory.containing(_value(dptr))
    if allocation is None:
        raise _Fail(CUresult.CUDA_ERROR_NOT_FOUND, f"{_value(dptr):#x} is not inside a live allocation")
    return CUdeviceptr(allocation.address), allocation.size


def _copy(direction: str, dst, src, nbytes, stream, call: str, sync: bool) -> None:
    nbytes = int(nbytes)
    if sync:
        _state.require_context()
        _unsafe_while_capturing(call)
    if nbytes == 0:
        return
    keep = None
    if direction == "htod":
        keep, src = src, _host_buffer(src, nbytes, writable=False)
        dst = _device_range(dst, nbytes, "destination")
    elif direction == "dtoh":
        keep, dst = dst, _host_buffer(dst, nbytes, writable=True)
        src = _device_range(src, nbytes, "source")
    else:
        src, dst = _device_range(src, nbytes, "source"), _device_range(dst, nbytes, "destination")
    handle = _stream(stream)
    pageable = _state.deferred and handle.capture is None and direction != "dtod" and \
        not _state.is_pinned(src if direction == "htod" else dst, nbytes)
    if pageable and direction == "htod":  # the driver stages pageable memory at issue time
        keep = ctypes.create_string_buffer(ctypes.string_at(src, nbytes), nbytes)
        src = ctypes.addressof(keep)
    _dispatch(handle, ("copy", direction, dst, src, nbytes, keep), call, host_waits=pageable and direction == "dtoh")


@_api()
def cuMemcpyHtoD(dstDevice, srcHost, ByteCount):
    _copy("htod", dstDevice, srcHost, ByteCount, 0, "cuMemcpyHtoD", True)


@_api()
def cuMemcpyDtoH(dstHost, srcDevice, ByteCount):
    _copy("dtoh", dstHost, srcDevice, ByteCount, 0, "cuMemcpyDtoH", True)


@_api()
def cuMemcpyDtoD(dstDevice, srcDevice, ByteCount):
    _copy("dtod", dstDevice, srcDevice, ByteCount, 0, "cuMemcpyDtoD", True)


@_api()
def cuMemcpyHtoDAsync(dstDevice, srcHost, ByteCount, hStream):
    _copy("htod", dstDevice, srcHost, ByteCount, hStream, "cuMemcpyHtoDAsync", False)


@_api()
def cuMemcpyDtoHAsync(dstHost, srcDevice, ByteCount, hStream):
    _copy("dtoh", dstHost, srcDevice, ByteCount, hStream, "cuMemcpyDtoHAsync", False)


@_api()
def cuMemcpyDtoDAsync(dstDevice, srcDevice, ByteCount, hStream):
    _copy("dtod", dstDevice, srcDevice, ByteCount, hStream, "cuMemcpyDtoDAsync", False)


@_api()
def cuMemcpy2DAsync(pCopy, hStream):
    """A pitched copy between device memory (the simulator's subset: device to device, no arrays)."""
    device = CUmemorytype.CU_MEMORYTYPE_DEVICE
    if pCopy.srcMemoryType != device or pCopy.dstMemoryType != device:
        raise _Fail(CUresult.CUDA_ERROR_NOT_SUPPORTED, "the simulator copies 2-D regions between device memory only")
    width, height = int(pCopy.WidthInBytes), int(pCopy.Height)
    src_pitch, dst_pitch = int(pCopy.srcPitch), int(pCopy.dstPitch)
    if height > 1 and (src_pitch < width or dst_pitch < width):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_PITCH_VALUE, f"pitches {src_pitch}/{dst_pitch} under the width {width}")
    if width == 0 or height == 0:
        return
    src = _value(pCopy.srcDevice) + int(pCopy.srcY) * src_pitch + int(pCopy.srcXInBytes)
    dst = _value(pCopy.dstDevice) + int(pCopy.dstY) * dst_pitch + int(pCopy.dstXInBytes)
    _device_range(src, (height - 1) * src_pitch + width, "source")
    _device_range(dst, (height - 1) * dst_pitch + width, "destination")
    _dispatch(_stream(hStream), ("copy2d", dst, dst_pitch, src, src_pitch, width, height), "cuMemcpy2DAsync")


def _memset(dst, value: int, width: int, count, stream, call: str, sync: bool) -> None:
    count = int(count)
    address = _value(dst)
    if sync:
        _state.require_context()
        _unsafe_while_capturing(call)
    if address % width:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{call}: {address:#x} is not {width}-byte aligned")
    if count == 0:
        return
    _device_range(address, width * count, "memset")
    _submit(stream, ("memset", address, int(value) & ((1 << (8 * width)) - 1), width, count), call)


@_api()
def cuMemsetD8(dstDevice, uc, N):
    _memset(dstDevice, uc, 1, N, 0, "cuMemsetD8", True)


@_api()
def cuMemsetD16(dstDevice, us, N):
    _memset(dstDevice, us, 2, N, 0, "cuMemsetD16", True)


@_api()
def cuMemsetD32(dstDevice, ui, N):
    _memset(dstDevice, ui, 4, N, 0, "cuMemsetD32", True)


@_api()
def cuMemsetD8Async(dstDevice, uc, N, hStream):
    _memset(dstDevice, uc, 1, N, hStream, "cuMemsetD8Async", False)


@_api()
def cuMemsetD16Async(dstDevice, us, N, hStream):
    _memset(dstDevice, us, 2, N, hStream, "cuMemsetD16Async", False)


@_api()
def cuMemsetD32Async(dstDevice, ui, N, hStream):
    _memset(dstDevice, ui, 4, N, hStream, "cuMemsetD32Async", False)


# ---- page-locked host memory ---------------------------------------------------------------------------------


@_api(1, context=True)
def cuMemHostAlloc(bytesize, Flags):
    size = int(bytesize)
    if size <= 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc size must be positive")
    if int(Flags) & ~(CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"cuMemHostAlloc flags {int(Flags):#x} are not valid")
    buffer = (ctypes.c_uint8 * size)()
    ctypes.memset(buffer, 0xFF, size)  # like device memory: never reads as zeros by accident
    address = ctypes.addressof(buffer)
    _state.host_allocations[address] = buffer
    _state.pinned[address] = size
    return address


@_api(context=True)
def cuMemFreeHost(p):
    address = _value(p)
    if address not in _state.host_allocations:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"cuMemFreeHost: {address:#x} is not a live cuMemHostAlloc allocation (double free or foreign "
                    f"pointer)")
    _drain_all()  # freeing page-locked memory waits for the device, as cudaFreeHost does
    del _state.host_allocations[address]
    del _state.pinned[address]


@_api(context=True)
def cuMemHostRegister(p, bytesize, Flags):
    address, size = _value(p), int(bytesize)
    if not address or size <= 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemHostRegister needs a non-null range")
    if any(start < address + size and address < start + length for start, length in _state.pinned.items()):
        raise _Fail(CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
                    f"[{address:#x}, +{size}) overlaps page-locked memory")
    _state.pinned[address] = size
    _state.registered.add(address)


@_api(context=True)
def cuMemHostUnregister(p):
    address = _value(p)
    if address not in _state.registered:
        raise _Fail(CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, f"{address:#x} was not registered")
    _drain_all()
    _state.registered.discard(address)
    del _state.pinned[address]
