"""A float16 CNN (float32 input rounded by a Cast to float16, float16 weights, as onnxruntime's
convert_float_to_float16 writes it) runs as one FusedSegment whose bound plan rounds the input as its first
prepared step (segment_steps._bind_round_to_half), instead of a RoundToHalf node of its own before the segment:
that node cost an executor step, a fresh array and the rounding wrapper's copies on every call. Checked
against onnxruntime at float16's tolerance and a float64 reference of the rounded weights and input."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.dtypes import DataType
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import segment as segment_module
from reference64 import run_float64

F16 = TensorProto.FLOAT16


def _half_cnn(size: int = 16) -> onnx.ModelProto:
    rng = np.random.default_rng(11)
    inits = []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float16), name))
        return name

    nodes = [
        helper.make_node("Cast", ["x"], ["xh"], to=F16),
        helper.make_node("Conv", ["xh", weight("w1", 8, 3, 3, 3), weight("b1", 8)], ["c1"], pads=[1] * 4),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", weight("w2", 8, 8, 3, 3), weight("b2", 8)], ["c2"], pads=[1] * 4),
        helper.make_node("Add", ["c2", "r1"], ["res"]),
        helper.make_node("GlobalAveragePool", ["res"], ["pool"]),
        helper.make_node("Flatten", ["pool"], ["flat"]),
        helper.make_node("Gemm", ["flat", weight("fc_w", 5, 8), weight("fc_b", 5)], ["logits_h"], transB=1),
        helper.make_node("Cast", ["logits_h"], ["logits"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(nodes, "half_cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _float32_twin(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same network over the float16-rounded weights in float32 (the reference's input is pre-rounded)."""
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for tensor in twin.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name))
    for node in twin.graph.node:
        if node.op_type == "Cast":
            node.op_type = "Identity"
            del node.attribute[:]
    return twin


def test_input_rounding_is_the_segments_first_step(monkeypatch):
    made = []
    init = segment_module.Segment.__init__

    def recording(self, node):
        init(self, node)
        made.append(self)

    monkeypatch.setattr(segment_module.Segment, "__init__", recording)
    model = _half_cnn()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in sess.placement()] == ["FusedSegment"]  # no RoundToHalf node before it
    oracle_options = onnxruntime.SessionOptions()
    oracle_options.intra_op_num_threads = 1
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), oracle_options,
                                          providers=["CPUExecutionProvider"])
    twin = _float32_twin(model)
    rng = np.random.default_rng(5)
    for run in range(4):  # node by node, then the bound plan
        x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32) * (1 + run)
        (got,) = sess.run(None, {"x": x})
        (wide,) = run_float64(twin, {"x": x.astype(np.float16).astype(np.float32)})
        (theirs,) = oracle.run(None, {"x": x})
        scale = 1 + np.abs(wide).max()
        assert np.abs(got - wide).max() <= 1e-4 * scale, run
        assert np.abs(got - theirs).max() <= 1e-2 * scale, run
        if run == 0:
            deferred.wait_ready(240)  # later runs take the compiled kernels (and so the bound plan)
    (segment,) = [s for s in made if s.plans]  # (the one that ran: another is made while planning the session)
    ((plan,),) = segment.plans.values()
    functions = [f for f, _ in plan._steps]  # noqa: SLF001
    assert getattr(functions[0], "__name__", "") == "round_to_float16"
    assert segment_steps._run_kernel not in functions  # noqa: SLF001


@pytest.mark.parametrize("to, bits", [(DataType.FLOAT16, 11), (DataType.BFLOAT16, 8)])
def test_bound_rounding_lands_on_the_half_grid(to, bits):
    """The binder's step: each value becomes a representable one of the half type, within half a unit in the
    last place of it (normal range), and the binder declines what it cannot write in one pass."""
    from onnx_runtime.ir import Node

    deferred.wait_ready(240)
    rng = np.random.default_rng(int(to))
    x = (rng.standard_normal((2, 3, 7, 5)) * 50).astype(np.float32)
    y = np.empty_like(x)
    node = Node("RoundToHalf", ["x"], ["y"], domain="ai.onnx_runtime.cpu", attrs={"to": int(to)}, opset=1)
    ((function, arguments),) = segment_steps._bind_round_to_half(node, None, [x], [y], [False])  # noqa: SLF001
    function(*arguments)
    assert np.array_equal(y.astype(to.numpy).astype(np.float32), y)  # on the grid
    normal = np.abs(x) >= 2.0 ** -14
    ulp = np.exp2(np.floor(np.log2(np.abs(x[normal]).astype(np.float64))) - (bits - 1))
    assert np.all(np.abs(y[normal].astype(np.float64) - x[normal]) <= ulp / 2)
    assert segment_steps._bind_round_to_half(node, None, [x.astype(np.float64)], [y], [False]) is None  # noqa: SLF001
    strided = np.empty((2, 3, 7, 10), np.float32)[..., ::2]
    assert segment_steps._bind_round_to_half(node, None, [strided], [y], [False]) is None  # noqa: SLF001
