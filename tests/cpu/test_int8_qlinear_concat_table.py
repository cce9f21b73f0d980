"""QLinearConcat of a varying part on another grid: its codes requantized through a 256-code table made once per
set of constant parameters. Every code (the type's extremes, the zero points, saturation at both ends) against
the float32 arithmetic of DequantizeLinear then QuantizeLinear exactly, a float64 reference within one unit, and
onnxruntime within one unit; the same grid passes the codes through."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper


def _model(dtype, x_params, y_params) -> bytes:
    code = TensorProto.INT8 if dtype == np.int8 else TensorProto.UINT8
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("xs", np.float32(x_params[0])), ("xz", np.array(x_params[1], dtype)),
        ("ws", np.float32(0.02)), ("wz", np.array(x_params[1], dtype)),
        ("ys", np.float32(y_params[0])), ("yz", np.array(y_params[1], dtype)))]
    node = helper.make_node("QLinearConcat", ["ys", "yz", "x", "xs", "xz", "w", "ws", "wz"], ["y"], axis=-1,
                            domain="com.microsoft")
    graph = helper.make_graph([node], "concat", [helper.make_tensor_value_info("x", code, [2, 256]),
                                                 helper.make_tensor_value_info("w", code, [2, 3])],
                              [helper.make_tensor_value_info("y", code, None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m.SerializeToString()


def _float32_path(x, scale, zero, y_scale, y_zero, dtype):
    real = (x.astype(np.int32) - zero).astype(np.float32) * np.float32(scale)
    info = np.iinfo(dtype)
    return np.clip(np.rint(real / np.float32(y_scale)) + y_zero, info.min, info.max).astype(dtype)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("x_params,y_params", [
    ((0.011, 5), (0.0093, -4)),  # a finer output grid: both ends saturate
    ((0.004, -128), (0.05, 127)),  # zero points at the type's extremes (uint8: shifted to 0 and 255 below)
    ((0.02, 0), (0.02, 0)),  # the same grid: the codes pass through
])
def test_every_code_requantized(dtype, x_params, y_params):
    shift = 0 if dtype == np.int8 else 128
    x_params, y_params = (x_params[0], x_params[1] + shift), (y_params[0], y_params[1] + shift)
    model = _model(dtype, x_params, y_params)
    sess = ort.InferenceSession(model, providers=["cpu"])
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    every = np.arange(256, dtype=np.uint8).view(dtype)
    rng = np.random.default_rng(4)
    for _run in range(3):  # the table is made on the first call and read on the others
        x = np.stack([every, rng.permutation(every)])
        w = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max + 1, (2, 3)).astype(dtype)
        got = sess.run(None, {"x": x, "w": w})[0]
        assert got.dtype == dtype and got.shape == (2, 259)
        np.testing.assert_array_equal(got[:, :256], _float32_path(x, *x_params, *y_params, dtype))
        exact = (x.astype(np.float64) - x_params[1]) * np.float64(np.float32(x_params[0])) / np.float32(y_params[0])
        reference = np.clip(np.rint(exact) + y_params[1], np.iinfo(dtype).min, np.iinfo(dtype).max)
        assert np.abs(got[:, :256].astype(np.int64) - reference).max() <= 1
        want = oracle.run(None, {"x": x, "w": w})[0]
        assert np.abs(got.astype(np.int64) - want.astype(np.int64)).max() <= 1
