"""Placement across two providers, one of them on a non-host device, with copies at the boundaries."""

from __future__ import annotations

import gc
import re

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import chain_reference
from onnx_runtime.errors import UnsupportedOperatorError

SAMPLE = "SampleDeviceExecutionProvider"
CPU = "CPUExecutionProvider"


def _x():
    return np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)


def test_nodes_go_to_the_first_provider_that_accepts_them(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[SAMPLE, CPU])
    placement = sess.placement()
    assert placement.as_dict() == {"relu": SAMPLE, "add": SAMPLE, "softmax": CPU, "mul": SAMPLE}
    assert placement["softmax"].rejected == {SAMPLE: "SampleDeviceExecutionProvider runs only ['Add', 'Mul', 'Relu']"}
    assert placement["relu"].rejected == {}
    assert placement.summary() == {SAMPLE: 3, CPU: 1}
    assert sess.get_providers() == [SAMPLE, CPU]


def test_copies_at_device_boundaries_give_the_cpu_result(chain_model):
    x = _x()
    mixed = ort.InferenceSession(chain_model.SerializeToString(), providers=[SAMPLE, CPU])
    cpu_only = ort.InferenceSession(chain_model.SerializeToString(), providers=["cpu"])
    (got,) = mixed.run(None, {"x": x})
    (want,) = cpu_only.run(None, {"x": x})
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, chain_reference(x), rtol=1e-5)
    copies = {(c.value, c.source, c.target) for c in mixed.placement().copies}
    # x goes up twice-needed but is copied once; a comes down for Softmax; s goes up for Mul; y comes down.
    assert copies == {("x", "host", SAMPLE), ("a", SAMPLE, "host"), ("s", "host", SAMPLE), ("y", SAMPLE, "host")}


def test_every_device_allocation_is_freed_exactly_once(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[SAMPLE, CPU])
    device = sess.provider_handle(SAMPLE)
    assert device.provider.handle is device  # initialize received the handle it is dispatched through
    for _ in range(3):
        sess.run(None, {"x": _x()})
    gc.collect()
    allocations, frees = device.allocation_counts()
    # Only the uploaded initializer b stays resident between runs.
    assert allocations - frees == 1
    assert allocations >= 1 + 3 * 5
    sess.close()
    allocations, frees = device.allocation_counts()
    assert allocations == frees
    assert device.provider.memory == {}


def test_claimed_nodes_win_over_priority_order(chain_model):
    sess = ort.InferenceSession(
        chain_model.SerializeToString(), providers=[CPU, SAMPLE], provider_options=[{}, {"claim": "mul"}]
    )
    placement = sess.placement()
    assert placement["mul"].provider == SAMPLE and placement["mul"].claimed
    assert placement["relu"].provider == CPU and not placement["relu"].claimed
    (got,) = sess.run(None, {"x": _x()})
    np.testing.assert_allclose(got, chain_reference(_x()), rtol=1e-5)


def test_a_node_no_provider_supports_names_op_domain_opset_and_reasons(chain_model):
    with pytest.raises(UnsupportedOperatorError) as info:
        ort.InferenceSession(chain_model.SerializeToString(), providers=[SAMPLE])
    message = str(info.value)
    # Softmax has a function body, so it is expanded first; the error names the inner operator
    # that nothing implements, and the node it came from.
    assert "in the function body of node 'softmax' (Softmax)" in message
    assert re.search(r"operator \w+ \(domain ai.onnx, opset \d+\)", message)
    assert "SampleDeviceExecutionProvider runs only" in message


def test_placement_report_prints_declines_and_copies(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[SAMPLE, CPU])
    sess.run(None, {"x": _x()})
    text = str(sess.placement())
    assert "softmax (Softmax) on CPUExecutionProvider" in text
    assert "SampleDeviceExecutionProvider declined: SampleDeviceExecutionProvider runs only" in text
    assert "a: SampleDeviceExecutionProvider -> host" in text


class _FoldsDoubleRelu:
    """A provider whose custom pass removes the second of two chained Relus (Relu is idempotent)."""

    @ort.hookimpl
    def name(self):
        return "FoldingExecutionProvider"

    @ort.hookimpl
    def custom_passes(self):
        def fold_double_relu(graph):
            producers = graph.producers()
            for node in list(graph.nodes):
                first = producers.get(node.inputs[0]) if node.op_type == "Relu" else None
                if first is not None and first.op_type == "Relu":
                    node.op_type, node.inputs = "Identity", [first.outputs[0]]
                    return True
            return False

        return [fold_double_relu]


def _double_relu_model():
    from model_helpers import make_model, tensor_info
    from onnx import helper

    nodes = [helper.make_node("Relu", ["x"], ["r1"], name="r1"), helper.make_node("Relu", ["r1"], ["y"], name="r2")]
    return make_model(nodes, [tensor_info("x", shape=[3])], [tensor_info("y", shape=[3])])


def test_provider_custom_passes_rewrite_the_graph_before_placement():
    ort.register_provider(_FoldsDoubleRelu)
    try:
        sess = ort.InferenceSession(
            _double_relu_model().SerializeToString(), providers=["FoldingExecutionProvider", CPU]
        )
        assert sess.applied_passes() == ["FoldingExecutionProvider:fold_double_relu"]
        assert [(n.node, n.op_type) for n in sess.placement()] == [("r1", "Relu"), ("r2", "Identity")]
        np.testing.assert_array_equal(sess.run(None, {"x": np.array([-1, 0, 2], np.float32)})[0], [0, 0, 2])
    finally:
        ort.unregister_provider("FoldingExecutionProvider")


def test_a_pass_that_breaks_the_graph_is_reported():
    class Breaker:
        @ort.hookimpl
        def name(self):
            return "BreakingExecutionProvider"

        @ort.hookimpl
        def custom_passes(self):
            def dangle(graph):
                graph.nodes[0].inputs = ["nowhere"]
                return True

            return [dangle]

    from onnx_runtime.errors import InvalidGraphError

    ort.register_provider(Breaker)
    try:
        with pytest.raises(
            InvalidGraphError, match=r"graph passes \['BreakingExecutionProvider:dangle'\] left an invalid"
        ):
            ort.InferenceSession(_double_relu_model().SerializeToString(), providers=["BreakingExecutionProvider", CPU])
    finally:
        ort.unregister_provider("BreakingExecutionProvider")
