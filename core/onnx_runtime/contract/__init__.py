"""The execution-provider contract: hook specifications, their defaults, and the value types.

Read :mod:`onnx_runtime.contract.hookspecs` first: it documents every hook a provider may implement.
"""

from .buffers import SIGNALLED, DeviceBuffer, Fence, Ownership
from .defaults import DefaultFallbacks, host_bytes_of, writable_host_bytes_of
from .graphs import (
    CaptureRegionShapeStatus,
    DeviceGraphOwner,
    DeviceGraphSlot,
    DeviceGraphToken,
    StructuralCaptureDecline,
    is_control_flow_or_sequence,
)
from .handle import ContractHandle
from .hookspecs import HOOK_NAMES, DiscoverySpec, ExecutionProviderSpec
from .kernels import ArgmaxTieBreak, Availability, EpContext, GraphPass, Kernel, KernelMatch
from .markers import PROJECT, hookimpl, hookspec
from .validation import DeviceValidationOwner, DeviceValidationRegistration, DeviceValidationToken
from .version import VERSION

__all__ = [
    "ArgmaxTieBreak", "Availability", "CaptureRegionShapeStatus", "ContractHandle", "DefaultFallbacks",
    "DeviceBuffer", "DeviceGraphOwner", "DeviceGraphSlot", "DeviceGraphToken", "DeviceValidationOwner",
    "DeviceValidationRegistration", "DeviceValidationToken", "DiscoverySpec", "EpContext",
    "ExecutionProviderSpec", "Fence", "GraphPass", "HOOK_NAMES", "Kernel", "KernelMatch", "Ownership",
    "PROJECT", "SIGNALLED", "StructuralCaptureDecline", "VERSION", "hookimpl", "hookspec",
    "host_bytes_of", "is_control_flow_or_sequence", "writable_host_bytes_of",
]
