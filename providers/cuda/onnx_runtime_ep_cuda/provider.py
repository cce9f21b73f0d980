"""CUDAExecutionProvider: identity, options and availability on cuda-python's driver API.

On a machine without cuda-python or without an NVIDIA driver the provider stays installed and
reports itself unavailable with the reason. Its NVRTC kernels, device memory and device graphs are
delivered by the CUDA provider issue; until then it declines every node with that reason, so
placement runs the node on the next listed provider.
"""

from __future__ import annotations

from onnx_runtime import Availability, DeviceId, DeviceType, KernelMatch, hookimpl
from onnx_runtime.errors import InvalidArgumentError

from . import driver

OPTION_KEYS = ("device_id",)


class CUDAExecutionProvider:
    def __init__(self):
        self._device_index = 0

    @hookimpl
    def name(self):
        return "CUDAExecutionProvider"

    @hookimpl
    def short_name(self):
        return "cuda"

    @hookimpl
    def device_type(self):
        return DeviceType.CUDA

    @hookimpl
    def device_id(self):
        return DeviceId(DeviceType.CUDA, self._device_index)

    @hookimpl
    def availability(self):
        reason = driver.probe()
        return Availability.no(reason) if reason else Availability.yes()

    @hookimpl
    def initialize(self, options):
        for key, value in options.items():
            bare = key.removeprefix("cuda.")
            if bare not in OPTION_KEYS:
                raise InvalidArgumentError(
                    f"CUDAExecutionProvider does not accept option {key!r}; accepted: {list(OPTION_KEYS)}"
                )
            if bare == "device_id":
                index = int(value)
                count = driver.device_count()
                if not 0 <= index < count:
                    raise InvalidArgumentError(
                        f"CUDAExecutionProvider option device_id={value} is out of range; this machine has "
                        f"{count} CUDA device(s)"
                    )
                self._device_index = index

    @hookimpl
    def supports_op(self, node):
        return KernelMatch.unsupported(
            "CUDAExecutionProvider ships no device kernels in this release; list CPUExecutionProvider after it "
            "so the node runs on the CPU"
        )
