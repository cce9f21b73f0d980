"""onnx_runtime: an ONNX inference runtime whose execution providers are pluggy plugins.

Use it like onnxruntime::

    import onnx_runtime as ort
    sess = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    outputs = sess.run(None, {"input": array})

Providers are separate distributions found through the ``onnx_runtime.providers`` entry-point
group; the contract they implement is :mod:`onnx_runtime.contract.hookspecs`.
"""

from typing import TYPE_CHECKING

from . import package_finder  # noqa: F401  (first: it serves the imports of our submodules, see there)

# isort: split
from . import capi, contract, errors
from .contract import (
    ArgmaxTieBreak,
    Availability,
    CaptureRegionShapeStatus,
    DeviceBuffer,
    DeviceGraphOwner,
    DeviceGraphSlot,
    DeviceGraphToken,
    DeviceValidationOwner,
    DeviceValidationRegistration,
    DeviceValidationToken,
    EpContext,
    Fence,
    KernelMatch,
    Ownership,
    StructuralCaptureDecline,
    hookimpl,
)
from .devices import DeviceId, DeviceType, TensorLayout
from .discovery import get_all_providers, get_available_providers, register_provider, unregister_provider
from .dtypes import DataType
from .errors import OnnxRuntimeError
from .logs import set_default_logger_severity, set_default_logger_verbosity
from .ort_value import OrtValue
from .provider_handle import ProviderHandle
from .session import (
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    InferenceSession,
    ModelMetadata,
    NodeArg,
    RunOptions,
    SessionOptions,
)
from .session.io_binding import IOBinding
from .tensor import Tensor

if TYPE_CHECKING:
    from .session.device_io_binding import (
        DeviceBindingSpec,
        DeviceBindingTransferStats,
        DeviceIoBinding,
        ExternalMemorySpec,
    )

# Imported at their first use: a session that binds no device buffers never loads the module.
_DEVICE_BINDING_NAMES = frozenset({"DeviceBindingSpec", "DeviceBindingTransferStats", "DeviceIoBinding",
                                   "ExternalMemorySpec"})


def __getattr__(name: str):
    if name in _DEVICE_BINDING_NAMES:
        from .session import device_io_binding

        value = getattr(device_io_binding, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"


def get_version_string() -> str:
    """This runtime's version (onnxruntime's function)."""
    return __version__


def get_build_info() -> str:
    """What this build is: the version and the Python implementation it runs on (onnxruntime's function)."""
    import platform
    return f"onnx-runtime {__version__} (Python {platform.python_version()}, execution providers as plugins)"


def get_device() -> str:
    """onnxruntime's ``get_device()``: "GPU" when an available provider owns a GPU, else "CPU"."""
    return "GPU" if any("CUDA" in n for n in get_available_providers()) else "CPU"


__all__ = [
    "ArgmaxTieBreak", "Availability", "ExecutionOrder", "capi", "get_build_info", "get_version_string",
    "set_default_logger_severity", "set_default_logger_verbosity", "CaptureRegionShapeStatus", "DataType",
    "DeviceBindingSpec",
    "DeviceBindingTransferStats", "DeviceBuffer", "DeviceIoBinding", "ExternalMemorySpec",
    "DeviceGraphOwner", "DeviceGraphSlot", "DeviceGraphToken", "DeviceId", "DeviceType",
    "DeviceValidationOwner", "DeviceValidationRegistration", "DeviceValidationToken", "EpContext",
    "ExecutionMode", "Fence", "GraphOptimizationLevel", "InferenceSession", "IOBinding", "KernelMatch",
    "ModelMetadata", "NodeArg", "OnnxRuntimeError", "OrtValue", "Ownership", "ProviderHandle", "RunOptions",
    "SessionOptions", "StructuralCaptureDecline", "Tensor", "TensorLayout", "contract", "errors",
    "get_all_providers", "get_available_providers", "get_device", "hookimpl", "register_provider",
    "unregister_provider",
]
