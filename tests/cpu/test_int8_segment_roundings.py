"""A QDQ convolution network's roundings inside its FusedSegment (segment_fusions.SEGMENT_OPS takes the
QuantizeDequantize nodes qdq_fusions makes; ops/quantization.py binds each as one compiled call over the
plan's buffers). Checked against onnxruntime as the oracle, code by code, over the node-by-node first run and
the bound plan's later runs: per-channel and per-tensor weights, asymmetric uint8 and int8 activations, odd
channel counts, stride, padding and a depthwise group."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops.segment import Segment

Y_SCALE = 0.02


def _qdq_cnn(act) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv 3x3 (7 channels, per-channel weights) -> Relu -> Q/DQ -> depthwise 3x3 stride 2 ->
    Q/DQ -> Conv 1x1 (per-tensor weights) -> Q/DQ -> Add of the depthwise output -> Q/DQ -> GlobalAveragePool
    -> Q/DQ -> y."""
    rng = np.random.default_rng(11)
    signed = act == np.int8
    inits, nodes = [], []
    count = [0]

    def const(value, name=None):
        count[0] += 1
        name = name or f"k{count[0]}"
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def qdq(x, scale, zero):
        s, z = const(np.float32(scale)), const(np.array(zero, act))
        nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [f"{x}_q"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"{x}_q", s, z], [f"{x}_d"]))
        return f"{x}_d"

    def conv(x, y, cin, cout, k, per_channel, **attrs):
        group = attrs.get("group", 1)
        w = rng.integers(-63, 64, (cout, cin // group, k, k)).astype(np.int8)
        scale = (rng.random(cout) * 0.01 + 0.004).astype(np.float32) if per_channel else np.float32(0.006)
        zero = np.zeros(np.shape(scale), np.int8)
        nodes.append(helper.make_node("DequantizeLinear", [const(w), const(scale), const(zero)], [f"{y}_w"], axis=0))
        bias = const((rng.standard_normal(cout) * 0.1).astype(np.float32))
        nodes.append(helper.make_node("Conv", [x, f"{y}_w", bias], [y], kernel_shape=[k, k], **attrs))

    zero = (lambda z: z - 128) if signed else (lambda z: z)
    a = qdq("x", 0.03, zero(131))
    conv(a, "c1", 3, 7, 3, True, pads=[1, 1, 1, 1])
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"]))
    b = qdq("r1", 0.025, zero(0))
    conv(b, "d1", 7, 7, 3, True, pads=[1, 1, 1, 1], strides=[2, 2], group=7)
    d = qdq("d1", 0.02, zero(120))
    conv(d, "p1", 7, 7, 1, False)
    p = qdq("p1", 0.03, zero(125))
    nodes.append(helper.make_node("Add", [p, d], ["s1"]))
    s = qdq("s1", 0.04, zero(127))
    nodes.append(helper.make_node("GlobalAveragePool", [s], ["g"]))
    nodes.append(helper.make_node("QuantizeLinear", ["g", const(np.float32(Y_SCALE), "ys"),
                                                     const(np.array(zero(124), act), "yz")], ["gq"]))
    nodes.append(helper.make_node("DequantizeLinear", ["gq", "ys", "yz"], ["y"]))
    graph = helper.make_graph(nodes, "qdq_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               ["batch", 3, 13, 13])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _codes(y):
    return np.rint(y.astype(np.float64) / np.float64(np.float32(Y_SCALE)))


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_qdq_cnn_is_one_segment_within_one_code_of_onnxruntime(act):
    model = _qdq_cnn(act)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])
    assert [n.op_type for n in sess.placement()] == ["FusedSegment"]  # the roundings no longer split it
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for run in range(4):  # the first node by node, the second builds and checks the plan, then the plan
        x = (rng.standard_normal((2, 3, 13, 13)) * 2).astype(np.float32)
        got, want = _codes(sess.run(None, {"x": x})[0]), _codes(oracle.run(None, {"x": x})[0])
        assert got.shape == want.shape == (2, 7, 1, 1)
        assert np.abs(got - want).max() <= 1, run
        if run == 0:
            deferred.wait_ready(240)


def test_the_plan_binds_each_rounding_as_one_compiled_call():
    before = {id(s) for s in gc.get_objects() if isinstance(s, Segment)}
    model = _qdq_cnn(np.uint8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    x = np.random.default_rng(2).standard_normal((1, 3, 13, 13)).astype(np.float32)
    deferred.wait_ready(240)
    first = sess.run(None, {"x": x})[0]  # planned at once (the compiled kernels have loaded)
    (segment,) = [s for s in gc.get_objects() if isinstance(s, Segment) and id(s) not in before
                  and s.plans]
    ((plan,),) = segment.plans.values()
    steps = plan._steps  # noqa: SLF001
    roundings = sum(inner.node.op_type == "QuantizeDequantize" for inner in segment.inner)
    assert roundings >= 5
    assert [getattr(f, "__name__", "") for f, _ in steps].count("fake_quantize") == roundings
    assert not [a for f, a in steps if f is segment_steps._run_kernel]  # noqa: SLF001  (every node prepared)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], first)
