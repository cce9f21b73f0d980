"""Typed errors. Every error the runtime raises derives from :class:`OnnxRuntimeError`.

Messages follow one rule: say what was wrong, what was expected, and how to fix it.
"""

from __future__ import annotations


class OnnxRuntimeError(Exception):
    """Base class of every error raised by onnx_runtime and its providers."""


class ModelLoadError(OnnxRuntimeError):
    """The model could not be read or parsed (missing file, truncated or malformed protobuf)."""


class InvalidGraphError(OnnxRuntimeError):
    """The model parsed but its graph is not valid (cycles, undefined values, bad attributes)."""


class InvalidArgumentError(OnnxRuntimeError, ValueError):
    """A caller-supplied argument (feed, option, name) does not match what is expected."""


class ShapeOverflowError(InvalidArgumentError):
    """A shape's element or byte count exceeds what the address space can hold."""


class ProviderError(OnnxRuntimeError):
    """An execution provider failed, or was asked for something it does not support."""


class ProviderNotAvailableError(ProviderError):
    """A requested provider is not installed, or is installed but cannot run on this machine."""


class NotSupportedError(ProviderError):
    """A device-only feature was requested from a provider that does not implement it."""


class UnsupportedOperatorError(OnnxRuntimeError):
    """No registered provider can run a node (operator, domain or opset not implemented)."""


class KernelError(ProviderError):
    """A kernel failed while executing a node."""


class DeviceValidationError(KernelError):
    """A device kernel flagged invalid data (e.g. an out-of-range index) at a host boundary."""


class PluginError(OnnxRuntimeError):
    """A provider plugin is broken: it failed to import, or its hook implementations are invalid."""
