"""qdq_fusions.INTEGER_GROUP_PASSES: DequantizeLinear -> MatMul/Gemm/Conv -> QuantizeLinear as one integer node
(ops/qdq_linear.py), on per-tensor and per-channel weights, checked code by code against a float64 evaluation
of the QDQ graph (the real value each QuantizeLinear rounds) and against onnxruntime: at most one code apart,
and nearly always equal (the graph's float32 arithmetic moves values that lie within its rounding of a
half-integer)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import onnx_runtime_ep_cpu.provider as provider
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime_ep_cpu import qdq_fusions

X_SCALE, Y_SCALE = 0.03, 0.05


@pytest.fixture
def integer_groups(monkeypatch):
    monkeypatch.setattr(provider, "QDQ_PASSES", qdq_fusions.INTEGER_GROUP_PASSES + qdq_fusions.QDQ_PASSES)


def _qdq_model(op, act, per_channel, rng):
    """x -> Q -> DQ -> op(., DQ(W)[, DQ(bias)]) -> Q -> DQ -> y; returns (model, float64 reference of the codes
    as a function of x)."""
    zero = np.array(0 if act == np.int8 else 128, act)
    y_zero = np.array(-3 if act == np.int8 else 131, act)
    # 7-bit weights (onnxruntime's reduce_range): its AVX2 u8s8 kernels add pairs of u8 * s8 products in int16,
    # which saturate for full-range weights; this runtime's sums are exact either way.
    if op == "Conv":
        w = rng.integers(-63, 64, (6, 4, 3, 3)).astype(np.int8)
        axis, channels = 0, 6
    elif op == "Gemm":  # transB: W is (N, K)
        w = rng.integers(-63, 64, (7, 9)).astype(np.int8)
        axis, channels = 0, 7
    else:
        w = rng.integers(-63, 64, (9, 7)).astype(np.int8)
        axis, channels = 1, 7
    w_scale = (rng.random(channels) * 0.01 + 0.002).astype(np.float32) if per_channel else np.array(0.006, np.float32)
    w_zero = np.zeros(w_scale.shape, np.int8)
    bias = rng.integers(-2000, 2000, channels).astype(np.int32)
    bias_scale = (np.float32(X_SCALE) * w_scale).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(X_SCALE, np.float32), "xs"), (zero, "xz"), (w, "w"), (w_scale, "ws"), (w_zero, "wz"),
        (np.array(Y_SCALE, np.float32), "ys"), (y_zero, "yz"), (bias, "b"), (bias_scale, "bs"),
        (np.zeros(bias_scale.shape, np.int32), "bz"))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=axis),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bd"], axis=0)]
    if op == "Conv":
        nodes.append(helper.make_node("Conv", ["xd", "wd", "bd"], ["m"], pads=[1, 1, 1, 1]))
        x_shape, y_shape = [2, 4, 5, 5], [2, 6, 5, 5]
    elif op == "Gemm":
        nodes.append(helper.make_node("Gemm", ["xd", "wd", "bd"], ["m"], transB=1))
        x_shape, y_shape = [5, 9], [5, 7]
    else:
        nodes.append(helper.make_node("MatMul", ["xd", "wd"], ["m"]))
        x_shape, y_shape = [2, 5, 9], [2, 5, 7]
    nodes += [helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["yq"]),
              helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=x_shape)], [tensor_info("y", shape=y_shape)], inits, opset=19)

    def reference(x):
        low, high = np.iinfo(act).min, np.iinfo(act).max
        xq = np.clip(np.rint(x / np.float32(X_SCALE)) + int(zero), low, high)  # float32 division, as the graph
        xr = (xq - int(zero)) * np.float64(X_SCALE)
        wr = w.astype(np.float64) * (w_scale.astype(np.float64).reshape(-1, *[1] * (w.ndim - 1)) if axis == 0
                                     else w_scale.astype(np.float64))
        br = bias * bias_scale.astype(np.float64)
        if op == "Conv":
            conv = make_model([helper.make_node("Conv", ["a", "b", "c"], ["o"], pads=[1, 1, 1, 1])],
                              [tensor_info("a", TensorProto.DOUBLE), tensor_info("b", TensorProto.DOUBLE),
                               tensor_info("c", TensorProto.DOUBLE)], [tensor_info("o", TensorProto.DOUBLE)])
            real = ReferenceEvaluator(conv).run(None, {"a": xr, "b": wr, "c": br})[0]
        elif op == "Gemm":
            real = xr @ wr.T + br
        else:
            real = xr @ wr
        return np.clip(np.rint(real / np.float64(Y_SCALE)) + int(y_zero), low, high), int(y_zero)

    return model, reference


def _codes(y, y_zero):
    return np.rint(y.astype(np.float64) / np.float64(np.float32(Y_SCALE))) + y_zero


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "Conv"])
@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
def test_qdq_groups_run_on_integers_within_one_code(integer_groups, op, act, per_channel):
    rng = np.random.default_rng(7)
    model, reference = _qdq_model(op, act, per_channel, rng)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = [n.op_type for n in sess.placement()]
    fused = "QuantizedConv" if op == "Conv" else "QuantizedMatMul"
    assert ops == [fused], ops  # the activation's Q, both DQs, the op and the output Q/DQ: one node
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    x.reshape(-1)[:3] = [1e4, -1e4, np.float32(X_SCALE) * 2.5]  # saturation and a tie
    y = sess.run(None, {"x": x})[0]
    want, y_zero = reference(x)
    got = _codes(y, y_zero)
    np.testing.assert_array_equal(y, ((got - y_zero) * np.float32(Y_SCALE)).astype(np.float32))  # DQ's values
    assert np.abs(got - want).max() <= 1 and np.mean(got == want) >= 0.99
    oracle = _codes(onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0], y_zero)
    assert np.abs(got - oracle).max() <= 1 and np.mean(got == oracle) >= 0.99


def test_products_of_two_activations_and_shared_quantization(integer_groups):
    """Attention's product: both operands quantized activations (B a stacked matrix quantized per call), A's
    QuantizeLinear also read by a DequantizeLinear (it stays, as one QuantizeDequantize node)."""
    inits = [numpy_helper.from_array(np.array(v, t), n) for v, t, n in (
        (0.04, np.float32, "s"), (128, np.uint8, "z"), (0.02, np.float32, "s2"), (120, np.uint8, "z2"),
        (0.5, np.float32, "ys"), (100, np.uint8, "yz"))]
    nodes = [helper.make_node("QuantizeLinear", ["a", "s", "z"], ["aq"]),
             helper.make_node("DequantizeLinear", ["aq", "s", "z"], ["ad"]),
             helper.make_node("DequantizeLinear", ["aq", "s", "z"], ["ad2"]),
             helper.make_node("QuantizeLinear", ["b", "s2", "z2"], ["bq"]),
             helper.make_node("DequantizeLinear", ["bq", "s2", "z2"], ["bd"]),
             helper.make_node("MatMul", ["ad", "bd"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"]),
             helper.make_node("Relu", ["ad2"], ["r"])]
    model = make_model(nodes, [tensor_info("a", shape=[2, 3, 4, 8]), tensor_info("b", shape=[2, 3, 8, 5])],
                       [tensor_info("y", shape=[2, 3, 4, 5]), tensor_info("r", shape=[2, 3, 4, 8])], inits, opset=19)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert sorted(n.op_type for n in sess.placement()) == ["QuantizeDequantize", "QuantizedMatMul", "Relu"]
    rng = np.random.default_rng(3)
    feeds = {"a": rng.standard_normal((2, 3, 4, 8)).astype(np.float32) * 3,
             "b": rng.standard_normal((2, 3, 8, 5)).astype(np.float32) * 2}
    y, r = sess.run(None, feeds)
    aq = np.clip(np.rint(feeds["a"] / np.float32(0.04)) + 128, 0, 255) - 128
    bq = np.clip(np.rint(feeds["b"] / np.float32(0.02)) + 120, 0, 255) - 120
    want = np.clip(np.rint(aq @ bq * (np.float64(np.float32(0.04)) * np.float64(np.float32(0.02)) / 0.5)) + 100, 0, 255)
    np.testing.assert_array_equal(y, ((want - 100) * np.float32(0.5)).astype(np.float32))
    np.testing.assert_array_equal(r, ReferenceEvaluator(model).run(None, feeds)[1])


def test_groups_with_other_readers_or_parameters_stay_float(integer_groups):
    """The MatMul's output also read before its QuantizeLinear, or a weight quantized per row (axis 0 of a
    MatMul's (K, N)): no integer group."""
    rng = np.random.default_rng(1)
    model, _ = _qdq_model("MatMul", np.uint8, True, rng)
    graph = model.graph
    extra = onnx.helper.make_tensor_value_info("m", TensorProto.FLOAT, None)
    graph.output.append(extra)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "QuantizedMatMul" not in [n.op_type for n in sess.placement()]
    model, _ = _qdq_model("MatMul", np.uint8, False, rng)
    for init in model.graph.initializer:
        if init.name == "ws":
            init.CopyFrom(numpy_helper.from_array(np.full(9, 0.006, np.float32), "ws"))
        if init.name == "wz":
            init.CopyFrom(numpy_helper.from_array(np.zeros(9, np.int8), "wz"))
    for node in model.graph.node:
        if node.output[0] == "wd":
            node.attribute[0].i = 0
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "QuantizedMatMul" not in [n.op_type for n in sess.placement()]


