"""qdq_folds.drop_rounding_before_quantizing: a rounding whose values only integer QDQ groups quantize again with
the same grid goes (those groups quantize the unrounded values to the same codes), and nothing else does."""
from __future__ import annotations

import contextlib

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import qdq_fusions

SCALE, ZERO = 0.031, 121
Y_SCALE, Y_ZERO = 0.07, 128


def _model(second_scale: float = SCALE, extra_reader: bool = False) -> onnx.ModelProto:
    """x -> Q/DQ -> Reshape (M, K) -> Q/DQ (second_scale) -> MatMul by DQ(int8 W) -> Q/DQ -> y, as quantize_static
    writes a LayerNorm's output feeding a flattened product; ``extra_reader``: an Add reads the first rounding too."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(np.array(SCALE, np.float32), "s"),
             numpy_helper.from_array(np.array(ZERO, np.uint8), "z"),
             numpy_helper.from_array(np.array(second_scale, np.float32), "s2"),
             numpy_helper.from_array(rng.integers(-127, 128, (16, 6)).astype(np.int8), "w"),
             numpy_helper.from_array(np.array(0.02, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(np.array(Y_SCALE, np.float32), "ys"),
             numpy_helper.from_array(np.array(Y_ZERO, np.uint8), "yz"),
             numpy_helper.from_array(np.array([-1, 16], np.int64), "flat")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["r"]),
             helper.make_node("Reshape", ["r", "flat"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["a"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"]),
             helper.make_node("MatMul", ["a", "wf"], ["p"]),
             helper.make_node("QuantizeLinear", ["p", "ys", "yz"], ["qy"]),
             helper.make_node("DequantizeLinear", ["qy", "ys", "yz"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        nodes.append(helper.make_node("Add", ["r", "r"], ["twice"]))
        outputs.append(helper.make_tensor_value_info("twice", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "rounded_product", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                          [2, 5, 16])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@contextlib.contextmanager
def _without_fold():
    passes = qdq_fusions.QDQ_PASSES
    index = next(i for i, p in enumerate(passes) if p.__name__ == "drop_rounding_before_quantizing")
    removed = passes.pop(index)
    try:
        yield
    finally:
        passes.insert(index, removed)


def _run(model: onnx.ModelProto, x: np.ndarray) -> tuple[list[str], list[np.ndarray]]:
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    return [n.op_type for n in session.graph_for({"x": x}).nodes], session.run(None, {"x": x})


def _float64(x: np.ndarray, second_scale: float = SCALE) -> np.ndarray:
    def rounded(v, s, z, low=0, high=255):
        return (np.clip(np.rint(v / s) + z, low, high) - z) * s

    model = _model(second_scale)
    w = numpy_helper.to_array([i for i in model.graph.initializer if i.name == "w"][0]).astype(np.float64) * 0.02
    a = rounded(rounded(x.astype(np.float64), SCALE, ZERO).reshape(-1, 16), second_scale, ZERO)
    return rounded(a @ w, Y_SCALE, Y_ZERO)


def _x() -> np.ndarray:
    x = (np.random.default_rng(0).standard_normal((2, 5, 16)) * 2).astype(np.float32)
    x.reshape(-1)[:3] = [1e3, -1e3, 0.5 * SCALE]  # saturation both ways, a tie
    return x


def test_the_rounding_before_a_quantizing_product_goes_and_the_codes_stay():
    x = _x()
    ops, (got,) = _run(_model(), x)
    assert "QuantizeDequantize" not in ops and ops.count("QuantizedMatMul") == 1, ops
    with _without_fold():
        kept_ops, (kept,) = _run(_model(), x)
    assert "QuantizeDequantize" in kept_ops
    np.testing.assert_array_equal(got, kept)  # the same codes: bit for bit
    assert float(np.abs(got - _float64(x)).max()) <= Y_SCALE * (1 + 1e-5)  # one code of float32 vs float64
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    want = oracle.InferenceSession(_model().SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    assert float(np.abs(got - want).max()) <= Y_SCALE * (1 + 1e-5)


@pytest.mark.parametrize("second_scale, extra_reader", [(SCALE * 1.7, False), (SCALE, True)])
def test_other_grids_or_other_readers_keep_the_rounding(second_scale, extra_reader):
    x = _x()
    ops, got = _run(_model(second_scale, extra_reader), x)
    assert "QuantizeDequantize" in ops, ops
    assert float(np.abs(got[0] - _float64(x, second_scale)).max()) <= Y_SCALE * (1 + 1e-5)
