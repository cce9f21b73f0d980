"""A pooling axis with one output window ignores its stride: a stride of 2**62 there (a hostile or mistyped
attribute) gives the one window's result on every path, not a buffer sized by the stride (fuzz seed 72)."""

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.compiled import deferred


def _model(op: str, strides, kernel=(5, 5)):
    node = helper.make_node(op, ["x"], ["y"], kernel_shape=list(kernel), strides=list(strides))
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("strides", [(2 ** 62, 2 ** 31), (2 ** 62, 3), (3, 2 ** 40)])
def test_huge_stride_on_one_window_axis(op, strides):
    x = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)
    session = ort.InferenceSession(_model(op, strides), providers=["CPUExecutionProvider"])
    reduce = np.max if op == "MaxPool" else np.mean
    x64 = x.astype(np.float64)
    rows = [0] if strides[0] > 27 else list(range(0, 28, strides[0]))
    cols = [0] if strides[1] > 27 else list(range(0, 28, strides[1]))
    expected = np.array([[[[reduce(x64[n, c, i:i + 5, j:j + 5]) for j in cols] for i in rows]
                          for c in range(3)] for n in range(1)])
    for _ in range(3):  # the numpy twin first, then the compiled loop once it is loaded
        y = session.run(None, {"x": x})[0]
        assert y.shape == expected.shape
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
        deferred.wait_ready(240)
