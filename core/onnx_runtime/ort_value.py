"""``OrtValue``: onnxruntime's value handle, a thin wrapper over :class:`onnx_runtime.Tensor`.

A value on a device other than the host lives in memory allocated through a provider handle and is
freed exactly once, through that handle (the Tensor owns it). Values created outside any session
(``ortvalue_from_numpy(array, "cuda")``) are allocated through one process-wide handle per provider
and device, created on first use: they must outlive sessions, so no session's handle may own them.
"""

from __future__ import annotations

import threading

import numpy as np

from .discovery import EXTRAS, registry
from .dtypes import DataType
from .errors import InvalidArgumentError, ProviderNotAvailableError
from .host import host_allocator
from .provider_handle import ProviderHandle
from .tensor import Tensor

_lock = threading.Lock()
_device_handles: dict[tuple[str, int], tuple[object, ProviderHandle]] = {}  # (type, id) -> (entry, handle)


def _device_kind(handle: ProviderHandle) -> str:
    return "cpu" if handle.is_host_accessible else handle.device_id.type.value


def device_handle(device_type: str, device_id: int = 0) -> ProviderHandle:
    """The process-wide handle that allocates values on ``device_type:device_id`` ("cpu" is the host)."""
    kind = str(device_type).lower()
    if kind == "cpu":
        return host_allocator()
    with _lock:
        entries = [e for e in registry().entries() if e.device.split(":")[0] == kind]
        available = [e for e in entries if e.availability.available]
        if not available:
            raise _unavailable(kind, device_id, entries)
        entry = available[0]
        cached = _device_handles.get((kind, device_id))
        # A registry refresh (new entries) means the provider may have changed: start a fresh handle. The
        # old one is not shut down, since values it allocated may still be alive and freed through it.
        if cached is not None and cached[0] is entry:
            return cached[1]
        handle = entry.create()
        handle.initialize({} if handle.device_id.index == device_id else {"device_id": device_id})
        if handle.device_id.index != device_id:
            raise InvalidArgumentError(
                f"{entry.name} runs on {handle.device_id}, not {kind}:{device_id}; pass device_id="
                f"{handle.device_id.index}"
            )
        _device_handles[(kind, device_id)] = (entry, handle)
        return handle


def _unavailable(kind: str, device_id: int, entries) -> ProviderNotAvailableError:
    known = sorted({e.device.split(":")[0] for e in registry().entries() if e.availability.available} | {"cpu"})
    if entries:
        reasons = "; ".join(f"{e.name}: {e.availability.reason}" for e in entries)
        return ProviderNotAvailableError(
            f"device {kind}:{device_id} is not available here ({reasons}); or use one of the device types {known}"
        )
    hint = f"install its provider with `{EXTRAS[kind]}`" if kind in EXTRAS else "install a provider for it"
    return ProviderNotAvailableError(
        f"no installed execution provider runs on device type {kind!r}; {hint}, or use one of {known}"
    )


def element_type_of(element_type) -> DataType:
    """A numpy type (np.float32) or, as onnxruntime also takes, an ONNX element-type int (TensorProto.FLOAT)."""
    try:
        if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
            dtype = DataType(int(element_type))
            if dtype is DataType.UNDEFINED:
                raise ValueError("UNDEFINED is not an element type")
            return dtype
        return DataType.from_numpy(np.dtype(element_type))
    except (TypeError, ValueError, InvalidArgumentError) as exc:
        raise InvalidArgumentError(
            f"element_type {element_type!r} is not a tensor element type; pass a numpy type such as np.float32 "
            f"or an ONNX element type such as onnx.TensorProto.FLOAT ({exc})"
        ) from None


class OrtValue:
    """A tensor value on the host or a device, as onnxruntime's ``OrtValue``."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: Tensor | None):
        if tensor is not None and not isinstance(tensor, Tensor):
            raise InvalidArgumentError(f"OrtValue wraps an onnx_runtime.Tensor, got {type(tensor).__name__}")
        self._tensor = tensor

    # -- construction (onnxruntime's static constructors) ---------------------------------------------
    @staticmethod
    def ortvalue_from_numpy(array, device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """A copy of ``array`` on the device (on the host: a copy too, so later writes to ``array`` do not leak in)."""
        return OrtValue(Tensor.from_numpy(np.asarray(array), provider=device_handle(device_type, device_id)))

    @staticmethod
    def ortvalue_from_shape_and_type(shape, element_type, device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        """An uninitialized value of ``shape`` and ``element_type`` (a numpy type) on the device."""
        dtype = element_type_of(element_type)
        return OrtValue(Tensor.empty(dtype, shape, provider=device_handle(device_type, device_id)))

    @staticmethod
    def ortvalue_from_numpy_with_onnx_type(array, onnx_element_type) -> OrtValue:
        """A host copy of ``array`` typed as ``onnx_element_type`` (an ONNX element-type int): for types numpy
        stores in another type's bits, as onnxruntime takes bfloat16 or float8 data in uint8/uint16 arrays."""
        dtype = element_type_of(onnx_element_type)
        array = np.ascontiguousarray(array)
        target = dtype.numpy
        if array.dtype != target:
            if array.dtype.itemsize != target.itemsize or array.dtype.kind not in "uiV":
                raise InvalidArgumentError(
                    f"an array of {array.dtype} cannot hold {dtype.ort_type} bits; pass an array of {target} or of "
                    f"an unsigned integer type of {target.itemsize} bytes"
                )
            array = array.view(target)
        return OrtValue(Tensor.from_numpy(array, provider=device_handle("cpu", 0)))

    def update_inplace(self, array) -> None:
        """Copy ``array`` (same shape and element type) into this value's buffer, which keeps its address."""
        tensor = self.tensor
        array = np.ascontiguousarray(array)
        if tuple(array.shape) != tensor.shape or DataType.from_numpy(array.dtype) is not tensor.dtype:
            raise InvalidArgumentError(
                f"update_inplace needs a {tensor.dtype.ort_type} array of shape {list(tensor.shape)}, got "
                f"{array.dtype} of shape {list(array.shape)}"
            )
        if tensor.nbytes:
            tensor.provider.copy_from_host(array, tensor.buffer)

    # -- queries ----------------------------------------------------------------------------------------
    @property
    def tensor(self) -> Tensor:
        """The wrapped :class:`Tensor` (still owned by this value)."""
        if self._tensor is None:
            raise InvalidArgumentError("this OrtValue holds no value")
        return self._tensor

    def has_value(self) -> bool:
        return self._tensor is not None

    def is_tensor(self) -> bool:
        return self._tensor is not None

    def is_sparse_tensor(self) -> bool:
        return False  # values here are dense tensors; sparse initializers are densified at load

    def is_tensor_sequence(self) -> bool:
        return False

    def tensor_size_in_bytes(self) -> int:
        return self.tensor.nbytes

    def numpy(self) -> np.ndarray:
        """The data on the host: a view for host values, a download for device ones."""
        return self.tensor.numpy()

    def shape(self) -> list[int]:
        return list(self.tensor.shape)

    def data_type(self) -> str:
        return self.tensor.dtype.ort_type

    def element_type(self) -> int:
        """The ONNX element type (``onnx.TensorProto.FLOAT`` is 1), as onnxruntime returns it."""
        return int(self.tensor.dtype)

    def device_name(self) -> str:
        return _device_kind(self.tensor.provider)

    def data_ptr(self) -> int:
        return self.tensor.device_ptr

    def __repr__(self) -> str:
        if self._tensor is None:
            return "OrtValue(None)"
        return f"OrtValue({self.data_type()}, shape={self.shape()}, {self.device_name()})"
