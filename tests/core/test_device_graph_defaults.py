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
from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

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


# -- segmented capture and the VERIFY slot through the defaults -----------------------------------------------------
def seam_model() -> bytes:
    """y = Relu(x) * Neg(Relu(x)) + x: Neg runs on the CPU provider (the sample device runs Relu, Mul, Add only),
    an eager seam between the sample device's nodes."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Neg", ["r"], ["n"], name="neg"),
             helper.make_node("Mul", ["r", "n"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "x"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def seam_reference(x: np.ndarray) -> np.ndarray:
    r = np.maximum(x.astype(np.float64), 0)
    return -r * r + x


class SegmentedSampleExecutionProvider(SampleDeviceExecutionProvider):
    """The sample device with graph segments on its single-slot hooks: a capture after an installed graph adds a
    segment (the defaults reset the slot before a fresh capture), and a segment replays on its own."""

    def __init__(self):
        super().__init__()
        self.segments: list[list] = []

    @ort.hookimpl
    def name(self):
        return "SegmentedSampleExecutionProvider"

    @ort.hookimpl
    def short_name(self):
        return "sample-segments"

    @ort.hookimpl
    def end_device_graph_capture(self):
        if self._recording is None:
            raise InvalidArgumentError("no device graph capture is in progress")
        self.segments.append(self._recording)
        self._recording = None

    def _launch(self, launches):
        for fn, inputs, out, shape in launches:
            self._float32(out, shape)[...] = fn(*[self._float32(b, s) for b, s in inputs])
            self.graph_launches += 1

    @ort.hookimpl
    def replay_device_graph(self):
        for segment in self.segments:
            self._launch(segment)

    @ort.hookimpl
    def replay_device_graph_segment(self, index):
        self._launch(self.segments[index])

    @ort.hookimpl
    def reset_device_graph(self):
        installed, self.segments = bool(self.segments), []
        return installed


@pytest.fixture
def segmented_sample():
    ort.register_provider(SegmentedSampleExecutionProvider)
    yield "SegmentedSampleExecutionProvider"
    ort.unregister_provider("SegmentedSampleExecutionProvider")


def seam_session(provider: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(seam_model(), options, providers=[provider, "CPUExecutionProvider"])


def test_segments_with_an_eager_seam_through_the_defaults(segmented_sample):
    session = seam_session(segmented_sample)
    assert {p.provider for p in session.placement()} == {segmented_sample, "CPUExecutionProvider"}
    device = session.provider_handle(segmented_sample).provider
    runner = session._executor.graphs  # noqa: SLF001
    rng = np.random.default_rng(2)
    for _ in range(5):
        x = rng.standard_normal(6).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, seam_reference(x), rtol=1e-6, atol=1e-6)
    assert session.device_graph_status() == (
        "replaying 2 graph segments with eager seams (node 'neg' (Neg) runs on CPUExecutionProvider, a host "
        "provider)")
    assert runner.counts["captures"] == 1 and runner.counts["segment_captures"] == 2
    assert runner.counts["segment_replays"] == 2 * 4  # the capturing run launches its segments too
    assert len(device.segments) == 2 and device.graph_launches == 3 * 4  # relu | mul, add: recorded, not eager
    session.close()
    assert device.frees == device.allocations


def test_a_provider_without_segment_replay_runs_a_seamed_plan_eagerly():
    session = seam_session(SAMPLE)
    x = np.linspace(-2, 2, 6, dtype=np.float32)
    for _ in range(3):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, seam_reference(x), rtol=1e-6, atol=1e-6)
    assert session.device_graph_status() == (
        "eager: node 'neg' (Neg) runs on CPUExecutionProvider, a host provider; SampleDeviceExecutionProvider does "
        "not replay graph segments (replay_device_graph_segment), so the eager seams between segments cannot run")
    session.close()


def test_verify_runs_on_a_primary_only_provider_stay_eager_and_keep_the_decode_graph():
    session = capture_session()
    runner = session._executor.graphs  # noqa: SLF001
    verify = ort.RunOptions()
    verify.add_run_config_entry("device_graph.slot", "verify")
    rng = np.random.default_rng(4)
    for step in range(6):  # decode steps (1 row) and verification steps (4 rows) interleaved
        x = rng.standard_normal(1).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)
        if step:
            assert session.device_graph_status() == "replaying"
        x = rng.standard_normal(4).astype(np.float32)
        (y,) = session.run(None, {"x": x}, verify)
        np.testing.assert_allclose(y, reference(x), rtol=1e-6, atol=1e-6)
        if step:
            assert "slot VERIFY is not supported" in session.device_graph_status()
    assert runner.captures == 1 and runner.replays == 5  # the decode graph was never evicted
    bad = ort.RunOptions()
    bad.add_run_config_entry("device_graph.slot", "draft")
    with pytest.raises(InvalidArgumentError, match="'primary'.*'verify'"):
        session.run(None, {"x": x}, bad)
    session.close()


def test_one_segment_after_a_host_seam_replays_on_a_provider_without_segments():
    """A host node before every device node is a seam but no gap: the one graph replays on the sample device
    (which has no segment replay), with the host value copied into a pinned buffer at every run."""
    nodes = [helper.make_node("Neg", ["x"], ["n"], name="neg"),
             helper.make_node("Relu", ["n"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "n"], ["m"], name="mul"),
             helper.make_node("Add", ["m", "x"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    session = ort.InferenceSession(model, options, providers=[SAMPLE, "CPUExecutionProvider"])
    device = session.provider_handle(SAMPLE).provider
    rng = np.random.default_rng(7)
    for _ in range(4):
        x = rng.standard_normal(5).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        n = -x.astype(np.float64)
        np.testing.assert_allclose(y, np.maximum(n, 0) * n + x, rtol=1e-6, atol=1e-6)
    assert session.device_graph_status() == (
        "replaying 1 graph segment with eager seams (node 'neg' (Neg) runs on CPUExecutionProvider, a host provider)")
    assert device.graph_launches == 3 * 3
    session.close()
    assert device.frees == device.allocations
