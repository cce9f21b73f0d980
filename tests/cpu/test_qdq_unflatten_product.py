"""A static QDQ group's product over a flattened view restored by a Reshape (GPT-2's Conv1D as both torch exporters
write it, addmm over a view, after quantize_static) runs as one QuantizedMatMul on the unflattened input, its two
Reshapes gone (qdq_fusions.unflatten_dynamic_quantize_matmul): the same bits as with the Reshapes, within one
output code of a float64 evaluation of the quantized math, and of onnxruntime's."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import qdq_fusions

K, N, HEADS, SEQ = 32, 24, 4, 5
A_SCALE, A_ZERO, Y_SCALE, Y_ZERO = 0.02, 128, 0.05, 120


def _weights():
    rng = np.random.default_rng(8)
    w = rng.integers(-64, 64, (N, K)).astype(np.int8)  # Gemm's transB layout
    w_scale = np.float32(0.013)
    bias = rng.integers(-2000, 2000, N).astype(np.int32)
    return w, w_scale, bias


def _model(heads_first: bool, trans_b: bool) -> bytes:
    """x (1, S, K), or the attention's (1, HEADS, S, K / HEADS) whose heads a Transpose moves back, flattened
    to (S, K), rounded to uint8 codes, Gemm by int8 weights (transB or not) and an int32 bias as quantize_static
    writes them, rounded again and reshaped to (1, S, N)."""
    w, w_scale, bias = _weights()
    inits = {"w": w if trans_b else np.ascontiguousarray(w.T), "w_scale": w_scale, "w_zero": np.int8(0),
             "bias": bias, "bias_scale": np.float32(np.float32(A_SCALE) * w_scale), "bias_zero": np.int32(0),
             "a_scale": np.float32(A_SCALE), "a_zero": np.uint8(A_ZERO), "y_scale": np.float32(Y_SCALE),
             "y_zero": np.uint8(Y_ZERO), "flat": np.array([-1, K], np.int64), "back": np.array([1, -1, N], np.int64)}
    nodes = [helper.make_node("Reshape", ["heads" if heads_first else "x", "flat"], ["a"]),
             helper.make_node("QuantizeLinear", ["a", "a_scale", "a_zero"], ["a_q"]),
             helper.make_node("DequantizeLinear", ["a_q", "a_scale", "a_zero"], ["a_r"]),
             helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["w_r"]),
             helper.make_node("DequantizeLinear", ["bias", "bias_scale", "bias_zero"], ["bias_r"]),
             helper.make_node("Gemm", ["a_r", "w_r", "bias_r"], ["p"], transB=int(trans_b)),
             helper.make_node("QuantizeLinear", ["p", "y_scale", "y_zero"], ["p_q"]),
             helper.make_node("DequantizeLinear", ["p_q", "y_scale", "y_zero"], ["p_r"]),
             helper.make_node("Reshape", ["p_r", "back"], ["y"])]
    if heads_first:
        nodes.insert(0, helper.make_node("Transpose", ["x"], ["heads"], perm=[0, 2, 1, 3]))
        x_shape = [1, HEADS, SEQ, K // HEADS]
    else:
        x_shape = [1, SEQ, K]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _with_reshapes(data: bytes, x: np.ndarray) -> np.ndarray:
    """The output with the unflattening pass left out (the session's specialized plan is built at its first run,
    so the run is inside too)."""
    saved = list(qdq_fusions.QDQ_PASSES)
    qdq_fusions.QDQ_PASSES[:] = [p for p in saved if p.__name__ != "unflatten_dynamic_quantize_matmul"]
    try:
        session = onnx_runtime.InferenceSession(data, providers=["cpu"])
        assert "Reshape" in [n.op_type for n in session.graph_for({"x": x}).nodes]
        return session.run(None, {"x": x})[0]
    finally:
        qdq_fusions.QDQ_PASSES[:] = saved


def _reference(a: np.ndarray) -> np.ndarray:
    """QuantizeLinear's codes of the rows (ONNX spec), the exact integer product with the bias, requantized
    in float64 and dequantized."""
    w, w_scale, bias = _weights()
    a_scale = np.float64(np.float32(A_SCALE))
    codes = np.clip(np.rint(a.astype(np.float32) / np.float32(A_SCALE)) + A_ZERO, 0, 255) - A_ZERO
    real = (codes.astype(np.float64) @ w.T.astype(np.float64) + bias) * (a_scale * np.float64(w_scale))
    y_scale = np.float64(np.float32(Y_SCALE))
    y = np.clip(np.rint(real / y_scale) + Y_ZERO, 0, 255)
    return (y - Y_ZERO) * y_scale


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("heads_first", [False, True])
def test_the_group_reads_the_unflattened_input(heads_first, trans_b):
    data = _model(heads_first, trans_b)
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    x = np.random.default_rng(1).standard_normal((1, HEADS, SEQ, K // HEADS) if heads_first else (1, SEQ, K))
    x = (x * 2).astype(np.float32)
    graph = session.graph_for({"x": x})
    ops = [n.op_type for n in graph.nodes]
    assert "Reshape" not in ops and "QuantizedMatMul" in ops, ops
    (got,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(got, _with_reshapes(data, x))  # the same computation on the same values
    a = (x.transpose(0, 2, 1, 3) if heads_first else x).reshape(-1, K)
    assert got.shape == (1, SEQ, N)
    np.testing.assert_allclose(got.reshape(-1, N), _reference(a), rtol=0, atol=Y_SCALE * 1.0001)
    (theirs,) = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, theirs, rtol=0, atol=Y_SCALE * 1.0001)
    assert np.mean(got == theirs) > 0.95


def _reshaped_products(graph) -> int:
    """QuantizedMatMul nodes whose output a Reshape reads."""
    reshaped = {n.inputs[0] for n in graph.nodes if n.op_type == "Reshape"}
    return sum(n.op_type == "QuantizedMatMul" and n.outputs[0] in reshaped for n in graph.nodes)


@pytest.mark.parametrize("name", ["gpt2.torchscript", "gpt2.dynamo"])
def test_gpt2_conv1d_products_lose_their_reshapes(qdq_decoders, name):
    """Both exporters' static QDQ GPT-2 decode step: no Reshape around the products, outputs bit-identical to
    the plan with them."""
    built, entries, zoo_feeds = qdq_decoders
    path = built[name]
    feeds = zoo_feeds.make_feeds(entries[name + ".fp32"]["calls"]["decode"])
    session = onnx_runtime.InferenceSession(str(path), providers=["cpu"])
    assert _reshaped_products(session.graph_for(feeds)) == 0
    got = session.run(None, feeds)
    saved = list(qdq_fusions.QDQ_PASSES)
    qdq_fusions.QDQ_PASSES[:] = [p for p in saved if p.__name__ != "unflatten_dynamic_quantize_matmul"]
    try:
        written = onnx_runtime.InferenceSession(str(path), providers=["cpu"])
        assert _reshaped_products(written.graph_for(feeds)) >= 8  # 4 Conv1D per layer, 2 layers
        want = written.run(None, feeds)
    finally:
        qdq_fusions.QDQ_PASSES[:] = saved
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
