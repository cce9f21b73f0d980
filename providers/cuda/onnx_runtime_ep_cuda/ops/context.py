"""What a CUDA kernel factory gets: the device, the provider's handle, kernel loading and launches."""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
from onnx_runtime import Tensor

BLOCK = 256
MAX_GRID = 65535 * 32  # grid-stride kernels: more blocks than this buys nothing


def ptr(tensor: Tensor) -> tuple[int, type]:
    """A tensor's device address as a kernel argument (0 for an empty tensor)."""
    return (tensor.device_ptr, ctypes.c_void_p)


def i64(value: int) -> tuple[int, type]:
    return (int(value), ctypes.c_int64)


def i32(value: int) -> tuple[int, type]:
    return (int(value), ctypes.c_int32)


def f32(value: float) -> tuple[float, type]:
    return (float(value), ctypes.c_float)


_MIRRORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # device tensor -> its value on the host


def mirror_on_host(tensor: Tensor, value: np.ndarray) -> None:
    """Note that device ``tensor`` holds ``value``, known on the host (ops/host_shapes.py)."""
    _MIRRORS[tensor] = value


def host_value(value) -> np.ndarray | None:
    """``value`` on the host when it is known there without a transfer (a numpy array, or a tensor mirrored on
    the host), else None."""
    if isinstance(value, np.ndarray):
        return value
    return _MIRRORS.get(value) if isinstance(value, Tensor) else None


class KernelContext:
    """Per provider instance; kernels hold it for the session's lifetime."""

    def __init__(self, device, handle):
        self.device = device
        self.handle = handle

    def function(self, source_file: str, name: str, options=()):
        """The compiled ``extern "C"`` kernel ``name`` from ``kernels/<source_file>``."""
        return self.device.function(self.device.load(source_file, options), name)

    def validation_flags(self) -> int:
        """Device address of the current validation flag word (a 32-bit unsigned int).

        A kernel that meets invalid data (an index out of range) skips the element and raises a bit with
        ``atomicOr(flags, bit)`` instead of faulting; the session reports the flags as a
        DeviceValidationError at the next download. Bits: ``validation.INDEX_OUT_OF_RANGE`` (1),
        ``validation.INVALID_ARGUMENT`` (2). Ask for the address at every launch (it follows the
        running submission) and pass it as ``(ctx.validation_flags(), ctypes.c_void_p)``.
        """
        return self.handle.provider.device_validation().current_word()

    def empty(self, dtype, shape) -> Tensor:
        return Tensor.empty(dtype, shape, provider=self.handle)

    def empty_like(self, tensor: Tensor, dtype=None, shape=None) -> Tensor:
        return self.empty(tensor.dtype if dtype is None else dtype, tensor.shape if shape is None else shape)

    def launch(self, function, grid, block, *args, shared_bytes: int = 0) -> None:
        self.device.launch(function, grid, block, args, shared_bytes)

    def site(self, function, grid, block, pointers: int, *scalars, shared_bytes: int = 0) -> LaunchSite:
        """A :class:`LaunchSite` for ``function`` taking ``pointers`` pointers, then ``scalars`` (value, type) pairs."""
        return LaunchSite(self.device, function, grid, block, pointers, scalars, shared_bytes)

    def launch_1d(self, function, count: int, *args, block: int = BLOCK) -> None:
        """Launch a grid-stride kernel over ``count`` elements (nothing for zero)."""
        if count <= 0:
            return
        grid = min((count + block - 1) // block, MAX_GRID)
        self.device.launch(function, grid, block, args)


class LaunchSite:
    """One launch with everything but its pointers fixed: function, grid, block, argument types and the scalar
    arguments (element counts, broadcast strides, op codes), which depend on the dtype and shapes only. Kernels
    build one per (dtype, shapes) and call it with the pointers (the validation word too: it follows the
    running submission), so a run does not pack and split the same scalars again at every launch. ``grid`` 0
    launches nothing (an empty tensor)."""

    __slots__ = ("device", "function", "grid", "block", "tail", "types", "shared_bytes")

    def __init__(self, device, function, grid, block, pointers: int, scalars, shared_bytes: int = 0):
        self.device = device
        self.function = function
        self.grid = grid
        self.block = block
        self.tail = tuple(value for value, _ in scalars)
        self.types = (ctypes.c_void_p,) * pointers + tuple(kind for _, kind in scalars)
        self.shared_bytes = shared_bytes

    def __call__(self, *pointers: int) -> None:
        if self.grid:
            self.device.launch_split(self.function, self.grid, self.block, pointers + self.tail, self.types,
                                     self.shared_bytes)
