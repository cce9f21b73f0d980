"""qdq_fusions.py: QuantizeLinear -> DequantizeLinear pairs with equal constant parameters become one
QuantizeDequantize node, whose output is exactly what the two operators give (onnx's reference evaluator as
the oracle: the graph here has no reductions, so every value is exact), and nothing else is fused."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator


def _ops(sess):
    return [n.op_type for n in sess.placement()]


def _roundings(sess, x) -> int:
    """QuantizeDequantize nodes, standing alone, as a producer's epilogue (qdq_epilogues.py) or in a grid table's
    chain (qdq_tables.py)."""
    nodes = sess.graph_for({"x": x}).nodes
    return sum(n.op_type == "QuantizeDequantize" or n.op_type.endswith("Rounded") for n in nodes) + sum(
        str(kind).split(":")[1] == "QuantizeDequantize" for n in nodes if n.op_type == "GridTable"
        for kind in n.attrs["chain"])


def _model(zero_type, second_scale=0.07, per_axis=False, opset=19):
    """x -> Q -> DQ -> Relu -> Q2 -> (DQ2a, DQ2b) -> Add -> y, and Q2's codes also read by DQ3 with
    ``second_scale`` (fused only when it equals Q2's 0.05)."""
    scale = np.array([0.1, 0.2, 0.05], np.float32) if per_axis else np.array(0.1, np.float32)
    high = int(np.iinfo(zero_type).max)
    zero = (np.array([0, 3, high], zero_type) if per_axis else np.array(7, zero_type))  # a zero point at the end
    inits = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s2"),
             numpy_helper.from_array(np.array(second_scale, np.float32), "s3"),
             numpy_helper.from_array(np.array(2, zero_type), "z2")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], axis=1),
        helper.make_node("Relu", ["d"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s2", "z2"], ["q2"]),
        helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["d2a"]),
        helper.make_node("DequantizeLinear", ["q2", "s2", "z2"], ["d2b"]),
        helper.make_node("DequantizeLinear", ["q2", "s3", "z2"], ["d3"]),
        helper.make_node("Add", ["d2a", "d2b"], ["sum"]),
        helper.make_node("Add", ["sum", "d3"], ["y"]),
    ]
    shape = [2, 3, 4, 5]
    return make_model(nodes, [tensor_info("x", shape=shape)], [tensor_info("y", shape=shape)], inits, opset=opset)


@pytest.mark.parametrize("zero_type", [np.uint8, np.int8, np.uint16, np.int16])
@pytest.mark.parametrize("per_axis", [False, True])
def test_qdq_pairs_fuse_and_match_the_reference(zero_type, per_axis):
    model = _model(zero_type, per_axis=per_axis, opset=21 if zero_type in (np.uint16, np.int16) else 19)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = _ops(sess)
    assert ops.count("QuantizeDequantize") == 1  # the first pair; Q2 has a reader with another scale
    assert ops.count("QuantizeLinear") == 1 and ops.count("DequantizeLinear") == 3
    x = (np.random.default_rng(0).standard_normal((2, 3, 4, 5)) * 30).astype(np.float32)
    x[0, 0, 0, :4] = [0.35, 0.25, -3e4, 3e4]  # ties (0.35 / 0.1 rounds in float32 first) and saturation
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)


def test_every_reader_equal_fuses_all_of_them():
    model = _model(np.uint8, second_scale=0.05)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = _ops(sess)
    x = (np.random.default_rng(1).standard_normal((2, 3, 4, 5)) * 30).astype(np.float32)
    assert _roundings(sess, x) >= 2 and "QuantizeLinear" not in ops and "DequantizeLinear" not in ops
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0])


def test_codes_that_are_a_graph_output_stay():
    s, z = numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.array(3, np.uint8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[4])],
                       [tensor_info("y", shape=[4]), tensor_info("q", TensorProto.UINT8, shape=[4])], [s, z], opset=19)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "QuantizeDequantize" not in _ops(sess)


