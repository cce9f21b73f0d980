"""QuantizeLinear and DequantizeLinear keep their compiled-loop arguments per input shape and type while the same
constant parameters come in (ops/quantization.py): inputs of changing shapes in one session give onnxruntime's
codes and values on every call."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(7)


def model(per_axis: bool) -> bytes:
    scale = np.float32(RNG.uniform(0.01, 0.1, 3)) if per_axis else np.float32(0.05)
    zero = np.array([3, -4, 0], np.int8) if per_axis else np.int8(-2)
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in
             (("s", scale), ("z", zero), ("s2", np.float32(0.03)), ("z2", np.int8(5)))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
             helper.make_node("DequantizeLinear", ["q", "s2", "z2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", 3, "b"])],
                              [helper.make_tensor_value_info("q", TensorProto.INT8, None),
                               helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    m.ir_version = 9
    return m.SerializeToString()


@pytest.mark.parametrize("per_axis", [False, True])
def test_changing_shapes_in_one_session(per_axis):
    data = model(per_axis)
    ours = onnx_runtime.InferenceSession(data, providers=["cpu"])
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for shape in [(2, 3, 4), (1, 3, 7), (2, 3, 4), (0, 3, 2), (5, 3, 1)]:
        x = np.float32(RNG.standard_normal(shape) * 4)
        feeds = {"x": x}
        for a, b in zip(ours.run(None, feeds), theirs.run(None, feeds)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
