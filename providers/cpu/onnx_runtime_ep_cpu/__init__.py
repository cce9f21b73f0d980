"""onnx-runtime-ep-cpu: the numpy CPU execution provider for onnx-runtime."""

from .provider import CPUExecutionProvider

__all__ = ["CPUExecutionProvider"]
__version__ = "0.1.0"
