"""SiLU after a convolution, as both torch exporters write it (Sigmoid -> Mul(x, sigmoid), which the provider
fuses into one Swish) and as one Swish node (opset 24): the float32 one-pass loop (compiled/silu.py) within a
float64 reference's bound, on odd sizes and strides, and special values as numpy's formula gives them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.session import InferenceSession, SessionOptions
from reference64 import run_float64

RNG = np.random.default_rng(26)


def _silu64(x: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-alpha * x))


def _session(model: onnx.ModelProto) -> InferenceSession:
    options = SessionOptions()
    options.intra_op_num_threads = 1
    return InferenceSession(model.SerializeToString(), options)


def _conv_silu(spelling: str, w: np.ndarray, b: np.ndarray, stride: int, group: int) -> onnx.ModelProto:
    """x -> Conv(w, b) -> SiLU in ``spelling`` ("mul": Sigmoid and Mul, "swish": Swish), dynamic batch."""
    kernel, pad = w.shape[-1], w.shape[-1] // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel], strides=[stride] * 2,
                              pads=[pad] * 4, group=group)]
    if spelling == "mul":
        nodes += [helper.make_node("Sigmoid", ["c"], ["s"]), helper.make_node("Mul", ["c", "s"], ["y"])]
    else:
        nodes += [helper.make_node("Swish", ["c"], ["y"], alpha=1.0)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", w.shape[1] * group, None, None])
    graph = helper.make_graph(nodes, "conv_silu", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17 if spelling == "mul" else 24)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("spelling", ["mul", "swish"])
@pytest.mark.parametrize("cin,cout,kernel,stride,group,size", [
    (3, 8, 3, 2, 1, 17),  # a stem: odd map, stride 2
    (12, 12, 5, 1, 12, 9),  # depthwise
    (16, 24, 1, 1, 1, 7),  # pointwise
    (24, 40, 1, 2, 1, 11),  # strided pointwise
    (40, 40, 3, 3, 40, 13),  # depthwise, stride 3
])
def test_conv_silu_both_spellings_within_the_float64_bound(spelling, cin, cout, kernel, stride, group, size):
    w = (RNG.standard_normal((cout, cin // group, kernel, kernel)) * 3 / np.sqrt(cin // group * kernel ** 2))
    w, b = w.astype(np.float32), (RNG.standard_normal(cout) * 0.5).astype(np.float32)
    x = RNG.standard_normal((5, cin, size, size)).astype(np.float32)
    got = _session(_conv_silu(spelling, w, b, stride, group)).run(None, {"x": x})[0]
    want = run_float64(_conv_silu("mul", w, b, stride, group), {"x": x})[0]  # (the same function, in float64)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, float(np.abs(want).max())))


def _swish_model(alpha: float, dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Swish", ["x"], ["y"], alpha=alpha)], "swish",
                              [helper.make_tensor_value_info("x", dtype, None)],
                              [helper.make_tensor_value_info("y", dtype, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("alpha", [1.0, 0.5, 1.702])
@pytest.mark.parametrize("shape", [(0, 3), (1,), (17,), (3, 5, 7), (2, 1023), (32, 24, 9, 9)])
def test_swish_float32_loop_within_the_float64_bound(alpha, shape):
    x = (RNG.standard_normal(shape) * 12).astype(np.float32)
    got = _session(_swish_model(alpha)).run(None, {"x": x})[0]
    want = _silu64(x, alpha)
    assert got.shape == x.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-30)


def test_swish_special_values_as_numpy_gives_them():
    x = np.array([np.nan, np.inf, -np.inf, -200.0, -88.0, 0.0, -0.0, 88.0, 1e-30], dtype=np.float32)
    got = _session(_swish_model(1.0)).run(None, {"x": x})[0]
    assert np.isnan(got[0]) and got[1] == np.inf and np.isnan(got[2])  # -inf * 0, as -inf / inf in numpy
    assert got[3] == 0.0 and abs(got[4]) < 1e-30 and got[5] == 0.0 and got[7] == np.float32(88.0)
    np.testing.assert_allclose(got[8], 5e-31, rtol=1e-6)


def test_swish_strided_and_float64_inputs_keep_numpy():
    """A view that is not contiguous and a float64 tensor take numpy's formula, within the same bound."""
    x64 = RNG.standard_normal((4, 6)) * 9
    got = _session(_swish_model(0.75, TensorProto.DOUBLE)).run(None, {"x": x64})[0]
    np.testing.assert_allclose(got, _silu64(x64, 0.75), rtol=1e-12)
    x = (RNG.standard_normal((6, 8)) * 9).astype(np.float32)[:, ::2]
    got = _session(_swish_model(1.0)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, _silu64(x), rtol=3e-6, atol=1e-30)
