"""onnx-runtime-ep-cuda: the CUDA execution provider for onnx-runtime (cuda-python driver API)."""

from .provider import CUDAExecutionProvider

__all__ = ["CUDAExecutionProvider"]
__version__ = "0.1.0"
