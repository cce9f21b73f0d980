"""qdq_folds.drop_activation_before_quantizing: a Relu before a QuantizeLinear whose zero point is the codes' lowest
value, or a Clip whose bounds quantize to the lowest and highest codes, goes (the quantization saturates the same
values), so the convolution before it and the QuantizeLinear run as one integer group; any other Relu or Clip stays.
The codes match a float64 reference of the unfolded graph either way."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import qgemm_quads

X_SCALE, X_ZERO, W_SCALE, B_SCALE = 0.03, 128, 0.004, 0.03 * 0.004
X_SHAPE, W_SHAPE = (1, 32, 20, 20), (64, 32, 3, 3)  # 7.4M multiply-adds: a large group


def _model(activation: str, y_scale: float, y_zero: int, y_type, bounds=(0.0, 6.0),
           activation_read: bool = False) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv (int8 weights, int32 bias) -> activation -> QuantizeLinear -> y (the codes), as a QDQ tool
    that keeps the activation writes it; ``activation_read``: the activation's output is a graph output too."""
    rng = np.random.default_rng(3)
    zero_type = np.uint8 if y_type == TensorProto.UINT8 else np.int8
    inits = [numpy_helper.from_array(np.array(X_SCALE, np.float32), "xs"),
             numpy_helper.from_array(np.array(X_ZERO, np.uint8), "xz"),
             numpy_helper.from_array(rng.integers(-127, 128, W_SHAPE).astype(np.int8), "w"),
             numpy_helper.from_array(np.array(W_SCALE, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(rng.integers(-3000, 3000, W_SHAPE[0]).astype(np.int32), "b"),
             numpy_helper.from_array(np.array(B_SCALE, np.float32), "bs"),
             numpy_helper.from_array(np.array(0, np.int32), "bz"),
             numpy_helper.from_array(np.array(y_scale, np.float32), "ys"),
             numpy_helper.from_array(np.array(y_zero, zero_type), "yz"),
             numpy_helper.from_array(np.array(bounds[0], np.float32), "lo"),
             numpy_helper.from_array(np.array(bounds[1], np.float32), "hi")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "xs", "xz"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"]),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bf"]),
             helper.make_node("Conv", ["xf", "wf", "bf"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(activation, ["c", "lo", "hi"] if activation == "Clip" else ["c"], ["a"]),
             helper.make_node("QuantizeLinear", ["a", "ys", "yz"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", y_type, None)]
    if activation_read:
        outputs.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "conv_activation_quantize",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, X_SHAPE)], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _reference(model: onnx.ModelProto, x: np.ndarray, activation: str, bounds, y_scale, y_zero, y_type) -> np.ndarray:
    """The unfolded graph in float64: the rounded input, the convolution, the activation (or "none"), the
    quantization."""
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    xq = np.clip(np.rint(x.astype(np.float64) / X_SCALE) + X_ZERO, 0, 255)
    xf = np.pad((xq - X_ZERO) * X_SCALE, ((0, 0), (0, 0), (1, 1), (1, 1)))
    w = values["w"].astype(np.float64) * W_SCALE
    windows = np.lib.stride_tricks.sliding_window_view(xf, (3, 3), axis=(2, 3))  # (1, C, H, W, 3, 3)
    conv = np.einsum("nchwij,mcij->nmhw", windows, w) + (values["b"] * B_SCALE)[None, :, None, None]
    low, high = {"Clip": bounds, "Relu": (0.0, np.inf)}.get(activation, (-np.inf, np.inf))
    info = np.iinfo(np.uint8 if y_type == TensorProto.UINT8 else np.int8)
    return np.clip(np.rint(np.clip(conv, low, high) / y_scale) + y_zero, info.min, info.max)


def _x() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(X_SHAPE) * 1.5).astype(np.float32)


@pytest.mark.parametrize(("activation", "y_scale", "y_zero", "y_type", "bounds", "read", "redundant"), [
    ("Relu", 0.05, 0, TensorProto.UINT8, None, False, True),  # uint8 codes from 0: the Relu saturates anyway
    ("Relu", 0.05, -128, TensorProto.INT8, None, False, True),  # int8 codes from -128
    ("Clip", 6 / 255, 0, TensorProto.UINT8, (0.0, 6.0), False, True),  # Relu6 onto the whole code range
    ("Clip", 0.05, 0, TensorProto.UINT8, (-1.0, 20.0), False, True),  # bounds past both saturations
    ("Relu", 0.05, 3, TensorProto.UINT8, None, False, False),  # codes 0..2 are negative values: the Relu counts
    ("Clip", 0.05, 0, TensorProto.UINT8, (0.0, 6.0), False, False),  # 6 is code 120: the Clip counts
    ("Relu", 0.05, 0, TensorProto.UINT8, None, True, True),  # the activation is read elsewhere too: it stays
])
def test_saturated_activations_fold_into_the_group(activation, y_scale, y_zero, y_type, bounds, read, redundant):
    bounds, folds = bounds or (0.0, 6.0), redundant and not read
    model = _model(activation, y_scale, y_zero, y_type, bounds, read)
    x = _x()
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = [n.op_type for n in session.graph_for({"x": x}).nodes]
    outputs = session.run(None, {"x": x})
    got = outputs[0].astype(np.int64)
    if folds:
        assert activation not in ops, ops
        if qgemm_quads.AVAILABLE:
            assert "QuantizedConv" in ops, ops  # the convolution, the rounding and the quantization as one group
    want = _reference(model, x, activation, bounds, y_scale, y_zero, y_type)
    without = _reference(model, x, "none", bounds, y_scale, y_zero, y_type)
    assert np.array_equal(want, without) == redundant  # the activation changes codes exactly where it must stay
    if read:
        assert outputs[1].min() == 0 and outputs[1].max() > 0  # the Relu's own output, as the graph gives it
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1  # (a sum within float32 rounding of a tie)
    assert np.mean(got == want) > 0.999
    assert (got != y_zero).sum() > got.size // 4  # the codes are not all saturated: the bounds are exercised


@pytest.mark.parametrize("low", [np.nan, -np.inf])
def test_a_clip_with_a_nan_bound_stays(low):
    # A NaN bound is no saturation the quantization makes (the Clip's output is NaN): the Clip stays, and the session
    # is made and runs (the pass once failed on it, converting NaN to a code); an infinite bound is the open side,
    # which folds.
    model = _model("Clip", 6 / 255, 0, TensorProto.UINT8, (low, 6.0))
    x = _x()
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = [n.op_type for n in session.graph_for({"x": x}).nodes]
    folded = "Clip" not in ops and not any(n.op_type == "FusedConv" for n in session.graph_for({"x": x}).nodes)
    assert folded != bool(np.isnan(low)), ops  # (kept, the Clip joins the float convolution as its activation)
    got = session.run(None, {"x": x})[0]
    assert got.shape == (1, W_SHAPE[0], *X_SHAPE[2:])
    if not np.isnan(low):
        want = _reference(model, x, "Clip", (low, 6.0), 6 / 255, 0, TensorProto.UINT8)
        assert np.abs(got.astype(np.int64) - want).max() <= 1 and np.mean(got == want) > 0.999
