"""The ``pytest11`` entry point of ``onnx_runtime.testing``: options only, until a run enables the plugin.

pytest imports every installed ``pytest11`` entry point in every run, so this module stays outside the
``onnx_runtime`` package (importing that package loads onnx and numpy) and adds nothing but its options. A run
enables the plugin with ``-p onnx_runtime.testing``, ``--provider NAME``, or ``onnx_runtime_testing = true`` in
its ini file; only then is :mod:`onnx_runtime.testing.plugin` (fixtures, the backend suite, the contract checks
and the summary) imported and registered.
"""

from __future__ import annotations

PLUGIN = "onnx_runtime.testing"


def pytest_addoption(parser) -> None:
    group = parser.getgroup("onnx_runtime", "onnx_runtime.testing (execution-provider conformance)")
    group.addoption("--provider", dest="onnx_runtime_provider", metavar="NAME",
                    help="the execution provider under test (name or short name); enables onnx_runtime.testing")
    group.addoption("--provider-option", dest="onnx_runtime_provider_options", action="append", default=[],
                    metavar="KEY=VALUE", help="a provider option for the provider under test (repeatable)")
    group.addoption("--fallback-provider", dest="onnx_runtime_fallback", metavar="NAME",
                    help="the provider listed after the one under test in backend cases ('none': no fallback; "
                         "default: CPUExecutionProvider when installed)")
    group.addoption("--backend-exclusions", dest="onnx_runtime_exclusions", metavar="FILE",
                    help="backend cases skipped as wrong, one 'NAME REASON' per line")
    parser.addini("onnx_runtime_testing", "enable the onnx_runtime.testing plugin", type="bool", default=False)
    parser.addini("onnx_runtime_provider", "the execution provider under test when --provider is not given")
    parser.addini("onnx_runtime_backend_exclusions", "backend cases skipped as wrong ('NAME REASON' lines)",
                  type="paths")


def enabled(config) -> bool:
    """Whether this run asked for the plugin (``-p``, ``--provider`` or the ini flag)."""
    return bool(config.getoption("onnx_runtime_provider") or PLUGIN in (config.getoption("plugins") or [])
                or config.getini("onnx_runtime_testing"))


def pytest_configure(config) -> None:
    if enabled(config):
        import importlib

        config.pluginmanager.register(importlib.import_module("onnx_runtime.testing.plugin"), f"{PLUGIN}.plugin")
