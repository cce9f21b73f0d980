"""onnxruntime's ``capi`` package path, so ``from onnxruntime.capi.onnxruntime_pybind11_state import ...`` ports
unchanged as ``from onnx_runtime.capi.onnxruntime_pybind11_state import ...``."""

from . import onnxruntime_pybind11_state

__all__ = ["onnxruntime_pybind11_state"]
