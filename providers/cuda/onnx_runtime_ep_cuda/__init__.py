"""onnx-runtime-ep-cuda: the CUDA execution provider for onnx-runtime (cuda-python driver API, NVRTC kernels)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .device import CudaDevice
    from .provider import CUDAExecutionProvider

__all__ = ["CUDAExecutionProvider", "CudaDevice"]
__version__ = "0.1.0"

# Imported on first access: the entry point (plugin.py) is loaded in every process that discovers providers,
# and the provider module pulls in every op and kernel.
_LAZY = {"CUDAExecutionProvider": ".provider", "CudaDevice": ".device"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value
