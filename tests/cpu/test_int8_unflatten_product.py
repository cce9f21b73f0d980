"""A DynamicQuantizeMatMul over a flattened view restored by a Reshape (GPT-2's Conv1D as both torch exporters
write it, after onnxruntime's dynamic quantization) runs on the unflattened input, its Reshapes gone
(qdq_fusions.unflatten_dynamic_quantize_matmul): the same bits as the nodes as written, within one activation
code of a float64 evaluation of the quantized math, and onnxruntime's within its float32 rescaling."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import qdq_fusions

K, N, HEADS = 32, 24, 4


def _model(heads_first: bool, seq: int | str = 5) -> bytes:
    """x (1, S, K), or the attention's (1, HEADS, S, K / HEADS) whose heads a Transpose moves back, flattened
    to (S, K) by a Reshape, times int8 weights with a bias, reshaped to (1, S, N)."""
    rng = np.random.default_rng(8)
    inits = {"w": rng.integers(-64, 64, (K, N)).astype(np.int8), "w_scale": np.float32(rng.uniform(0.01, 0.03, N)),
             "w_zero": np.zeros(N, np.int8), "bias": rng.standard_normal(N).astype(np.float32),
             "flat": np.array([-1, K], np.int64), "back": np.array([1, -1, N], np.int64)}
    nodes = [helper.make_node("Reshape", ["heads" if heads_first else "x", "flat"], ["a"]),
             helper.make_node("DynamicQuantizeMatMul", ["a", "w", "w_scale", "w_zero", "bias"], ["p"],
                              domain="com.microsoft"),
             helper.make_node("Reshape", ["p", "back"], ["y"])]
    if heads_first:
        nodes.insert(0, helper.make_node("Transpose", ["x"], ["heads"], perm=[0, 2, 1, 3]))
        x_shape = [1, HEADS, seq, K // HEADS]
    else:
        x_shape = [1, seq, K]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model.SerializeToString()


def _as_written(data: bytes):
    """The same model with the unflattening pass left out."""
    saved = list(qdq_fusions.QDQ_PASSES)
    qdq_fusions.QDQ_PASSES[:] = [p for p in saved if p.__name__ != "unflatten_dynamic_quantize_matmul"]
    try:
        return onnx_runtime.InferenceSession(data, providers=["cpu"])
    finally:
        qdq_fusions.QDQ_PASSES[:] = saved


def _reference(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DynamicQuantizeLinear's codes (ONNX spec), the exact integer product, the float64 rescaling and the
    bias (_model's weights, drawn again); and per column what one code of difference per element of A moves the
    result by."""
    rng = np.random.default_rng(8)
    w = rng.integers(-64, 64, (K, N)).astype(np.int64)
    scale = np.float32(rng.uniform(0.01, 0.03, N)).astype(np.float64)
    bias = rng.standard_normal(N).astype(np.float32).astype(np.float64)
    low, high = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
    a_scale = np.float64(np.float32((high - low) / 255))
    zero = np.clip(np.rint(-low / a_scale), 0, 255)
    codes = np.clip(np.rint(a.astype(np.float64) / a_scale) + zero, 0, 255)
    y = (codes - zero) @ w * (a_scale * scale) + bias
    return y, a_scale * scale * np.abs(w).sum(axis=0)


@pytest.mark.parametrize("heads_first", [False, True])
def test_the_product_reads_the_unflattened_input(heads_first):
    data = _model(heads_first)
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    x = np.random.default_rng(1).standard_normal((1, HEADS, 5, K // HEADS) if heads_first else (1, 5, K))
    x = x.astype(np.float32)
    graph = session.graph_for({"x": x})
    assert not [n.op_type for n in graph.nodes if n.op_type == "Reshape"], [n.op_type for n in graph.nodes]
    (got,) = session.run(None, {"x": x})
    (written,) = _as_written(data).run(None, {"x": x})
    np.testing.assert_array_equal(got, written)  # the same computation on the same values
    a = (x.transpose(0, 2, 1, 3) if heads_first else x).reshape(-1, K)
    want, slack = _reference(a)
    assert got.shape == (1, 5, N)
    assert np.all(np.abs(got.reshape(-1, N) - want) <= slack + 1e-5 * np.abs(want))
    (theirs,) = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, theirs, rtol=1e-5, atol=1e-5 * float(np.abs(theirs).max()))


def test_a_flattened_view_read_elsewhere_keeps_its_reshape():
    """The product's input as its own graph output too: the flattening Reshape stays for that reader."""
    proto = onnx.load_from_string(_model(False))
    proto.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, None))
    data = proto.SerializeToString()
    x = np.random.default_rng(2).standard_normal((1, 5, K)).astype(np.float32)
    got = onnx_runtime.InferenceSession(data, providers=["cpu"]).run(None, {"x": x})
    written = _as_written(data).run(None, {"x": x})
    for a, b in zip(got, written):
        np.testing.assert_array_equal(a, b)
    assert got[1].shape == (5, K)
