"""onnxruntime's exception classes, under the module path and names onnxruntime scripts catch.

onnxruntime raises these from its C++ core, each derived directly from ``Exception``. The project's typed errors
(:mod:`onnx_runtime.errors`) subclass the one onnxruntime raises in the same situation, so ``except
InvalidArgument`` catches a bad feed here as it does there, while the message stays the project's.
"""

from __future__ import annotations


class Fail(Exception):
    """A generic failure: a kernel failed while running, a model could not be loaded."""


class InvalidArgument(Exception):
    """A feed, output name or option does not match what the model or API expects."""


class NoSuchFile(Exception):
    """The model file (or a file it references) does not exist."""


class NoModel(Exception):
    """No model was loaded."""


class EngineError(Exception):
    """The runtime's engine failed."""


class RuntimeException(Exception):
    """An unexpected runtime failure."""


class InvalidProtobuf(Exception):
    """The bytes are not a parseable ONNX protobuf."""


class ModelLoaded(Exception):
    """A model was already loaded into the session."""


class NotImplemented(Exception):  # noqa: A001 (onnxruntime's name)
    """The model needs something not implemented: an operator no provider has a kernel for."""


class InvalidGraph(Exception):
    """The model parsed but its graph is invalid."""


class EPFail(Exception):
    """An execution provider failed."""


class ModelLoadCanceled(Exception):
    """Model loading was canceled."""


class ModelRequiresCompilation(Exception):
    """The model must be compiled for an execution provider before it can run."""


class NotFound(Exception):
    """A named item was not found."""


class DeviceReset(Exception):
    """The device was reset; device state created before it is gone."""


__all__ = [
    "DeviceReset", "EPFail", "EngineError", "Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf",
    "ModelLoadCanceled", "ModelLoaded", "ModelRequiresCompilation", "NoModel", "NoSuchFile", "NotFound",
    "NotImplemented", "RuntimeException",
]
