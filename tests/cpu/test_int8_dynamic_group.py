"""DynamicQuantizeMatMul nodes of one input run as one DynamicQuantizeMatMulGroup
(qdq_fusions.group_dynamic_quantize_matmul, ops/dynamic_quantize_group.py): each output equals a float64
reference of the quantized math (DynamicQuantizeLinear's codes, the exact integer product, one float64 rescaling
rounded to float32, the float32 bias), the unfused nodes' bits, and onnxruntime's within its float32 rescaling."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import qdq_fusions

MS = "com.microsoft"


def model(k: int, widths: list[int], dtype, per_column: bool, biases: list[bool], seed: int = 3) -> tuple:
    """DynamicQuantizeMatMul readers of one float input x (rows, k); returns the model and its weights."""
    rng = np.random.default_rng(seed)
    inits, nodes, outputs, weights = [], [], [], []
    for i, (n, with_bias) in enumerate(zip(widths, biases)):
        # weights within [-64, 63]: onnxruntime's u8 x s8 kernels saturate pairwise sums past that
        w = rng.integers(-64, 64, (k, n)) + (128 if dtype == np.uint8 else 0)
        scale = np.float32(rng.uniform(0.01, 0.03, n) if per_column else 0.02)
        zero = rng.integers(0, 4, n) if per_column else np.int64(2)
        zero = (zero + (128 if dtype == np.uint8 else -2)).astype(dtype)
        bias = np.float32(rng.standard_normal(n))
        weights.append((w.astype(dtype), scale, zero, bias if with_bias else None))
        inits += [numpy_helper.from_array(w.astype(dtype), f"w{i}"), numpy_helper.from_array(scale, f"ws{i}"),
                  numpy_helper.from_array(zero, f"wz{i}"), numpy_helper.from_array(bias, f"b{i}")]
        inputs = ["x", f"w{i}", f"ws{i}", f"wz{i}"] + ([f"b{i}"] if with_bias else [])
        nodes.append(helper.make_node("DynamicQuantizeMatMul", inputs, [f"y{i}"], domain=MS))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              outputs, initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m.SerializeToString(), weights


def reference(x: np.ndarray, w, scale, zero, bias) -> np.ndarray:
    """The quantized math in float64 and exact integers: DynamicQuantizeLinear as the ONNX spec writes it."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    a_scale = np.float32((np.float32(high) - np.float32(low)) / np.float32(255)) if high > low else np.float32(1 / 255)
    if high <= low:
        a_scale = np.float32(np.float32(1) / np.float32(255))
    a_zero = np.clip(np.rint(np.float32(0) - np.float32(low) / a_scale), 0, 255)
    codes = np.clip(np.rint(x / a_scale) + a_zero, 0, 255).astype(np.int64)
    acc = (codes - int(a_zero)) @ (w.astype(np.int64) - zero.astype(np.int64).reshape(1, -1))
    y = (acc.astype(np.float64) * (np.float64(a_scale) * scale.astype(np.float64).reshape(1, -1))).astype(np.float32)
    return y if bias is None else y + bias


def apart(data: bytes):
    """The same model with the grouping pass left out: one DynamicQuantizeMatMul per reader."""
    saved = list(qdq_fusions.QDQ_PASSES)
    qdq_fusions.QDQ_PASSES[:] = [p for p in saved if p.__name__ != "group_dynamic_quantize_matmul"]
    try:
        return onnx_runtime.InferenceSession(data, providers=["cpu"])
    finally:
        qdq_fusions.QDQ_PASSES[:] = saved


def groups(session) -> tuple[int, int]:
    """(DynamicQuantizeMatMulGroup nodes, DynamicQuantizeMatMul nodes) the session runs."""
    ops = [n.op_type for n in session.placement()]
    return ops.count("DynamicQuantizeMatMulGroup"), ops.count("DynamicQuantizeMatMul")


FEEDS = {
    "mixed": lambda r, k: np.float32(np.random.default_rng(r * 7 + k).standard_normal((r, k)) * 3),
    "all_positive": lambda r, k: np.float32(np.random.default_rng(r + k).uniform(0.5, 4, (r, k))),  # zero point 0
    "all_negative": lambda r, k: np.float32(-np.random.default_rng(r + k).uniform(0.5, 4, (r, k))),  # zero point 255
    "all_zero": lambda r, k: np.zeros((r, k), np.float32),  # an empty range: the unit scale
    "all_equal": lambda r, k: np.full((r, k), 1.5, np.float32),
    "huge": lambda r, k: np.float32(np.random.default_rng(k).standard_normal((r, k)) * 1e30),
}


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("k,width", [(32, 16), (33, 17), (64, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_group_equals_reference_and_the_nodes(dtype, per_column, k, width, with_bias):
    data, weights = model(k, [width] * 3, dtype, per_column, [with_bias] * 3)
    grouped = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert groups(grouped) == (1, 0)
    single = apart(data)
    assert groups(single) == (0, 3)
    oracle = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for kind, make in FEEDS.items():
        for rows in (1, 5, 8):
            x = make(rows, k)
            ours, nodes, theirs = grouped.run(None, {"x": x}), single.run(None, {"x": x}), oracle.run(None, {"x": x})
            for y, y_node, y_ort, weight in zip(ours, nodes, theirs, weights):
                assert y.shape == (rows, width) and y.dtype == np.float32
                np.testing.assert_array_equal(y, y_node)
                expected = reference(x, *weight)
                np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max(), err_msg=kind)
                if kind != "huge":  # (onnxruntime rounds its rescaling in float32)
                    np.testing.assert_allclose(y, y_ort, rtol=1e-5, atol=1e-5, err_msg=kind)


def test_three_dimensional_input_and_separate_outputs():
    data, weights = model(24, [8, 8], np.int8, False, [True, True])
    import onnx

    m = onnx.load_from_string(data)
    m.graph.input[0].type.tensor_type.shape.ClearField("dim")
    for d in ("b", "s", 24):
        m.graph.input[0].type.tensor_type.shape.dim.add().CopyFrom(
            onnx.TensorShapeProto.Dimension(**({"dim_param": d} if isinstance(d, str) else {"dim_value": d})))
    session = onnx_runtime.InferenceSession(m.SerializeToString(), providers=["cpu"])
    assert groups(session) == (1, 0)
    x = np.float32(np.random.default_rng(1).standard_normal((2, 3, 24)))
    y0, y1 = session.run(None, {"x": x})
    assert y0.shape == y1.shape == (2, 3, 8)
    for y, weight in zip((y0, y1), weights):
        np.testing.assert_allclose(y.reshape(6, 8), reference(x.reshape(6, 24), *weight), rtol=1e-6, atol=1e-6)
    y0[...] = 0  # outputs do not share memory a reader could see
    assert np.abs(y1).max() > 0


def test_members_that_differ_stay_apart():
    # Widths 16, 16 and 8, biases on two: only the two of one width and one bias form a group.
    data, _ = model(32, [16, 16, 8, 16], np.int8, False, [True, True, True, False])
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert groups(session) == (1, 2)


def test_a_fed_weight_is_no_member():
    data, _ = model(32, [16, 16], np.int8, False, [False, False])
    import onnx

    m = onnx.load_from_string(data)
    w = next(t for t in m.graph.initializer if t.name == "w1")
    m.graph.initializer.remove(w)
    m.graph.input.append(helper.make_tensor_value_info("w1", TensorProto.INT8, [32, 16]))
    session = onnx_runtime.InferenceSession(m.SerializeToString(), providers=["cpu"])
    assert groups(session) == (0, 2)
