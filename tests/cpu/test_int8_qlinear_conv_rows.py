"""QLinearConv's compiled patch-row path (ops/qlinear_conv_rows.py, compiled/dynamic_conv.qlinear_conv) against a
float64 reference of the quantized arithmetic and onnxruntime: 1-D and 2-D, padded, strided, dilated, uint8 and
int8 inputs, per-tensor and per-channel weight parameters, with and without the int32 bias. Rounding follows the
spec: one float64 rescale, ties to even; onnxruntime's float32 requantization may differ by one code."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from reference64 import integer_conv

GEOMETRIES = [
    ((1, 3, 28, 28), (48, 3, 7, 7), [7, 7], [0, 0, 0, 0], [1, 1]),
    ((2, 4, 9, 11), (8, 4, 3, 3), [2, 1], [1, 0, 2, 1], [1, 1]),
    ((1, 6, 20), (5, 6, 3), [2], [1, 1], [1]),
    ((1, 5, 17), (6, 5, 3), [1], [2, 0], [2]),
]
_TYPES = {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8}


def model(geometry, x_type, per_channel, bias, w_zero_value=0):
    x_shape, w_shape, strides, pads, dilations = geometry
    rng = np.random.default_rng(sum(w_shape))
    m = w_shape[0]
    w_scale = rng.uniform(0.005, 0.02, m).astype(np.float32) if per_channel else np.float32(0.01)
    inits = [numpy_helper.from_array(np.float32(0.03), "xs"), numpy_helper.from_array(x_type(7), "xz"),
             numpy_helper.from_array(rng.integers(-64, 64, w_shape).astype(np.int8), "w"),
             numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.full(m, w_zero_value, np.int8) if per_channel else np.int8(w_zero_value),
                                     "wz"),
             numpy_helper.from_array(np.float32(0.05), "ys"), numpy_helper.from_array(x_type(3), "yz"),
             numpy_helper.from_array(rng.integers(-2000, 2000, m).astype(np.int32), "b")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"] + (["b"] if bias else []),
                            ["y"], strides=strides, pads=pads, dilations=dilations)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", _TYPES[x_type], list(x_shape))],
                              [helper.make_tensor_value_info("y", _TYPES[x_type], None)], initializer=inits)
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    out.ir_version = 8
    return out, {t.name: numpy_helper.to_array(t) for t in inits}


def reference(x, init, geometry, bias) -> np.ndarray:
    _, _, strides, pads, dil = geometry
    codes = x.astype(np.int64) - int(init["xz"])
    w = init["w"].astype(np.int64) - init["wz"].astype(np.int64).reshape((-1,) + (1,) * (x.ndim - 1))
    if x.ndim == 3:
        codes, w = codes[:, :, None, :], w[:, :, None, :]
        strides, dil, pads = [1] + strides, [1] + dil, [0, pads[0], 0, pads[1]]
    padded = np.pad(codes, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    acc = integer_conv(padded, w, strides, dil)
    if bias:
        acc += init["b"].astype(np.int64).reshape(1, -1, 1, 1)
    scale = np.float64(init["xs"]) * init["ws"].astype(np.float64).reshape(-1, 1, 1) / np.float64(init["ys"])
    info = np.iinfo(init["yz"].dtype)
    y = np.clip(np.rint(acc * scale) + int(init["yz"]), info.min, info.max).astype(init["yz"].dtype)
    return y.reshape(y.shape[:2] + y.shape[3:]) if x.ndim == 3 else y


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[1])) if len(g) > 3 else None)
@pytest.mark.parametrize("x_type", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_patch_rows_match_reference_and_onnxruntime(geometry, x_type, per_channel, bias):
    onnx_model, init = model(geometry, x_type, per_channel, bias)
    data = onnx_model.SerializeToString()
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    oracle = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    info = np.iinfo(x_type)
    for seed in range(3):
        x = np.random.default_rng(seed).integers(info.min, info.max + 1, geometry[0]).astype(x_type)
        ours = session.run(None, {"x": x})[0]
        np.testing.assert_array_equal(ours, reference(x, init, geometry, bias))
        theirs = oracle.run(None, {"x": x})[0]
        assert np.abs(ours.astype(np.int64) - theirs).max() <= 1


def test_per_channel_weight_zero_points():
    # onnxruntime's QLinearConv wants zero weight zero points; the reference checks the nonzero ones
    onnx_model, init = model(GEOMETRIES[1], np.uint8, True, True, w_zero_value=3)
    session = onnx_runtime.InferenceSession(onnx_model.SerializeToString(), providers=["cpu"])
    x = np.random.default_rng(5).integers(0, 256, GEOMETRIES[1][0]).astype(np.uint8)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], reference(x, init, GEOMETRIES[1], True))
