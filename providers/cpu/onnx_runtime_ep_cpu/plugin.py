"""Entry point of the ``onnx_runtime.providers`` group: contributes CPUExecutionProvider."""

from onnx_runtime import hookimpl

from .provider import CPUExecutionProvider


@hookimpl
def onnx_runtime_providers():
    return [CPUExecutionProvider]
