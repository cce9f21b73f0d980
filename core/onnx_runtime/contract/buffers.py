"""Device memory handles and completion fences.

A :class:`DeviceBuffer` names one allocation: its device, size, alignment, base address and
ownership. It never frees itself: there is no ``__del__``. The provider that allocated it frees
it exactly once through the ``deallocate`` hook, and the core refuses a second release. A
*borrowed* buffer aliases memory owned elsewhere (an mmap, a DLPack import, a caller's output
binding) and is never freed by ``deallocate``.

On host-accessible devices ``host`` is the numpy uint8 array that keeps the bytes alive and lets
the core read and write them; on other devices it is None and ``ptr`` is an opaque device address
meaningful only to the owning provider.
"""

from __future__ import annotations

import enum
from typing import Any, TypeAlias

import numpy as np

from ..devices import DeviceId
from ..errors import InvalidArgumentError
from ..records import FrozenRecord

# Host memory the copy hooks accept: bytes-like, or a C-contiguous array (read as its bytes).
HostBytes: TypeAlias = bytes | bytearray | memoryview | np.ndarray
# Host memory a download may write: a writable buffer, or a C-contiguous array.
WritableHostBytes: TypeAlias = bytearray | memoryview | np.ndarray


class Ownership(enum.Enum):
    OWNED = "owned"  # the owning provider frees it exactly once in deallocate
    BORROWED = "borrowed"  # read-only alias of foreign memory; never freed here
    BORROWED_MUT = "borrowed_mut"  # exclusive writable alias of foreign memory; never freed here


class DeviceBuffer:
    """One device allocation (or a borrowed alias of one). See the module docstring."""

    __slots__ = ("device", "size", "alignment", "ptr", "ownership", "host", "provider_state", "_released")

    def __init__(
        self,
        device: DeviceId,
        size: int,
        alignment: int,
        ptr: int,
        ownership: Ownership = Ownership.OWNED,
        host: np.ndarray | None = None,
        provider_state: Any = None,
    ):
        if alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgumentError(f"alignment must be a power of two, got {alignment}")
        if size < 0:
            raise InvalidArgumentError(f"buffer size must be non-negative, got {size}")
        if not ptr:
            raise InvalidArgumentError("a DeviceBuffer needs a non-null address")
        if host is not None and (host.dtype != np.uint8 or host.ndim != 1 or host.size < size):
            raise InvalidArgumentError("host backing must be a 1-D uint8 array of at least `size` bytes")
        self.device = device
        self.size = size
        self.alignment = alignment
        self.ptr = ptr
        self.ownership = ownership
        self.host = host
        self.provider_state = provider_state  # anything the owning provider needs to free it
        self._released = False

    # -- constructors mirroring the seed ------------------------------------------------------------
    @classmethod
    def from_host_array(cls, array: np.ndarray, device: DeviceId, ownership: Ownership,
                        alignment: int = 1) -> DeviceBuffer:
        """Wrap the bytes of a C-contiguous host array (owned or borrowed)."""
        if not array.flags.c_contiguous:
            raise InvalidArgumentError("only C-contiguous arrays can back a DeviceBuffer")
        raw = array.reshape(-1).view(np.uint8) if array.size else np.zeros(1, np.uint8)
        ptr = raw.ctypes.data
        return cls(device, array.nbytes, alignment, ptr, ownership, host=raw)

    # -- queries ------------------------------------------------------------------------------------
    @property
    def is_borrowed(self) -> bool:
        return self.ownership is not Ownership.OWNED

    @property
    def is_empty(self) -> bool:
        return self.size == 0

    @property
    def released(self) -> bool:
        return self._released

    def mark_released(self) -> None:
        """Called by the core once the owning provider freed the memory; drops the host view."""
        self._released = True
        self.host = None
        self.provider_state = None

    def host_view(self) -> np.ndarray:
        """The buffer's bytes as a uint8 array (host-accessible devices only)."""
        if self._released:
            raise InvalidArgumentError(f"buffer at {self.ptr:#x} on {self.device} was already freed")
        if self.host is None:
            raise InvalidArgumentError(
                f"buffer on {self.device} is not host-accessible; copy it to the host first"
            )
        return self.host[: self.size]

    def alias(self, offset: int = 0, size: int | None = None, writable: bool = False) -> DeviceBuffer:
        """A borrowed view of ``[offset, offset+size)`` of this buffer; never freed itself."""
        size = self.size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.size:
            raise InvalidArgumentError(
                f"alias range {offset}..{offset + size} is outside the {self.size}-byte buffer"
            )
        host = self.host[offset: offset + size] if self.host is not None else None
        if host is not None and host.size == 0:
            host = np.zeros(1, np.uint8)
        return DeviceBuffer(
            self.device, size, 1 if offset % self.alignment else self.alignment, self.ptr + offset,
            Ownership.BORROWED_MUT if writable else Ownership.BORROWED, host=host,
            provider_state=self.provider_state,
        )

    def __repr__(self) -> str:
        state = " released" if self._released else ""
        return f"DeviceBuffer({self.device}, {self.size} B, ptr={self.ptr:#x}, {self.ownership.value}{state})"


class Fence(FrozenRecord):
    """Completion of an asynchronous copy or of compute so far.

    ``id`` is a provider-private event handle; 0 is reserved for an already-signalled fence, which
    synchronous providers return and ``wait_fence`` treats as a no-op.
    """

    __slots__ = __match_args__ = ("id",)
    id: int

    def __init__(self, id: int = 0) -> None:
        object.__setattr__(self, "id", id)

    @classmethod
    def signalled(cls) -> Fence:
        return SIGNALLED

    @property
    def is_signalled(self) -> bool:
        return self.id == 0


SIGNALLED = Fence(0)
