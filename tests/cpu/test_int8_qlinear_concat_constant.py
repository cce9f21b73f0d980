"""QLinearConcat with a constant part (a ViT's class token): the constant's requantization to the output's grid is
made once and reused while the same constants come in; the varying part is requantized on every call. Checked
against onnxruntime as the oracle, code by code, over calls with different inputs."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
from onnx import TensorProto, helper, numpy_helper


def _model(dtype):
    rng = np.random.default_rng(8)
    shift = 0 if dtype == np.int8 else 128  # the same codes on uint8's range
    token = (rng.integers(-100, 100, (1, 1, 6)) + shift).astype(dtype)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("token", token), ("ts", np.float32(0.0037)), ("tz", np.array(-3 + shift, dtype)), ("xs", np.float32(0.011)),
        ("xz", np.array(5 + shift, dtype)), ("ys", np.float32(0.0093)), ("yz", np.array(-4 + shift, dtype)))]
    code = TensorProto.INT8 if dtype == np.int8 else TensorProto.UINT8
    node = helper.make_node("QLinearConcat", ["ys", "yz", "token", "ts", "tz", "x", "xs", "xz"], ["y"], axis=1,
                            domain="com.microsoft")
    graph = helper.make_graph([node], "concat", [helper.make_tensor_value_info("x", code, [1, 5, 6])],
                              [helper.make_tensor_value_info("y", code, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def test_constant_part_requantized_once_matches_onnxruntime():
    for dtype in (np.int8, np.uint8):
        model = _model(dtype).SerializeToString()
        sess = ort.InferenceSession(model, providers=["cpu"])
        oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(2)
        info = np.iinfo(dtype)
        for run in range(4):
            x = rng.integers(info.min, info.max + 1, (1, 5, 6)).astype(dtype)
            got, want = sess.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0]
            assert got.dtype == want.dtype and got.shape == want.shape == (1, 6, 6)
            diff = np.abs(got.astype(np.int64) - want.astype(np.int64))
            assert diff.max() <= 1 and diff[:, 0].max() == 0, (dtype, run)
