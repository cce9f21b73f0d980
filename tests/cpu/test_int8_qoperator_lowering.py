"""QOperator CNNs in their QDQ form (qoperator_lowering.py): QLinearConv, MaxPool of codes, QLinearAdd, QLinearMul
and QLinearGlobalAveragePool become DequantizeLinear -> float op -> QuantizeLinear, which the QDQ passes fuse
into one FusedSegment. Checked against a float64 reference of the spec's rounding (one layer: the exact integer
sum rescaled once) and against onnxruntime's integer kernels as the oracle, code by code: per-channel and
per-tensor weights, asymmetric uint8 activations, a bias, odd sizes, stride, padding and a depthwise group.
A patch embedding whose codes go to a Reshape (a transformer's) keeps its QLinearConv."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import deferred

Y_SCALE, Y_ZERO = np.float32(0.021), 119
_QOPERATOR = {"QLinearConv", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "MaxPool"}


class _Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.inits: list = []
        self.nodes: list = []

    def const(self, value, name=None) -> str:
        name = name or f"k{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def act(self, scale: float, zero: int) -> list[str]:
        return [self.const(np.float32(scale)), self.const(np.array(zero, np.uint8))]

    def conv(self, x: str, x_params: list[str], y: str, y_params: list[str], cin: int, cout: int, k: int,
             per_channel: bool, bias: bool = True, **attrs) -> str:
        group = attrs.get("group", 1)
        w = self.rng.integers(-90, 91, (cout, cin // group, k, k)).astype(np.int8)
        scale = (self.rng.random(cout) * 0.01 + 0.004).astype(np.float32) if per_channel else np.float32(0.006)
        inputs = [x, *x_params, self.const(w), self.const(scale), self.const(np.zeros(np.shape(scale), np.int8)),
                  *y_params]
        if bias:
            inputs.append(self.const(self.rng.integers(-2000, 2000, cout).astype(np.int32)))
        self.nodes.append(helper.make_node("QLinearConv", inputs, [y], kernel_shape=[k, k], **attrs))
        return y

    def contrib(self, op: str, inputs: list[str], y: str) -> str:
        self.nodes.append(helper.make_node(op, inputs, [y], domain="com.microsoft"))
        return y

    def model(self, size: int) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "qoperator_cnn",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, size, size])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                       helper.make_opsetid("com.microsoft", 1)])


def _qoperator_cnn() -> onnx.ModelProto:
    """x -> QuantizeLinear -> QLinearConv 3x3 (3 -> 7, per channel, bias) -> MaxPool of codes -> depthwise
    QLinearConv 3x3 stride 2 -> DequantizeLinear -> HardSwish -> QuantizeLinear -> QLinearConv 1x1 (per tensor)
    -> QLinearAdd of the depthwise codes -> QLinearMul by them -> QLinearGlobalAveragePool -> DequantizeLinear."""
    b = _Builder(23)
    xq = b.act(0.03, 131)
    b.nodes.append(helper.make_node("QuantizeLinear", ["x", *xq], ["xq"]))
    c1 = b.act(0.05, 127)
    b.conv("xq", xq, "c1", c1, 3, 7, 3, True, pads=[1, 1, 1, 1])
    b.nodes.append(helper.make_node("MaxPool", ["c1"], ["m1"], kernel_shape=[2, 2], strides=[1, 1]))
    d1 = b.act(0.04, 120)
    b.conv("m1", c1, "d1", d1, 7, 7, 3, True, pads=[1, 1, 1, 1], strides=[2, 2], group=7)
    b.nodes.append(helper.make_node("DequantizeLinear", ["d1", *d1], ["d1f"]))
    b.nodes.append(helper.make_node("HardSwish", ["d1f"], ["h1"]))
    h1 = b.act(0.03, 15)
    b.nodes.append(helper.make_node("QuantizeLinear", ["h1", *h1], ["h1q"]))
    p1 = b.act(0.035, 125)
    b.conv("h1q", h1, "p1", p1, 7, 7, 1, False, bias=False)
    s1 = b.act(0.06, 128)
    b.contrib("QLinearAdd", ["p1", *p1, "d1", *d1, *s1], "s1")
    m2 = b.act(0.05, 100)
    b.contrib("QLinearMul", ["s1", *s1, "d1", *d1, *m2], "m2")
    y = [b.const(Y_SCALE, "ys"), b.const(np.array(Y_ZERO, np.uint8), "yz")]
    b.contrib("QLinearGlobalAveragePool", ["m2", *m2, *y], "g")
    b.nodes.append(helper.make_node("DequantizeLinear", ["g", *y], ["y"]))
    return b.model(12)


def _codes(y):
    return np.rint(y.astype(np.float64) / np.float64(Y_SCALE))


def _session(model: onnx.ModelProto):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


def test_qoperator_cnn_runs_as_a_qdq_segment_within_one_code_of_onnxruntime():
    model = _qoperator_cnn()
    sess = _session(model)
    placed = [n.op_type for n in sess.placement()]
    assert not set(placed) & _QOPERATOR, placed
    assert "FusedSegment" in placed, placed
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for run in range(4):  # the first node by node, the second builds and checks the plan, then the plan
        x = (rng.standard_normal((2, 3, 12, 12)) * 2).astype(np.float32)
        got, want = _codes(sess.run(None, {"x": x})[0]), _codes(oracle.run(None, {"x": x})[0])
        assert got.shape == want.shape == (2, 7, 1, 1)
        assert np.abs(got - want).max() <= 1, run
        if run == 0:
            deferred.wait_ready(240)


@pytest.mark.parametrize("per_channel", [True, False])
def test_one_convolution_within_one_code_of_the_spec_rounding(per_channel):
    """Q -> QLinearConv (odd sizes, stride 2, asymmetric input) -> DequantizeLinear: every code within one of
    rint(sum * x_scale * w_scale / y_scale) + y_zero formed in float64 from the exact integer sum, and nearly all
    equal to it."""
    b = _Builder(3)
    xq = b.act(0.045, 77)
    b.nodes.append(helper.make_node("QuantizeLinear", ["x", *xq], ["xq"]))
    yq = [b.const(Y_SCALE, "ys"), b.const(np.array(Y_ZERO, np.uint8), "yz")]
    b.conv("xq", xq, "c", yq, 3, 5, 3, per_channel, pads=[0, 1, 1, 0], strides=[2, 2])
    b.nodes.append(helper.make_node("DequantizeLinear", ["c", *yq], ["y"]))
    model = b.model(11)
    sess = _session(model)
    assert "QLinearConv" not in [n.op_type for n in sess.placement()]
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    conv = model.graph.node[1]
    w, w_scale, bias = (init[conv.input[i]] for i in (3, 4, 8))
    x = (np.random.default_rng(9).standard_normal((1, 3, 11, 11)) * 3).astype(np.float32)
    codes = np.clip(np.rint(x / np.float32(0.045)) + 77, 0, 255).astype(np.int64)
    padded = np.pad(codes - 77, ((0, 0), (0, 0), (0, 1), (1, 0)))  # the centred codes, padded with zeros
    out = (padded.shape[2] - 3) // 2 + 1, (padded.shape[3] - 3) // 2 + 1
    acc = np.zeros((1, 5) + out, np.int64)
    for i in range(3):
        for j in range(3):
            window = padded[:, :, i:i + 2 * out[0] - 1:2, j:j + 2 * out[1] - 1:2]
            acc += np.einsum("nchw,mc->nmhw", window, w[:, :, i, j].astype(np.int64))
    acc += bias.reshape(1, -1, 1, 1)
    multiplier = np.float64(np.float32(0.045)) * w_scale.astype(np.float64).reshape(-1, 1, 1) / np.float64(Y_SCALE)
    want = np.clip(np.rint(acc * multiplier) + Y_ZERO, 0, 255) - Y_ZERO
    for run in range(3):
        got = _codes(sess.run(None, {"x": x})[0])
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1, run
        assert np.mean(got == want) >= 0.95, run
        if run == 0:
            deferred.wait_ready(240)


def test_a_patch_embedding_read_by_a_reshape_keeps_its_integer_kernel():
    b = _Builder(4)
    xq = b.act(0.03, 128)
    b.nodes.append(helper.make_node("QuantizeLinear", ["x", *xq], ["xq"]))
    cq = b.act(0.05, 128)
    b.conv("xq", xq, "c", cq, 3, 8, 4, True, strides=[4, 4])
    b.nodes.append(helper.make_node("Reshape", ["c", b.const(np.array([0, 8, -1], np.int64))], ["r"]))
    b.nodes.append(helper.make_node("DequantizeLinear", ["r", *cq], ["y"]))
    model = b.model(8)
    sess = _session(model)
    assert "QLinearConv" in [n.op_type for n in sess.placement()]
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0])


def test_fire_module_concat_joins_the_float_path():
    """A SqueezeNet fire module: a squeeze QLinearConv, two expand QLinearConv (1x1 and 3x3, their own output
    grids) and QLinearConcat of them onto a third grid, then the pooled codes: no QOperator node is left."""
    b = _Builder(31)
    xq = b.act(0.03, 128)
    b.nodes.append(helper.make_node("QuantizeLinear", ["x", *xq], ["xq"]))
    sq = b.act(0.04, 0)
    b.conv("xq", xq, "sq", sq, 3, 5, 1, True)
    e1, e3 = b.act(0.05, 3), b.act(0.045, 0)
    b.conv("sq", sq, "e1", e1, 5, 4, 1, True)
    b.conv("sq", sq, "e3", e3, 5, 6, 3, False, pads=[1, 1, 1, 1])
    cat = b.act(0.055, 1)
    b.nodes.append(helper.make_node("QLinearConcat", [*cat, "e1", *e1, "e3", *e3], ["cat"], axis=1,
                                    domain="com.microsoft"))
    y = [b.const(Y_SCALE, "ys"), b.const(np.array(Y_ZERO, np.uint8), "yz")]
    b.contrib("QLinearGlobalAveragePool", ["cat", *cat, *y], "g")
    b.nodes.append(helper.make_node("DequantizeLinear", ["g", *y], ["y"]))
    model = b.model(9)
    sess = _session(model)
    placed = [n.op_type for n in sess.placement()]
    assert not {p for p in placed if p.startswith("QLinear")}, placed
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(6)
    for run in range(3):
        x = (rng.standard_normal((1, 3, 9, 9)) * 2).astype(np.float32)
        got, want = _codes(sess.run(None, {"x": x})[0]), _codes(oracle.run(None, {"x": x})[0])
        assert got.shape == want.shape == (1, 10, 1, 1)
        assert np.abs(got - want).max() <= 1, run
        if run == 0:
            deferred.wait_ready(240)
