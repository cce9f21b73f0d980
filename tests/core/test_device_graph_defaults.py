"""Device graphs through the contract's defaults: a provider implementing only the single-slot graph
hooks (the sample device, one graph per provider) captured and replayed by a session, and slot sweeps.

The sample device's kernels compute with numpy on its private memory, so the float64 reference below
is exact up to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx_runtime import DeviceGraphOwner, DeviceGraphSlot, DeviceGraphToken, ProviderHandle
from onnx_runtime.errors import InvalidArgumentError

SAMPLE = "SampleDeviceExecutionProvider"
PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY


def relu_mul_model() -> bytes:
    """y = Relu(x) * x + x."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "x"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "x"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def reference(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return np.maximum(x64, 0) * x64 + x64


def capture_session() -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(relu_mul_model(), options, providers=[SAMPLE])


def test_a_single_slot_provider_never_replays_another_signatures_graph():
    session = capture_session()
    runner = session._executor.graphs  # noqa: SLF001
    device = session.provider_handle(SAMPLE).provider
    rng = np.random.default_rng(0)
    for n in (4, 8):  # warm up and capture each shape: the provider's one graph is then the [8] graph
        for _ in range(2):
            x = rng.standard_normal(n).astype(np.float32)
            (y,) = session.run(None, {"x": x})
            np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)
    assert runner.captures == 2 and session.device_graph_status() == "replaying"
    launches = device.graph_launches
    for n in (4, 8, 4, 4, 8):  # back and forth: every result is this run's, replayed or not
        x = rng.standard_normal(n).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)
    assert device.graph_launches > launches  # graphs did run, after being captured again
    x = rng.standard_normal(4).astype(np.float32)
    (y,) = session.run(None, {"x": x})  # the [4] graph is installed now: a plain replay
    np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)
    assert session.device_graph_status() == "replaying"
    session.close()


def sample_handle() -> ProviderHandle:
    from onnx_runtime.discovery import registry

    handle = registry().require("sample").create()
    handle.initialize({})
    return handle


def test_owned_defaults_track_the_graph_the_slot_holds():
    handle = sample_handle()
    a, b = DeviceGraphOwner.new(), DeviceGraphOwner.new()
    first = handle.hook.begin_owned_device_graph_capture(owner=a, slot=PRIMARY, continuation=None, kernels=[])
    assert first == DeviceGraphToken(a, PRIMARY, 1)
    assert not handle.hook.has_owned_device_graph(token=first)  # not installed while capturing
    handle.hook.end_owned_device_graph_capture(token=first)
    assert handle.hook.has_owned_device_graph(token=first)
    handle.hook.replay_owned_device_graph(token=first)

    # Another owner's capture replaces the one graph: the old token is dead, and touches nothing.
    other = handle.hook.begin_owned_device_graph_capture(owner=b, slot=PRIMARY, continuation=None, kernels=[])
    handle.hook.end_owned_device_graph_capture(token=other)
    assert not handle.hook.has_owned_device_graph(token=first)
    with pytest.raises(InvalidArgumentError, match="does not name the graph its slot holds"):
        handle.hook.replay_owned_device_graph(token=first)
    assert handle.hook.reset_owned_device_graph(token=first) is False
    handle.hook.abort_owned_device_graph_capture(token=first)  # no capture of its own: nothing aborted
    assert handle.hook.has_owned_device_graph(token=other)
    with pytest.raises(InvalidArgumentError, match="does not name the graph its slot holds"):
        handle.hook.begin_owned_device_graph_capture(owner=a, slot=PRIMARY, continuation=first, kernels=[])

    # Capturing again mints a new generation for the same owner.
    again = handle.hook.begin_owned_device_graph_capture(owner=a, slot=PRIMARY, continuation=None, kernels=[])
    assert again == DeviceGraphToken(a, PRIMARY, 2)
    handle.hook.end_owned_device_graph_capture(token=again)
    assert not handle.hook.has_owned_device_graph(token=other)
    assert handle.hook.reset_owned_device_graph(token=again) is True
    assert handle.hook.reset_owned_device_graph(token=again) is False  # exactly once
    assert not handle.hook.has_owned_device_graph(token=again)
    with pytest.raises(InvalidArgumentError):
        handle.hook.end_owned_device_graph_capture(token=again)  # no capture in progress
    handle.hook.retire_owned_device_graphs(owner=a)
    handle.hook.retire_owned_device_graphs(owner=b)
    handle.shutdown()


def test_slot_iteration_yields_only_slots_and_a_reset_sweep_is_safe():
    assert list(DeviceGraphSlot) == [PRIMARY, VERIFY] and len(DeviceGraphSlot) == DeviceGraphSlot.COUNT == 2
    with pytest.raises(ValueError):
        DeviceGraphSlot(DeviceGraphSlot.COUNT)
    handle = sample_handle()
    token = handle.hook.begin_owned_device_graph_capture(
        owner=DeviceGraphOwner.new(), slot=PRIMARY, continuation=None, kernels=[])
    handle.hook.end_owned_device_graph_capture(token=token)
    assert [handle.hook.reset_device_graph_in(slot=slot) for slot in DeviceGraphSlot] == [True, False]
    with pytest.raises(InvalidArgumentError, match="not a device graph slot"):
        handle.hook.reset_device_graph_in(slot=2)
    handle.shutdown()
