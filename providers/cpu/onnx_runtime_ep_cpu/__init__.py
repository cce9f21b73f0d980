"""onnx-runtime-ep-cpu: the numpy CPU execution provider for onnx-runtime."""

from onnx_runtime.package_finder import serve

serve(__name__)  # (its submodules found by one listing per folder: onnx_runtime/package_finder.py)

from .provider import CPUExecutionProvider  # noqa: E402

__all__ = ["CPUExecutionProvider"]
__version__ = "0.1.0"
