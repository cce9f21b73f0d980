"""A provider handle calls its hooks through a resolved table (hook_table.py), without building pluggy's manager,
and keeps pluggy's semantics: the arguments an implementation names, validation errors, plugins registered on
the handle afterwards."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.discovery import registry
from onnx_runtime.errors import PluginError
from onnx_runtime.hook_table import class_hooks, provider_hooks
from onnx_runtime.provider_handle import ProviderHandle


@pytest.fixture
def fresh_registry():
    registry().refresh()
    yield registry()
    registry().refresh()


class _Negator:
    """Implements supports_op and get_kernel with fewer arguments than the specification passes."""

    @ort.hookimpl
    def name(self):
        return "NegatorExecutionProvider"

    @ort.hookimpl
    def supports_op(self, node):
        return ort.KernelMatch.supported() if node.op_type == "Neg" else ort.KernelMatch.unsupported("Neg only")

    @ort.hookimpl
    def get_kernel(self, node, opset):
        return lambda x: (-x,)


def _neg_model():
    return make_model([helper.make_node("Neg", ["x"], ["y"])], [tensor_info("x", shape=[3])],
                      [tensor_info("y", shape=[3])])


def test_cpu_provider_handle_builds_no_pluggy_manager():
    from onnx_runtime_ep_cpu.provider import CPUExecutionProvider

    handle = ProviderHandle(CPUExecutionProvider())
    assert not handle.manager_built
    assert handle.name == "CPUExecutionProvider" and handle.is_host_accessible
    handle.initialize({}, {"session.intra_op_num_threads": "1"})
    buffer = handle.allocate(64)  # a default hook (the CPU provider's own or the core's), still no manager
    handle.deallocate(buffer)
    handle.shutdown()
    assert not handle.manager_built


def test_table_passes_only_the_arguments_an_implementation_names(fresh_registry):
    ort.register_provider(_Negator)
    try:
        sess = ort.InferenceSession(_neg_model().SerializeToString(), providers=["negator"])
        np.testing.assert_array_equal(sess.run(None, {"x": np.array([1, -2, 3], np.float32)})[0], [-1, 2, -3])
        handle = sess.provider_handle("NegatorExecutionProvider")
        assert not handle.manager_built
        assert handle.hook.short_name() == "negator"  # a default, resolved from the core's fallbacks
    finally:
        ort.unregister_provider("NegatorExecutionProvider")


def test_plugins_registered_on_the_handle_take_part_after_the_table_resolved():
    handle = ProviderHandle(_Negator())
    assert handle.hook.name() == "NegatorExecutionProvider"
    calls = []

    class Wrapper:
        @ort.hookimpl(hookwrapper=True)
        def get_kernel(self, node, opset):
            calls.append(node)
            yield

    handle.pm.register(Wrapper(), name="wrapper")
    node = helper.make_node("Neg", ["x"], ["y"])
    kernel = handle.hook.get_kernel(node=node, shapes=[(1,)], opset=17, graph=None)
    assert calls == [node]
    np.testing.assert_array_equal(kernel(np.array([1.0]))[0], [-1.0])
    assert handle.hook.name() == "NegatorExecutionProvider"  # resolved before: now through pluggy too


def test_invalid_implementation_still_fails_with_pluggys_message():
    class Extra:
        @ort.hookimpl
        def name(self):
            return "ExtraExecutionProvider"

        @ort.hookimpl
        def supports_op(self, node, colour):  # an argument the specification does not have
            return ort.KernelMatch.supported()

    assert class_hooks(Extra) is None
    with pytest.raises(PluginError, match=r"(?s)invalid hook implementation.*colour"):
        ProviderHandle(Extra())


def test_hook_set_on_the_instance_is_read_by_pluggy():
    provider = _Negator()
    provider.short_name = ort.hookimpl(lambda: "own")
    assert provider_hooks(provider) is None
    handle = ProviderHandle(provider)
    assert handle.manager_built and handle.short_name == "own"


def test_an_entry_point_modules_providers_are_read_without_pluggy_as_with_it():
    import types

    from onnx_runtime import discovery

    module = types.ModuleType("fake_negator_plugin")
    module.onnx_runtime_providers = ort.hookimpl(lambda: [_Negator])
    assert discovery._plain_discovery_hook(module) is module.onnx_runtime_providers  # noqa: SLF001
    assert discovery._provider_classes(module) == [_Negator]  # noqa: SLF001
    empty = types.ModuleType("fake_empty_plugin")
    empty.onnx_runtime_providers = ort.hookimpl(lambda: [])
    with pytest.raises(PluginError, match="contributes no provider classes"):
        discovery._provider_classes(empty)  # noqa: SLF001
    odd = types.ModuleType("fake_odd_plugin")
    odd.onnx_runtime_providers = ort.hookimpl(lambda colour: [_Negator])  # pluggy validates it (and refuses it)
    assert discovery._plain_discovery_hook(odd) is None  # noqa: SLF001
    with pytest.raises(PluginError):
        discovery._provider_classes(odd)  # noqa: SLF001
