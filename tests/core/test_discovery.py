"""Discovery: providers from real entry points (installed distributions), broken plugins, in-process
registration."""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.discovery import registry
from onnx_runtime.errors import InvalidArgumentError, PluginError, ProviderNotAvailableError


@pytest.fixture
def fresh_registry():
    registry().refresh()
    yield registry()
    registry().refresh()


def _install_fake_distribution(root, dist: str, module: str, source: str, entry_name: str):
    """Lay out an installed distribution (dist-info + module) on sys.path, as pip would."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[onnx_runtime.providers]\n{entry_name} = {module}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_ep_")]:
        del sys.modules[name]


def test_builtin_and_third_party_providers_come_from_entry_points(fresh_registry):
    by_name = {e.name: e for e in fresh_registry.entries()}
    cpu = by_name["CPUExecutionProvider"]
    assert (cpu.short_name, cpu.distribution, cpu.version) == ("cpu", "onnx-runtime-ep-cpu", "0.1.0")
    assert "entry point 'cpu'" in cpu.source and cpu.availability.available
    sample = by_name["SampleDeviceExecutionProvider"]
    assert sample.distribution == "onnx-runtime-sample-provider" and sample.device == "other:7"
    assert "CPUExecutionProvider" in ort.get_available_providers()
    assert ort.get_available_providers()[-1] == "CPUExecutionProvider"  # device providers first


def test_cuda_is_listed_but_unavailable_without_a_driver(fresh_registry):
    driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
    entry = fresh_registry.find("cuda")
    assert entry is not None and entry.name == "CUDAExecutionProvider"

    if driver.probe():  # no usable driver here: the reason is shown, the provider is not offered
        assert not entry.availability.available
        assert entry.availability.reason == driver.probe()
        assert "CUDAExecutionProvider" not in ort.get_available_providers()
        assert "CUDAExecutionProvider" in ort.get_all_providers()


def test_a_plugin_that_fails_to_import_warns_and_the_others_still_load(site, fresh_registry):
    _install_fake_distribution(
        site, "fake-broken-ep", "fake_ep_broken", "raise ImportError('needs libfoo')\n", "broken"
    )
    with pytest.warns(
        RuntimeWarning, match=r"fake_ep_broken.*fake-broken-ep.*import failed: ImportError: needs libfoo"
    ):
        names = [e.name for e in fresh_registry.entries()]
    assert "CPUExecutionProvider" in names
    assert [b.reason for b in fresh_registry.broken] == ["import failed: ImportError: needs libfoo"]


def test_a_plugin_with_an_invalid_hook_warns_naming_it(site, fresh_registry):
    source = """
        from onnx_runtime import hookimpl

        class BadHooksExecutionProvider:
            @hookimpl
            def name(self):
                return "BadHooksExecutionProvider"

            @hookimpl
            def suports_op(self, node):
                return None

        @hookimpl
        def onnx_runtime_providers():
            return [BadHooksExecutionProvider]
    """
    _install_fake_distribution(site, "fake-badhooks-ep", "fake_ep_badhooks", source, "badhooks")
    with pytest.warns(
        RuntimeWarning, match=r"BadHooksExecutionProvider.*unknown hooks: 'suports_op' \(did you mean 'supports_op'\?\)"
    ):
        names = [e.name for e in fresh_registry.entries()]
    assert "BadHooksExecutionProvider" not in names and "CPUExecutionProvider" in names


def test_a_working_third_party_distribution_is_found_without_code_changes(site, fresh_registry):
    source = """
        import numpy as np
        from onnx_runtime import KernelMatch, hookimpl

        class NegExecutionProvider:
            @hookimpl
            def name(self):
                return "NegExecutionProvider"

            @hookimpl
            def supports_op(self, node):
                ok = node.op_type == "Neg"
                return KernelMatch.supported() if ok else KernelMatch.unsupported("runs only Neg")

            @hookimpl
            def get_kernel(self, node):
                return lambda x: (np.negative(x) * 1,)

        @hookimpl
        def onnx_runtime_providers():
            return [NegExecutionProvider]
    """
    _install_fake_distribution(site, "fake-neg-ep", "fake_ep_neg", source, "neg")
    model = make_model(
        [helper.make_node("Neg", ["x"], ["y"])], [tensor_info("x", shape=[3])], [tensor_info("y", shape=[3])]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["neg"])
    assert sess.get_providers() == ["NegExecutionProvider"]
    np.testing.assert_array_equal(sess.run(None, {"x": np.array([1, -2, 3], np.float32)})[0], [-1, 2, -3])
    assert fresh_registry.find("NegExecutionProvider").distribution == "fake-neg-ep"


class _Doubler:
    """A provider registered in-process, without packaging."""

    @ort.hookimpl
    def name(self):
        return "DoublerExecutionProvider"

    @ort.hookimpl
    def supports_op(self, node):
        return (
            ort.KernelMatch.supported() if node.op_type == "Identity" else ort.KernelMatch.unsupported("Identity only")
        )

    @ort.hookimpl
    def get_kernel(self, node):
        return lambda x: (x * 2,)


def _identity_model():
    return make_model(
        [helper.make_node("Identity", ["x"], ["y"])], [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])]
    )


@pytest.mark.parametrize("plugin", [_Doubler, _Doubler()], ids=["class", "instance"])
def test_in_process_registration_of_a_class_or_an_instance(plugin, fresh_registry):
    assert ort.register_provider(plugin) == ["DoublerExecutionProvider"]
    try:
        assert "DoublerExecutionProvider" in ort.get_available_providers()
        sess = ort.InferenceSession(_identity_model().SerializeToString(), providers=["doubler", "cpu"])
        np.testing.assert_array_equal(sess.run(None, {"x": np.array([1, 2], np.float32)})[0], [2, 4])
        assert sess.placement().provider_of("Identity_0") == "DoublerExecutionProvider"
    finally:
        ort.unregister_provider("DoublerExecutionProvider")
    assert "DoublerExecutionProvider" not in ort.get_all_providers()


def test_registering_an_invalid_provider_in_process_raises(fresh_registry):
    class Nameless:
        @ort.hookimpl
        def supports_op(self, node):
            return ort.KernelMatch.unsupported("x")

    with pytest.raises(PluginError, match="must implement the `name` hook"):
        ort.register_provider(Nameless)
    with pytest.raises(PluginError, match="already registered"):
        ort.register_provider(type("Dup", (), {"name": ort.hookimpl(lambda self: "CPUExecutionProvider")}))


def test_unknown_provider_name_says_what_is_installed_and_how_to_install(chain_model):
    with pytest.raises(
        ProviderNotAvailableError, match=r"'TensorrtExecutionProvider' is not installed \(installed: \["
    ):
        ort.InferenceSession(chain_model.SerializeToString(), providers=["TensorrtExecutionProvider"])


def test_only_unavailable_providers_requested_gives_their_reasons(chain_model, fresh_registry):
    pytest.importorskip("onnx_runtime_ep_cuda", reason="the CUDA provider is not installed")
    if fresh_registry.find("cuda").availability.available:
        pytest.skip("a CUDA driver is present")
    with pytest.raises(ProviderNotAvailableError, match=r"CUDAExecutionProvider: no NVIDIA driver found"):
        ort.InferenceSession(chain_model.SerializeToString(), providers=["CUDAExecutionProvider"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = ort.InferenceSession(chain_model.SerializeToString(), providers=["cuda", "cpu"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    assert any("skipping unavailable provider CUDAExecutionProvider" in str(w.message) for w in caught)


def test_with_no_provider_installed_the_error_names_the_extra(chain_model, monkeypatch, fresh_registry):
    monkeypatch.setattr("onnx_runtime.discovery.ENTRY_POINT_GROUP", "onnx_runtime.providers.none_installed")
    fresh_registry.refresh()
    assert ort.get_all_providers() == []
    with pytest.raises(ProviderNotAvailableError, match=r"no execution provider is installed.*onnx-runtime\[cpu\]"):
        ort.InferenceSession(chain_model.SerializeToString())


def test_unregistering_an_unknown_provider_says_what_is_registered(fresh_registry):
    with pytest.raises(InvalidArgumentError, match=r"no provider named 'NopeExecutionProvider' is registered"):
        ort.unregister_provider("NopeExecutionProvider")
