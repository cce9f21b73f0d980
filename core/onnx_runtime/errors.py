"""Typed errors. Every error the runtime raises derives from :class:`OnnxRuntimeError`.

Messages follow one rule: say what was wrong, what was expected, and how to fix it.

Each error also derives from the exception onnxruntime raises in the same situation (its classes live in
:mod:`onnx_runtime.capi.onnxruntime_pybind11_state`, under onnxruntime's module path), so scripts that catch
onnxruntime's exceptions run unchanged.
"""

from __future__ import annotations

from .capi.onnxruntime_pybind11_state import (
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    NoSuchFile,
    NotImplemented,
)


class OnnxRuntimeError(Exception):
    """Base class of every error raised by onnx_runtime and its providers."""


class ModelLoadError(OnnxRuntimeError, Fail):
    """The model could not be read or parsed (missing file, truncated or malformed protobuf)."""


class ModelNotFoundError(ModelLoadError, NoSuchFile, FileNotFoundError):
    """The model file does not exist (onnxruntime's ``NoSuchFile``; also a ``FileNotFoundError``)."""


class ModelParseError(ModelLoadError, InvalidProtobuf):
    """The bytes are not a parseable ONNX protobuf (onnxruntime's ``InvalidProtobuf``)."""


class ModelContentError(ModelLoadError, InvalidArgument):
    """The bytes parsed but hold no ONNX model: no graph, no ir_version or no opset (onnxruntime's
    ``InvalidArgument``)."""


class InvalidGraphError(OnnxRuntimeError, InvalidGraph):
    """The model parsed but its graph is not valid (cycles, undefined values, bad attributes)."""


class InvalidArgumentError(OnnxRuntimeError, InvalidArgument, ValueError):
    """A caller-supplied argument (feed, option, name) does not match what is expected."""


class InvalidRunValueError(InvalidArgumentError, Fail):
    """A value a node received during a run breaks its operator's rules (an index out of range, sizes that do
    not add up); onnxruntime reports such a node as failed (``Fail``)."""


class ConfigEntryNotSetError(InvalidArgumentError, RuntimeError):
    """A session or run config entry that was never set was read (onnxruntime raises a ``RuntimeError``)."""


class ShapeOverflowError(InvalidArgumentError):
    """A shape's element or byte count exceeds what the address space can hold."""


class ProviderError(OnnxRuntimeError, EPFail):
    """An execution provider failed, or was asked for something it does not support."""


class ProviderNotAvailableError(ProviderError):
    """A requested provider is not installed, or is installed but cannot run on this machine."""


class NotSupportedError(ProviderError, NotImplemented):
    """A device-only feature was requested from a provider that does not implement it."""


class UnsupportedOperatorError(OnnxRuntimeError, NotImplemented, InvalidGraph):
    """No registered provider can run a node (operator, domain or opset not implemented). onnxruntime raises
    ``NotImplemented`` for an operator no kernel implements and ``InvalidGraph`` for one no schema defines; this
    error is both."""


class KernelError(ProviderError, Fail):
    """A kernel failed while executing a node."""


class RunCancelledError(OnnxRuntimeError, Fail):
    """A run stopped because its ``RunOptions.terminate`` was set while it was in progress (onnxruntime raises
    ``Fail``: "Exiting due to terminate flag being set to true")."""


class DeviceValidationError(KernelError):
    """A device kernel flagged invalid data (e.g. an out-of-range index) at a host boundary."""


class PluginError(OnnxRuntimeError, Fail):
    """A provider plugin is broken: it failed to import, or its hook implementations are invalid."""
