"""The owned, device-aware Tensor: a dtype, a shape and a DeviceBuffer, freed exactly once.

A Tensor owns its buffer and the provider handle that must free it. ``close()`` (or garbage
collection) returns the buffer to that provider once. A tensor imported zero-copy (DLPack) holds a
*borrowed* buffer plus an import guard that keeps the foreign memory alive; the guard is released
exactly once, after the buffer, so the memory is never freed while the buffer still aliases it.

Sub-byte types (int4, uint4, float4, int2, uint2) are held one element per byte, as ml_dtypes lays
them out; packing applies to serialized tensors only. String tensors live on the host as numpy
object arrays.
"""

from __future__ import annotations

import numpy as np

from .contract.buffers import DeviceBuffer, Ownership
from .devices import DEFAULT_LAYOUT, DeviceId, TensorLayout
from .dtypes import DataType, checked_numel
from .errors import InvalidArgumentError, NotSupportedError, ShapeOverflowError
from .host import host_allocator
from .provider_handle import ProviderHandle

_DLPACK_CPU = 1
_MAX_BYTES = int(np.iinfo(np.intp).max)
DEFAULT_ALIGNMENT = DEFAULT_LAYOUT.alignment


def _buffer_bytes(dtype: DataType, shape) -> int:
    numel = checked_numel(shape)
    nbytes = numel * dtype.numpy.itemsize
    if nbytes > _MAX_BYTES:
        raise ShapeOverflowError(
            f"shape {tuple(shape)} of {dtype.name} needs {nbytes} bytes, more than the address space"
        )
    return nbytes


