"""Start-up cost: a provider described by a DeferredProvider is listed, probed and selected like any other, and
its class is imported only when a session creates it (or its hooks are listed)."""

from __future__ import annotations

import onnx_runtime as ort
import pytest
from onnx_runtime.contract.deferred import DeferredProvider
from onnx_runtime.discovery import default_providers, registry
from onnx_runtime.errors import PluginError


@pytest.fixture
def fresh_registry():
    registry().refresh()
    yield registry()
    registry().refresh()


class _Provider:
    @ort.hookimpl
    def name(self):
        return "StartupDeferredExecutionProvider"

    @ort.hookimpl
    def short_name(self):
        return "startup_deferred"

    @ort.hookimpl
    def contract_version(self):
        return "1.2"


def _described(loads: list, **changes) -> DeferredProvider:
    def load():
        loads.append(1)
        return _Provider

    fields = dict(name="StartupDeferredExecutionProvider", short_name="startup_deferred", device="cpu:0",
                  contract_version="1.2", load=load, probe=ort.Availability.yes, selected_by_default=False)
    fields.update(changes)
    return DeferredProvider(**fields)


def _registered(provider):
    class Plugin:
        @staticmethod
        @ort.hookimpl
        def onnx_runtime_providers():
            return [provider]

    return ort.register_provider(Plugin)


def test_listing_and_probing_do_not_import_the_class(fresh_registry):
    loads: list = []
    assert _registered(_described(loads)) == ["StartupDeferredExecutionProvider"]
    try:
        assert "StartupDeferredExecutionProvider" in ort.get_available_providers()
        assert "StartupDeferredExecutionProvider" not in default_providers()  # (selected_by_default=False)
        entry = fresh_registry.find("startup_deferred")
        assert entry is not None and entry.device == "cpu:0" and entry.contract_version == "1.2"
        assert loads == []
        handle = entry.create()
        assert loads == [1] and handle.name == "StartupDeferredExecutionProvider"
        assert sorted(entry.implemented_hooks) == ["contract_version", "name", "short_name"]
        assert entry.create() is not handle
    finally:
        ort.unregister_provider("StartupDeferredExecutionProvider")


def test_a_description_that_disagrees_with_its_class_is_a_plugin_error(fresh_registry):
    _registered(_described([], name="OtherExecutionProvider", short_name="other"))
    try:
        with pytest.raises(PluginError, match="described as 'OtherExecutionProvider'"):
            fresh_registry.require("OtherExecutionProvider").create()
    finally:
        ort.unregister_provider("OtherExecutionProvider")


def test_a_failed_import_at_creation_names_the_provider(fresh_registry):
    def load():
        raise ImportError("no module named startup_missing")

    _registered(_described([], load=load))
    try:
        with pytest.raises(PluginError, match="importing provider 'StartupDeferredExecutionProvider' failed"):
            fresh_registry.require("startup_deferred").create()
    finally:
        ort.unregister_provider("startup_deferred")


def test_contract_versions_are_checked_without_the_import(fresh_registry):
    loads: list = []
    with pytest.raises(PluginError, match="MAJOR.MINOR"):
        _registered(_described(loads, contract_version="two"))
    _registered(_described(loads, contract_version="1.99"))
    try:
        availability = fresh_registry.require("startup_deferred").availability
        assert not availability.available and "upgrade onnx-runtime" in availability.reason
        assert loads == []
    finally:
        ort.unregister_provider("startup_deferred")


def test_a_failing_probe_is_unavailable_with_its_reason(fresh_registry):
    def probe():
        raise OSError("device node missing")

    _registered(_described([], probe=probe))
    try:
        assert "StartupDeferredExecutionProvider" not in ort.get_available_providers()
        assert "device node missing" in fresh_registry.require("startup_deferred").availability.reason
    finally:
        ort.unregister_provider("startup_deferred")