@pytest.mark.parametrize("a_type,b_type", [(np.uint8, np.int8), (np.int8, np.int8), (np.uint8, np.uint8)])
@pytest.mark.parametrize("b_shape,per_column", [((9, 7), False), ((9, 7), True), ((2, 9, 7), False)])
def test_qlinear_matmul_codes_are_the_exact_sum_rounded_once(a_type, b_type, b_shape, per_column):
    """QLinearMatMul (through the groups' compiled kernel): the exact integer sum times a_scale * b_scale /
    y_scale in float64, rounded half to even, plus the zero point, saturated; onnxruntime within one code."""
    rng = np.random.default_rng(11)
    a = rng.integers(np.iinfo(a_type).min, np.iinfo(a_type).max + 1, (2, 5, 9)).astype(a_type)
    b = rng.integers(-63 if b_type == np.int8 else 0, 64 if b_type == np.int8 else 128, b_shape).astype(b_type)
    columns = b_shape[-1]
    b_scale = (rng.random(columns) * 0.01 + 0.001).astype(np.float32) if per_column else np.array(0.004, np.float32)
    b_zero = (rng.integers(-3, 4, columns) if b_type == np.int8 else rng.integers(60, 68, columns)).astype(b_type) \
        if per_column else np.array(2, b_type)
    a_zero, y_zero = np.array(5, a_type), np.array(7, a_type)
    a_scale, y_scale = np.array(0.02, np.float32), np.array(0.05, np.float32)
    names = ["a", "as", "az", "b", "bs", "bz", "ys", "yz"]
    values = [a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero]
    elem = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8}
    model = make_model([helper.make_node("QLinearMatMul", names, ["y"])],
                       [tensor_info("a", elem[a.dtype], list(a.shape))],
                       [tensor_info("y", elem[np.dtype(a_type)], None)],
                       [numpy_helper.from_array(v, n) for n, v in zip(names[1:], values[1:])], opset=13)
    got = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"a": a})[0]
    acc = (a.astype(np.int64) - int(a_zero)) @ (b.astype(np.int64) - b_zero.astype(np.int64))
    real = acc * (np.float64(a_scale) * b_scale.astype(np.float64) / np.float64(y_scale))
    info = np.iinfo(a_type)
    np.testing.assert_array_equal(got, np.clip(np.rint(real) + int(y_zero), info.min, info.max).astype(a_type))
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"a": a})[0]
    assert np.abs(got.astype(np.int64) - oracle).max() <= 1
