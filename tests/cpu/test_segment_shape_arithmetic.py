"""A dynamic export's shape arithmetic between a CNN's convolutions (a ShuffleNet channel shuffle's Reshape targets:
Shape, Gather, Div, Unsqueeze and Concat over int64, as torch's TorchScript exporter writes them for a dynamic
batch) stays out of the segment and moves before it (segment_fusions.shape_arithmetic): the segment keeps the
convolutions, the Reshapes and the Transpose, and gets a bound plan (a Div of two int64 scalars inside it gave a
numpy scalar, no array, and the whole segment ran node by node). Checked against a float64 reference."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.loader import load_model
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.conv_fusions import CONV_PASSES
from onnx_runtime_ep_cpu.fusions import PASSES
from onnx_runtime_ep_cpu.ops.segment import Segment
from reference64 import run_float64

_SHAPE_OPS = {"Shape", "Gather", "Div", "Unsqueeze", "Concat"}


def _shuffle_model() -> onnx.ModelProto:
    """conv -> conv -> Reshape (N, 2, C/2, H, W) -> Transpose -> Reshape (N, C, H, W) -> conv -> conv, the targets
    computed from Shape(x) between the second convolution and the first Reshape."""
    rng = np.random.default_rng(3)
    inits, nodes = [], []

    def conv(x, y, cin, cout):
        inits.append(numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(9 * cin)).astype(
            np.float32), f"{y}_w"))
        inits.append(numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{y}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", f"{y}_b"], [f"{y}_c"], kernel_shape=[3, 3], pads=[1] * 4))
        nodes.append(helper.make_node("Relu", [f"{y}_c"], [y]))

    def scalar(name, value):
        inits.append(numpy_helper.from_array(np.array(value, np.int64), name))

    conv("x", "c1", 3, 8)
    conv("c1", "c2", 8, 8)
    for name, value in (("zero", 0), ("two_at", 2), ("three_at", 3), ("groups", 2), ("channels", 8)):
        scalar(name, value)
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axes"))
    inits.append(numpy_helper.from_array(np.array([2], np.int64), "two"))
    inits.append(numpy_helper.from_array(np.array([8], np.int64), "eight"))
    nodes += [helper.make_node("Shape", ["x"], ["s"]),
              helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
              helper.make_node("Gather", ["s", "two_at"], ["h"], axis=0),
              helper.make_node("Gather", ["s", "three_at"], ["w"], axis=0),
              helper.make_node("Div", ["channels", "groups"], ["half"])]
    for value in ("n", "half", "h", "w"):
        nodes.append(helper.make_node("Unsqueeze", [value, "axes"], [f"{value}_1"]))
    nodes += [helper.make_node("Concat", ["n_1", "two", "half_1", "h_1", "w_1"], ["split_shape"], axis=0),
              helper.make_node("Reshape", ["c2", "split_shape"], ["split"]),
              helper.make_node("Transpose", ["split"], ["shuffled"], perm=[0, 2, 1, 3, 4]),
              helper.make_node("Concat", ["n_1", "eight", "h_1", "w_1"], ["back_shape"], axis=0),
              helper.make_node("Reshape", ["shuffled", "back_shape"], ["back"])]
    conv("back", "c3", 8, 8)
    conv("c3", "y", 8, 4)
    graph = helper.make_graph(nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               ["batch", 3, 10, 10])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def test_shape_arithmetic_moves_before_the_segment():
    graph = load_model(_shuffle_model()).graph
    for graph_pass in [*PASSES, *CONV_PASSES]:
        graph_pass(graph, None)
    ops = [n.op_type for n in graph.nodes]
    (segment,) = [n for n in graph.nodes if n.op_type == "FusedSegment"]
    inside = [n.op_type for n in segment.attr("body").nodes]
    assert not set(inside) & _SHAPE_OPS and inside.count("Reshape") == 2 and "Transpose" in inside
    assert ops[-1] == "FusedSegment" and set(ops[:-1]) <= _SHAPE_OPS


def test_the_segment_is_planned_and_matches_float64(monkeypatch):
    segments: dict[int, Segment] = {}
    call = Segment.__call__

    def recording(self, *inputs):
        segments[id(self)] = self
        return call(self, *inputs)

    monkeypatch.setattr(Segment, "__call__", recording)
    model = _shuffle_model()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])
    rng = np.random.default_rng(4)
    sess.run(None, {"x": rng.standard_normal((1, 3, 10, 10)).astype(np.float32)})
    deferred.wait_ready(240)  # (a first run is served by numpy while the compiled kernels load: planned after)
    for batch in (1, 1, 3, 3):
        x = rng.standard_normal((batch, 3, 10, 10)).astype(np.float32)
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert got.shape == exact.shape and np.abs(got - exact).max() <= 2e-5 * (1 + np.abs(exact).max()), batch
    segments = list(segments.values())  # (the ones the runs called: one per specialization)
    assert segments and all(not any(n.node.op_type in _SHAPE_OPS for n in s.inner) for s in segments)
    assert any(plan is not None for s in segments for plans in s.plans.values() for plan in plans or [None])
