"""Where memory lives: device kinds, device identities and tensor layouts."""

from __future__ import annotations

import enum

from .records import FrozenRecord


class DeviceType(enum.Enum):
    """Kinds of device a provider can own. Host-accessible kinds can be read through a pointer."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    METAL = "metal"
    OTHER = "other"

    @property
    def is_host_accessible(self) -> bool:
        return self is DeviceType.CPU

    @property
    def dlpack_code(self) -> int:
        """DLPack ``DLDeviceType`` code (kDLCPU=1, kDLCUDA=2, kDLMetal=8, kDLROCM=10, kDLExtDev=12)."""
        return {"cpu": 1, "cuda": 2, "metal": 8, "rocm": 10, "other": 12}[self.value]


class DeviceId(FrozenRecord):
    """One device: its kind and ordinal. ``host_accessible`` can be forced for unified memory."""

    __slots__ = __match_args__ = ("type", "index", "host_accessible_override")
    type: DeviceType
    index: int
    host_accessible_override: bool | None

    def __init__(self, type: DeviceType = DeviceType.CPU, index: int = 0,
                 host_accessible_override: bool | None = None) -> None:
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "host_accessible_override", host_accessible_override)

    # (written out: placement and copies compare and hash devices often)
    def __eq__(self, other: object) -> bool:
        if other.__class__ is DeviceId:
            return (self.type is other.type and self.index == other.index
                    and self.host_accessible_override == other.host_accessible_override)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.type, self.index, self.host_accessible_override))

    @classmethod
    def cpu(cls) -> DeviceId:
        return CPU_DEVICE

    @property
    def is_host_accessible(self) -> bool:
        if self.host_accessible_override is not None:
            return self.host_accessible_override
        return self.type.is_host_accessible

    def __str__(self) -> str:
        return f"{self.type.value}:{self.index}"


CPU_DEVICE = DeviceId(DeviceType.CPU, 0)


class TensorLayout(FrozenRecord):
    """Physical layout of a tensor's buffer. Only row-major contiguous is produced today."""

    __slots__ = __match_args__ = ("alignment", "contiguous")
    alignment: int
    contiguous: bool

    def __init__(self, alignment: int = 64, contiguous: bool = True) -> None:
        object.__setattr__(self, "alignment", alignment)
        object.__setattr__(self, "contiguous", contiguous)

    @classmethod
    def default(cls) -> TensorLayout:
        return DEFAULT_LAYOUT


DEFAULT_LAYOUT = TensorLayout()
