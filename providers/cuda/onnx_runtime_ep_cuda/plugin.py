"""Entry point of the ``onnx_runtime.providers`` group: contributes CUDAExecutionProvider."""

from onnx_runtime import hookimpl

from .provider import CUDAExecutionProvider


@hookimpl
def onnx_runtime_providers():
    return [CUDAExecutionProvider]
