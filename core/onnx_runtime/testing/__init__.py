"""``onnx_runtime.testing``: a pytest plugin for testing an execution provider against the contract and the
onnx backend suite.

Enable it with ``pytest -p onnx_runtime.testing --provider NAME`` (or ``onnx_runtime_testing = true`` and
``onnx_runtime_provider = NAME`` in the ini file). It adds fixtures (``provider_name``, ``provider_handle``,
``session_factory``), the onnx backend node cases and model sets run on the provider
(:mod:`onnx_runtime.testing.backend`: ``--pyargs onnx_runtime.testing.backend``, or import its tests into a test
module), contract checks for every hook the provider implements, and a summary line of what the provider
supports. See docs/writing-a-provider.md.
"""

from onnx_runtime_pytest import pytest_addoption, pytest_configure

__all__ = ["pytest_addoption", "pytest_configure"]
