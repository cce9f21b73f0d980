"""Issue 24's contract-level defects for provider authors: the versioned contract, a hook method without its
marker, a broken plugin asked for by name, and the machine-readable provider listing."""

from __future__ import annotations

import importlib
import json
import textwrap

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.cli import main
from onnx_runtime.contract.version import VERSION, incompatibility, parse
from onnx_runtime.discovery import registry
from onnx_runtime.errors import PluginError, ProviderNotAvailableError


@pytest.fixture
def fresh_registry():
    registry().refresh()
    yield registry()
    registry().refresh()


def _relu_model():
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", shape=[3])],
                      [tensor_info("y", shape=[3])]).SerializeToString()


def _provider(name: str, version: str | None):
    """A host provider running Relu with numpy, written for contract ``version`` (None: it does not say)."""

    class Provider:
        @ort.hookimpl
        def name(self):
            return name

        @ort.hookimpl
        def supports_op(self, node, opset):
            return ort.KernelMatch.supported() if node.op_type == "Relu" else ort.KernelMatch.unsupported("no")

        @ort.hookimpl
        def get_kernel(self, node, opset):
            return lambda x: (np.maximum(x, 0),)

    if version is not None:
        Provider.contract_version = ort.hookimpl(lambda self: version)
    return Provider


def test_the_contract_has_a_version_and_a_compatibility_rule():
    major, minor = parse(VERSION)
    assert ort.contract.VERSION == VERSION and major >= 1
    assert incompatibility(f"{major}.0") is None and incompatibility(VERSION) is None
    assert "upgrade onnx-runtime" in incompatibility(f"{major}.{minor + 1}")
    assert f"contract {major}.x" in incompatibility(f"{major + 1}.0")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        parse("1")


@pytest.mark.parametrize("declared", [None, "1.0", VERSION])
def test_a_provider_written_for_this_or_an_earlier_minor_version_runs(fresh_registry, declared):
    ort.register_provider(_provider("OldEnoughExecutionProvider", declared))
    try:
        sess = ort.InferenceSession(_relu_model(), providers=["OldEnoughExecutionProvider"])
        assert sess.run(None, {"x": np.array([-1.0, 0.0, 2.0], np.float32)})[0].tolist() == [0.0, 0.0, 2.0]
        assert fresh_registry.find("OldEnoughExecutionProvider").contract_version == (declared or "1.0")
    finally:
        ort.unregister_provider("OldEnoughExecutionProvider")


@pytest.mark.parametrize(("declared", "reason"), [
    (f"{parse(VERSION)[0]}.{parse(VERSION)[1] + 1}", "upgrade onnx-runtime"),
    (f"{parse(VERSION)[0] + 1}.0", "written for provider contract"),
])
def test_a_provider_of_an_incompatible_version_is_unavailable_with_the_reason(fresh_registry, declared, reason):
    ort.register_provider(_provider("TooNewExecutionProvider", declared))
    try:
        assert "TooNewExecutionProvider" in ort.get_all_providers()
        assert "TooNewExecutionProvider" not in ort.get_available_providers()
        with pytest.raises(ProviderNotAvailableError, match=reason):
            ort.InferenceSession(_relu_model(), providers=["TooNewExecutionProvider"])
    finally:
        ort.unregister_provider("TooNewExecutionProvider")


def test_an_invalid_version_is_a_plugin_error(fresh_registry):
    with pytest.raises(PluginError, match="contract_version.*MAJOR.MINOR"):
        ort.register_provider(_provider("BadVersionExecutionProvider", "one"))


def test_a_hook_method_without_its_marker_is_named():
    class Unmarked:
        def name(self):
            return "UnmarkedExecutionProvider"

        @ort.hookimpl
        def supports_op(self, node, opset):
            return ort.KernelMatch.unsupported("none")

        def get_kernel(self, node, opset):
            return None

    with pytest.raises(PluginError, match=r"defines get_kernel, name without the @hookimpl marker"):
        ort.register_provider(Unmarked)


def test_a_broken_plugin_asked_for_by_name_says_why(fresh_registry, tmp_path, monkeypatch):
    info = tmp_path / "fake_broken_named-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-broken-named\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[onnx_runtime.providers]\nbrokenx = fake_broken_named\n")
    (tmp_path / "fake_broken_named.py").write_text(textwrap.dedent("raise ImportError('needs libbrokenx')\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    fresh_registry.refresh()
    with pytest.warns(RuntimeWarning, match="needs libbrokenx"):
        fresh_registry.entries()
    with pytest.raises(ProviderNotAvailableError, match=r"'BrokenXExecutionProvider' is installed but its plugin is "
                                                        r"broken:.*needs libbrokenx"):
        ort.InferenceSession(_relu_model(), providers=["BrokenXExecutionProvider"])


def test_providers_json_lists_versions_availability_and_implemented_hooks(capsys):
    assert main(["providers", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["providers"]}
    cpu = listed["CPUExecutionProvider"]
    assert cpu["short_name"] == "cpu" and cpu["distribution"] == "onnx-runtime-ep-cpu" and cpu["available"] is True
    assert cpu["contract_version"] and cpu["selected_by_default"] is True
    assert {"name", "supports_op", "get_kernel"} <= set(cpu["implemented_hooks"])
    sample = listed.get("SampleDeviceExecutionProvider")
    if sample is not None:
        assert sample["selected_by_default"] is False and "allocate" in sample["implemented_hooks"]