class Tensor:
    """See the module docstring. Build with :meth:`from_numpy`, :meth:`zeros`, :meth:`from_raw` or
    :meth:`from_dlpack`; read with :meth:`numpy`, :meth:`as_bytes` or :meth:`raw_bits`."""

    __slots__ = ("dtype", "shape", "layout", "_buffer", "_allocator", "_guard", "_strings", "__weakref__")

    def __init__(self, dtype: DataType, shape, buffer: DeviceBuffer | None, allocator: ProviderHandle,
                 guard=None, strings: np.ndarray | None = None, layout: TensorLayout | None = None):
        self.dtype = DataType.parse(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.layout = layout or TensorLayout.default()
        self._buffer = buffer
        self._allocator = allocator
        self._guard = guard
        self._strings = strings

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def empty(cls, dtype, shape, provider: ProviderHandle | None = None) -> Tensor:
        """An uninitialized tensor on ``provider``'s device (the host by default)."""
        dtype = DataType.parse(dtype)
        shape = tuple(int(d) for d in shape)
        allocator = provider or host_allocator()
        if dtype is DataType.STRING:
            if not allocator.is_host_accessible:
                raise InvalidArgumentError("string tensors live on the host; create them without a device provider")
            return cls(dtype, shape, None, allocator, strings=np.full(shape, "", dtype=object))
        nbytes = _buffer_bytes(dtype, shape)
        buffer = allocator.allocate(max(nbytes, 1), DEFAULT_ALIGNMENT)
        # Fields set directly: dtype and shape are checked above, and device kernels create a tensor per
        # output per call.
        tensor = cls.__new__(cls)
        tensor.dtype, tensor.shape, tensor.layout = dtype, shape, DEFAULT_LAYOUT
        tensor._buffer, tensor._allocator, tensor._guard, tensor._strings = buffer, allocator, None, None
        return tensor

    @classmethod
    def zeros(cls, dtype, shape, provider: ProviderHandle | None = None) -> Tensor:
        """A zero-filled tensor; zero-element shapes are valid."""
        tensor = cls.empty(dtype, shape, provider)
        if tensor._buffer is not None and tensor.nbytes:
            if tensor._buffer.host is not None:
                tensor._buffer.host_view()[: tensor.nbytes] = 0
            else:
                tensor._allocator.copy_from_host(np.zeros(tensor.nbytes, np.uint8), tensor._buffer)
        return tensor

    @classmethod
    def from_numpy(cls, array, provider: ProviderHandle | None = None) -> Tensor:
        """A tensor holding a copy of ``array`` on ``provider``'s device (the host by default)."""
        array = np.asarray(array)
        dtype = DataType.from_numpy(array.dtype)
        tensor = cls.empty(dtype, array.shape, provider)
        if tensor._strings is not None:
            tensor._strings[...] = array
            return tensor
        if array.size:
            tensor._allocator.copy_from_host(np.ascontiguousarray(array), tensor.buffer)
        return tensor

    @classmethod
    def from_raw(cls, dtype, shape, data, provider: ProviderHandle | None = None) -> Tensor:
        """A tensor from raw little-endian element bytes (exactly ``numel * itemsize`` of them)."""
        dtype = DataType.parse(dtype)
        if dtype is DataType.STRING:
            raise InvalidArgumentError("string tensors have no raw byte form; use Tensor.from_numpy")
        expected = _buffer_bytes(dtype, shape)
        data = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        if data.size != expected:
            raise InvalidArgumentError(
                f"{data.size} bytes given for shape {tuple(shape)} of {dtype.name}; expected {expected}"
            )
        tensor = cls.empty(dtype, shape, provider)
        if expected:
            tensor._allocator.copy_from_host(data, tensor.buffer)
        return tensor

    @classmethod
    def from_dlpack(cls, obj) -> Tensor:
        """Import a DLPack-capable object (``__dlpack__``) zero-copy when it lives on the host."""
        if not hasattr(obj, "__dlpack__"):
            raise InvalidArgumentError(
                f"{type(obj).__name__} does not implement __dlpack__; pass a DLPack-capable array"
            )
        device_type, device_index = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else (1, 0)
        if int(device_type) != _DLPACK_CPU:
            raise NotSupportedError(
                f"DLPack import from device type {int(device_type)}:{device_index} is not supported by the "
                f"host; copy the array to the CPU first, or import it through that device's provider"
            )
        # The imported ndarray owns the DLPack capsule: holding it is the import guard, and dropping
        # it runs the producer's deleter exactly once.
        guard = np.from_dlpack(obj)
        return cls.from_borrowed(guard, guard)

    @classmethod
    def from_borrowed(cls, array: np.ndarray, guard, writable: bool = False) -> Tensor:
        """Alias host ``array`` without copying; ``guard`` keeps its memory alive until close()."""
        dtype = DataType.from_numpy(array.dtype)
        if dtype is DataType.STRING:
            raise InvalidArgumentError("string arrays cannot be borrowed; use Tensor.from_numpy")
        if not array.flags.c_contiguous:
            raise InvalidArgumentError("only C-contiguous arrays can be imported zero-copy")
        allocator = host_allocator()
        ownership = Ownership.BORROWED_MUT if writable else Ownership.BORROWED
        buffer = DeviceBuffer.from_host_array(array, allocator.device_id, ownership, alignment=array.dtype.alignment)
        return cls(dtype, array.shape, buffer, allocator, guard=guard)

    # -- properties -----------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return checked_numel(self.shape)

    @property
    def nbytes(self) -> int:
        return 0 if self.dtype is DataType.STRING else self.numel * self.dtype.numpy.itemsize

    @property
    def device(self) -> DeviceId:
        return self._allocator.device_id

    @property
    def provider(self) -> ProviderHandle:
        return self._allocator

    @property
    def buffer(self) -> DeviceBuffer:
        """The device buffer holding the elements; a string tensor has none (see :meth:`numpy`)."""
        self._check_open()
        if self._buffer is None:
            raise InvalidArgumentError("string tensors have no device buffer; read them with numpy()")
        return self._buffer

    @property
    def device_ptr(self) -> int:
        """Base address of the data (0 for an empty tensor); opaque unless host-accessible."""
        return 0 if self.numel == 0 or self._buffer is None else self.buffer.ptr

    @property
    def is_borrowed(self) -> bool:
        return self._buffer is not None and self._buffer.is_borrowed

    @property
    def closed(self) -> bool:
        return self._allocator is None

    def _check_open(self) -> None:
        if self._allocator is None:
            raise InvalidArgumentError("this tensor was closed; its memory has been returned to its provider")

    # -- reading --------------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        """The data as a numpy array: a zero-copy view on the host, a copy from other devices."""
        self._check_open()
        if self._strings is not None:
            return self._strings
        buffer = self._buffer
        assert buffer is not None  # only string tensors have none
        if buffer.host is not None:
            raw = buffer.host_view()[: self.nbytes]
        else:
            raw = self._allocator.download(buffer, self.nbytes)
        return raw.view(self.dtype.numpy).reshape(self.shape)

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array.astype(dtype) if dtype is not None else array

    def as_bytes(self) -> bytes:
        """The raw little-endian element bytes."""
        if self._strings is not None:
            raise InvalidArgumentError("string tensors have no raw byte form; use numpy()")
        return self.numpy().tobytes()

    def raw_bits(self) -> np.ndarray:
        """float16/bfloat16 data as its raw uint16 bit patterns (a view on the host)."""
        if self.dtype not in (DataType.FLOAT16, DataType.BFLOAT16):
            raise InvalidArgumentError(f"raw_bits needs a float16 or bfloat16 tensor, this one is {self.dtype.name}")
        return self.numpy().view(np.uint16)

    def try_clone(self) -> Tensor:
        """A deep copy on the same provider."""
        self._check_open()
        if self._strings is not None:
            return Tensor.from_numpy(self._strings.copy())
        clone = Tensor.empty(self.dtype, self.shape, self._allocator)
        if self.nbytes:
            buffer = self.buffer
            if buffer.host is not None:
                self._allocator.copy_from_host(buffer.host_view()[: self.nbytes], clone.buffer)
            else:
                self._allocator.hook.copy(src=buffer, dst=clone.buffer, size=self.nbytes)
        return clone

    def sync(self) -> None:
        """Block until the owning provider's pending work is done (DLPack export does this)."""
        self._check_open()
        self._allocator.sync()

    # -- DLPack export --------------------------------------------------------------------------
    def __dlpack_device__(self):
        return (self.device.type.dlpack_code, self.device.index)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self._check_open()
        if self._buffer is None or self._buffer.host is None:
            raise NotSupportedError(
                f"DLPack export of a tensor on {self.device} is not supported; copy it to the host with numpy()"
            )
        self.sync()
        kwargs = {"stream": stream}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if dl_device is not None:
            kwargs["dl_device"] = dl_device
        if copy is not None:
            kwargs["copy"] = copy
        return self.numpy().__dlpack__(**kwargs)

    # -- release --------------------------------------------------------------------------------
    def close(self) -> None:
        """Return the buffer to its provider, then release any import guard; idempotent."""
        allocator, self._allocator = self._allocator, None  # type: ignore[assignment]  # None marks it closed
        if allocator is None:
            return
        buffer, self._buffer = self._buffer, None
        if buffer is not None and not buffer.released:
            allocator.deallocate(buffer)
        self._guard = None
        self._strings = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # never raise from a finalizer; a failed free leaks, never double-frees
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else str(self.device)
        return f"Tensor({self.dtype.name}, shape={list(self.shape)}, {state})"
