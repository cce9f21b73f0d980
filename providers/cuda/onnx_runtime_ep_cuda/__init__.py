"""onnx-runtime-ep-cuda: the CUDA execution provider for onnx-runtime (cuda-python driver API, NVRTC kernels)."""

from .device import CudaDevice
from .provider import CUDAExecutionProvider

__all__ = ["CUDAExecutionProvider", "CudaDevice"]
__version__ = "0.1.0"