def _dynamic_model(with_bias=True, shared_scale_reader=False):
    """quantize_dynamic's spelling of x @ W + b: DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul by
    Mul(x scale, W scale) -> Add bias."""
    rng = np.random.default_rng(5)
    w = rng.integers(-128, 128, (6, 5)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.02, np.float32), "ws"),
             numpy_helper.from_array(np.array(-3, np.int8), "wz"),
             numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b")]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
        helper.make_node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xs", "ws"], ["scale"]),
        helper.make_node("Mul", ["accf", "scale"], ["mm" if with_bias else "y"]),
    ]
    outputs = [tensor_info("y", shape=[2, 3, 5])]
    if with_bias:
        nodes.append(helper.make_node("Add", ["b", "mm"], ["y"]))
    if shared_scale_reader:
        outputs.append(tensor_info("scale", shape=[]))
    return make_model(nodes, [tensor_info("x", shape=[2, 3, 6])], outputs, inits, opset=17)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shared", [False, True])
def test_dynamic_matmul_becomes_matmul_integer_to_float(with_bias, shared):
    model = _dynamic_model(with_bias, shared)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = _ops(sess)
    # With nothing else reading the quantizer, it joins the product too (fuse_dynamic_quantize_matmul).
    fused = "MatMulIntegerToFloat" if shared else "DynamicQuantizeMatMul"
    assert fused in ops and "MatMulInteger" not in ops and "Cast" not in ops
    assert ("DynamicQuantizeLinear" in ops) == shared
    assert ("Mul" in ops) == shared and "Add" not in ops  # the scales' Mul stays while something else reads it
    x = np.random.default_rng(2).standard_normal((2, 3, 6)).astype(np.float32)
    got, want = sess.run(None, {"x": x}), ReferenceEvaluator(model).run(None, {"x": x})
    # The fused node rescales the exact int32 sum in float64 and rounds once; the graph rounds the
    # accumulator's float32 product with a float32 scale product, then adds the bias: float32 roundings apart.
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6 * float(np.abs(want[0]).max()))


def _requantized_chain(second_scale, between="Reshape"):
    """x -> Q/DQ (0.1, 7) -> Reshape or Relu -> Q/DQ (second_scale, 7) -> Transpose -> Q/DQ (0.1, 7) -> Neg."""
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
             numpy_helper.from_array(np.array(7, np.uint8), "z"),
             numpy_helper.from_array(np.array(second_scale, np.float32), "s2"),
             numpy_helper.from_array(np.array([6, 4], np.int64), "shape")]
    middle = helper.make_node("Reshape", ["d", "shape"], ["m"]) if between == "Reshape" else \
        helper.make_node(between, ["d"], ["m"])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
             middle,
             helper.make_node("QuantizeLinear", ["m", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["d2"]),
             helper.make_node("Transpose", ["d2"], ["t"]),
             helper.make_node("QuantizeLinear", ["t", "s", "z"], ["q3"]),
             helper.make_node("DequantizeLinear", ["q3", "s", "z"], ["d3"]),
             helper.make_node("Neg", ["d3"], ["y"])]
    shape = [6, 4] if between == "Reshape" else [4, 6]
    return make_model(nodes, [tensor_info("x", shape=[4, 6])], [tensor_info("y", shape=shape[::-1])], inits, opset=19)


@pytest.mark.parametrize("between", ["Reshape", "Relu"])
def test_rounding_again_to_the_same_grid_is_dropped(between):
    """Values on a grid, moved (Reshape, Transpose) or clipped at 0 (Relu), round to themselves on that grid:
    those QuantizeDequantize nodes go, and the output stays exactly the reference's."""
    x = (np.random.default_rng(4).standard_normal((4, 6)) * 20).astype(np.float32)
    x[0, :3] = [0.35, 0.25, -1e4]
    for second, kept in ((0.1, 1), (0.2, 3)):  # another scale in between: every rounding counts
        model = _requantized_chain(second, between)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
        assert _roundings(sess, x) == kept
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ReferenceEvaluator(model).run(None, {"x": x})[0])
