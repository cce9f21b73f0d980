"""Simulated driver calls: initialization, the device, its primary context."""

from __future__ import annotations

from .execution import _drain_all, _unsafe_while_capturing
from .state import _api, _Fail, _state, _value
from .types import (
    _ATTRIBUTES,
    _ERROR_STRINGS,
    DEVICE_NAME,
    DRIVER_VERSION,
    CUcontext,
    CUdevice,
    CUdevice_attribute,
    CUresult,
)

# ---- initialization, devices, contexts ---------------------------------------------------------------------------


@_api(1, initialized=False)
def cuGetErrorName(error):
    if int(error) not in CUresult._value2member_map_:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{int(error)} is not a CUresult")
    return CUresult(int(error)).name.encode()


@_api(1, initialized=False)
def cuGetErrorString(error):
    if int(error) not in CUresult._value2member_map_:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"{int(error)} is not a CUresult")
    return _ERROR_STRINGS[CUresult(int(error))].encode()


@_api(initialized=False)
def cuInit(Flags):
    if int(Flags) != 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, "cuInit flags must be 0")
    _state.initialized = True


@_api(1, initialized=False)
def cuDriverGetVersion():
    return DRIVER_VERSION


@_api(1)
def cuDeviceGetCount():
    return 1


def _device(dev) -> None:
    if _value(dev) != 0:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_DEVICE, f"device {_value(dev)} does not exist (there is one)")


@_api(1)
def cuDeviceGet(ordinal):
    _device(ordinal)
    return CUdevice(0)


@_api(1)
def cuDeviceGetName(length, dev):
    _device(dev)
    length = int(length)
    # cuda-python hands back its whole length-byte buffer: the NUL-terminated name, then the unwritten spaces.
    written = (DEVICE_NAME[: max(length - 1, 0)] + b"\x00")[:length]
    return written + b" " * (length - len(written))


@_api(1)
def cuDeviceGetAttribute(attrib, dev):
    _device(dev)
    try:
        name = CUdevice_attribute(int(attrib)).name.removeprefix("CU_DEVICE_ATTRIBUTE_")
    except ValueError:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"device attribute {int(attrib)} is not simulated") from None
    return _ATTRIBUTES[name]


@_api(1)
def cuDeviceTotalMem(dev):
    _device(dev)
    return _state.memory.capacity


@_api(1)
def cuDevicePrimaryCtxRetain(dev):
    _device(dev)
    if not _state.primary_refs:
        _state.context_handle = _state.new_handle()
    _state.primary_refs += 1
    return CUcontext(_state.context_handle)


@_api()
def cuDevicePrimaryCtxRelease(dev):
    _device(dev)
    if not _state.primary_refs:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, "the primary context is not retained")
    _state.primary_refs -= 1
    if not _state.primary_refs:
        _state.destroy_context()


@_api()
def cuDevicePrimaryCtxReset(dev):
    """Destroys the primary context and everything in it (memory, streams, modules, graphs); the next retain
    creates a fresh one. The way out of a sticky error."""
    _device(dev)
    _state.primary_refs = 0
    _state.destroy_context()


@_api(2)
def cuDevicePrimaryCtxGetState(dev):
    _device(dev)
    return 0, int(_state.primary_refs > 0)


@_api()
def cuCtxSetCurrent(ctx):
    value = _value(ctx)
    if value and (not _state.primary_refs or value != _state.context_handle):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_CONTEXT, f"{value:#x} is not a live context")
    _state.current.context = value


@_api(1)
def cuCtxGetCurrent():
    value = getattr(_state.current, "context", 0)
    return CUcontext(value if value == _state.context_handle and _state.primary_refs else 0)


@_api(1, context=True)
def cuCtxGetDevice():
    return CUdevice(0)


@_api(context=True)
def cuCtxSynchronize():
    _unsafe_while_capturing("cuCtxSynchronize")
    _drain_all()
