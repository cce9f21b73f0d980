"""Where memory lives: device kinds, device identities and tensor layouts."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class DeviceId:
    """One device: its kind and ordinal. ``host_accessible`` can be forced for unified memory."""

    type: DeviceType = DeviceType.CPU
    index: int = 0
    host_accessible_override: bool | None = None

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


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Physical layout of a tensor's buffer. Only row-major contiguous is produced today."""

    alignment: int = 64
    contiguous: bool = True

    @classmethod
    def default(cls) -> TensorLayout:
        return DEFAULT_LAYOUT


DEFAULT_LAYOUT = TensorLayout()
