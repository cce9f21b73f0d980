"""compiled/qgemm.py's int32 products and compiled/quantize.py's (de)quantization loops, exactly against numpy
references: int64 sums wrapped to int32, and QuantizeLinear's float32 division, ties-to-even rounding and
saturation."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms.quantize import IntegerProduct
from onnx_runtime_ep_cpu.compiled import qgemm
from onnx_runtime_ep_cpu.compiled import quantize as compiled

U8, I8 = np.uint8, np.int8
RANGES = {U8: (0, 255), I8: (-128, 127), np.uint16: (0, 65535), np.int16: (-32768, 32767)}


def reference(a, b, a_zero, b_zero):
    """(a - a_zero) @ (b - b_zero) in int64, wrapped to int32 as a 32-bit accumulator wraps."""
    centred_a = a.astype(np.int64) - np.asarray(a_zero, np.int64).reshape(-1, 1)
    centred_b = b.astype(np.int64) - np.asarray(b_zero, np.int64).reshape(1, -1)
    return (centred_a @ centred_b).astype(np.int32)


def operand(rng, shape, dtype):
    low, high = RANGES[dtype]
    values = rng.integers(low, high + 1, size=shape).astype(dtype)
    values.flat[:2] = (low, high)[: values.size]  # the ends of the range, always
    return values


@pytest.mark.parametrize("a_type", [U8, I8])
@pytest.mark.parametrize("b_type", [U8, I8])
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 17, 5), (7, 33, 31), (2, 64, 64), (5, 100, 70), (1, 255, 33)])
def test_product_exact(a_type, b_type, shape):
    m, k, n = shape
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a, b = operand(rng, (m, k), a_type), operand(rng, (k, n), b_type)
    for a_zero, b_zero in [(RANGES[a_type][0], RANGES[b_type][1]), (RANGES[a_type][1], RANGES[b_type][0]), (0, 0)]:
        got = IntegerProduct()(a, b, np.asarray(a_zero, a_type), np.asarray(b_zero, b_type))
        np.testing.assert_array_equal(got, reference(a, b, a_zero, b_zero))


def test_product_per_row_and_column_zero_points_and_transposed_weight():
    rng = np.random.default_rng(7)
    a, b = operand(rng, (6, 37), U8), operand(rng, (37, 9), I8)
    a_zero, b_zero = operand(rng, (6,), U8), operand(rng, (9,), I8)
    product = IntegerProduct()
    np.testing.assert_array_equal(product(a, b, a_zero, b_zero), reference(a, b, a_zero, b_zero))
    bt = np.ascontiguousarray(b.T)
    np.testing.assert_array_equal(product(a, bt, a_zero, b_zero, trans_b=True), reference(a, b, a_zero, b_zero))


def test_product_batched_a_and_constant_weight_reused():
    rng = np.random.default_rng(3)
    a, b = operand(rng, (2, 3, 19), I8), operand(rng, (19, 11), U8)
    b.flags.writeable = False  # a constant: packed once, then reused
    product = IntegerProduct()
    for _ in range(2):
        got = product(a, b, np.asarray(-3, I8), np.asarray(200, U8))
        np.testing.assert_array_equal(got.reshape(6, 11), reference(a.reshape(6, 19), b, -3, 200))
    # a different weight of the same shape is not mistaken for the packed one
    b2 = operand(rng, (19, 11), U8)
    np.testing.assert_array_equal(product(a, b2).reshape(6, 11), reference(a.reshape(6, 19), b2, 0, 0))


@pytest.mark.parametrize(("a_shape", "b_shape"), [((1, 4, 16, 16), (1, 4, 16, 16)), ((2, 3, 5, 7), (3, 7, 9)),
                                                  ((5, 7), (2, 7, 3))])
def test_product_of_stacked_matrices(a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) + len(b_shape))
    a, b = operand(rng, a_shape, U8), operand(rng, b_shape, I8)
    got = IntegerProduct()(a, b, np.asarray(255, U8), np.asarray(-128, I8))
    want = np.matmul(a.astype(np.int64) - 255, b.astype(np.int64) + 128).astype(np.int32)
    np.testing.assert_array_equal(got, want)


def test_product_wraps_like_int32():
    k = 40000  # 255 * 255 * k passes 2**31
    a = np.full((1, k), 255, U8)
    b = np.zeros((k, 2), U8)
    got = IntegerProduct()(a, b, None, np.asarray(255, U8))
    want = reference(a, b, 0, 255)
    assert want[0, 0] != -255 * 255 * k  # it did wrap
    np.testing.assert_array_equal(got, want)


def test_product_declines_what_it_does_not_cover():
    product = IntegerProduct()
    a = np.zeros((2, 3), U8)
    assert product(a, np.zeros((2, 3, 4), U8), None, np.zeros(4, U8)) is None  # stacked B, per-column zero
    assert product(a.astype(np.int16), np.zeros((3, 4), U8)) is None  # 16-bit
    assert product(np.zeros((2, 2, 3), U8), np.zeros((3, 4), U8), np.zeros(2, U8)) is None  # per-row zero, batched A


def quantize_reference(x, scale, zero, dtype):
    low, high = RANGES[dtype]
    q = np.rint((x / scale).astype(np.float64)) + zero
    return np.clip(np.nan_to_num(q, nan=0.0), low, high).astype(dtype)


@pytest.mark.parametrize("dtype", [U8, I8, np.uint16, np.int16])
def test_quantize_and_dequantize_exact(dtype):
    rng = np.random.default_rng(1)
    low, high = RANGES[dtype]
    scale = np.array([0.1, 0.5, 3.0], np.float32)
    zero = np.array([low, high, (low + high) // 2], np.int32)
    x = (rng.standard_normal((2, 3, 29)) * 100 * (high - low) / 255).astype(np.float32)
    x[0, :, :6] = np.array([0.05, 0.15, -0.25, 1e30, -np.inf, np.nan], np.float32)[None]  # ties, saturation, NaN
    x[1, :, :3] = (np.array([0.5, 1.5, 2.5], np.float32) * scale[:, None])  # exact ties: half to even
    out = np.empty(x.shape, dtype)
    compiled.quantize(x, scale, zero, low, high, out)
    want = quantize_reference(x, scale[:, None], zero[:, None], dtype)
    np.testing.assert_array_equal(out, want)
    back = np.empty(x.shape, np.float32)
    compiled.dequantize(out, scale, zero, back)
    np.testing.assert_array_equal(back, (out.astype(np.int64) - zero[:, None]).astype(np.float32) * scale[:, None])
    fake = np.empty(x.shape, np.float32)
    compiled.fake_quantize(x, scale, zero, low, high, fake)
    np.testing.assert_array_equal(fake, back)


def test_dynamic_quantize_matches_numpy_float32_arithmetic():
    rng = np.random.default_rng(2)
    for x in [rng.standard_normal(50).astype(np.float32), np.abs(rng.standard_normal(9)).astype(np.float32) + 1,
              -np.abs(rng.standard_normal(9)).astype(np.float32), np.zeros(4, np.float32)]:
        out = np.empty(x.shape, U8)
        scale, zero = compiled.dynamic_quantize(x, out)
        low, high = min(np.float32(0), x.min()), max(np.float32(0), x.max())
        want_scale = np.float32((high - low) / np.float32(255)) if high > low else np.float32(1) / np.float32(255)
        want_zero = np.clip(np.rint(np.float32(0) - low / want_scale), 0, 255)
        assert np.float32(scale) == want_scale and zero == want_zero
        np.testing.assert_array_equal(out, quantize_reference(x, want_scale, want_zero, U8))


def test_pack_columns_subtracts_per_column_zero_points():
    b = np.array([[0, 255], [7, 128]], U8)
    packed = np.empty((2, 2), np.int16)
    qgemm.pack_columns(b, np.array([255, 0], np.int32), packed)
    np.testing.assert_array_equal(packed, [[-255, -248], [255, 128]])


def conv_reference(x, w, x_zero, w_zero, pad):
    """ConvInteger in int64 (stride 1, symmetric padding with the zero point), wrapped to int32."""
    xc = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=int(x_zero)) - int(x_zero)
    wc = w.astype(np.int64) - np.asarray(w_zero, np.int64).reshape(-1, 1, 1, 1)
    windows = np.lib.stride_tricks.sliding_window_view(xc, w.shape[2:], axis=(2, 3))  # N, C, H, W, kh, kw
    return np.einsum("nchwij,mcij->nmhw", windows, wc).astype(np.int32)


@pytest.mark.parametrize("weight_scale", [1, 200])  # small weights: the exact float32 path; large: float64
@pytest.mark.parametrize("x_type", [U8, I8])
def test_conv_integer_exact(weight_scale, x_type):
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.quantization import conv_integer

    rng = np.random.default_rng(weight_scale)
    channels = 40  # 40 * 9 taps * 127 * 255 passes 2**24: the large weights need float64
    x = operand(rng, (2, channels, 7, 6), x_type)
    w = np.clip(rng.integers(-1, 2, (5, channels, 3, 3)) * weight_scale, -128, 127).astype(I8)
    w[0].flat[:3] = (-128, 127, -128)
    x_zero, w_zero = np.asarray(RANGES[x_type][1], x_type), np.array([-128, 127, 0, 3, -5], I8)
    kernel = conv_integer(Node("ConvInteger", [], [], name="c", attrs={"pads": [1, 1, 1, 1]}), None, 10)
    for _ in range(2):  # the second call reuses the prepared weight
        (got,) = kernel(x, w, x_zero, w_zero)
        np.testing.assert_array_equal(got, conv_reference(x, w, x_zero, w_zero, 1))


BROADCASTS = [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (4,)), ((1, 4), (3, 4)), ((2, 3, 4), ()), ((3, 4), (2, 3, 4)),
              ((2, 3, 1), (2, 3, 4)), ((5,), (1,)), ((2, 0, 3), (3,)), ((1, 6, 4, 5), (1, 6, 1, 1)),
              ((2, 6, 1, 1), (2, 6, 4, 5)), ((1, 6, 1, 1), (2, 6, 4, 5)), ((3, 1), (2, 3, 4)), ((6,), (6, 1))]


@pytest.mark.parametrize(("a_shape", "b_shape"), BROADCASTS)
@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("dtype", [U8, I8])
def test_qlinear_binary_exact(a_shape, b_shape, op, dtype):
    """The compiled pass (and the numpy path it leaves column broadcasts to) against the float64 formula."""
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.contrib_qlinear_binary import qlinear_add, qlinear_mul

    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape))
    a, b = operand(rng, a_shape, dtype), operand(rng, b_shape, dtype)
    low, high = RANGES[dtype]
    scales = [np.array(s, np.float32) for s in (0.037, 0.011, 0.05 if op == "QLinearAdd" else 0.003)]
    zeros = [np.array(z, dtype) for z in (low, high, (low + high) // 2)]
    factory = qlinear_add if op == "QLinearAdd" else qlinear_mul
    kernel = factory(Node(op, [], [], name="q", domain="com.microsoft"), None, 1)
    (got,) = kernel(a, scales[0], zeros[0], b, scales[1], zeros[1], scales[2], zeros[2])
    x = a.astype(np.int64) - int(zeros[0])
    y = b.astype(np.int64) - int(zeros[1])
    sa, sb, sc = (float(s) for s in scales)
    values = (sa * x + sb * y) / sc if op == "QLinearAdd" else (x * y) * (sa * sb / sc)
    want = np.clip(np.rint(values) + int(zeros[2]), low, high).astype(dtype)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("per_channel", [False, True])
def test_qlinear_conv_requantizes_like_the_float64_formula(per_channel):
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.quantization import qlinear_conv

    rng = np.random.default_rng(11)
    x, w = operand(rng, (2, 6, 5, 5), U8), operand(rng, (4, 6, 3, 3), I8)
    x_scale, y_scale, x_zero, y_zero = np.float32(0.02), np.float32(0.07), np.uint8(131), np.uint8(7)
    w_scale = rng.uniform(0.001, 0.02, 4).astype(np.float32) if per_channel else np.float32(0.01)
    w_zero = np.zeros(4, I8) if per_channel else np.int8(0)
    bias = rng.integers(-5000, 5000, 4).astype(np.int32)
    kernel = qlinear_conv(Node("QLinearConv", [], [], name="c", attrs={"pads": [1, 1, 1, 1]}), None, 10)
    (got,) = kernel(x, np.asarray(x_scale), np.asarray(x_zero), w, np.asarray(w_scale), np.asarray(w_zero),
                    np.asarray(y_scale), np.asarray(y_zero), bias)
    acc = conv_reference(x, w, x_zero, w_zero, 1).astype(np.float64) + bias.reshape(-1, 1, 1)
    multiplier = np.float64(x_scale) * np.asarray(w_scale, np.float64).reshape(-1, 1, 1) / np.float64(y_scale)
    want = np.clip(np.rint(acc * multiplier) + int(y_zero), 0, 255).astype(U8)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [(5,), (0,), (2, 3)])
def test_dynamic_quantize_of_zeros_follows_onnx_reference(shape):
    """All zeros (or nothing): range [0, 0]; onnx's reference takes a unit range (scale 1/255), as both the
    operator and DynamicQuantizeMatMul's quantization here do (onnxruntime returns scale 1: only the scale
    differs, the codes and zero point are 0 in both)."""
    import onnx_runtime as ort
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator
    from onnx_runtime_ep_cpu.algorithms.quantize import dynamic_uint8

    model = helper.make_model(helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, list(shape)),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("z", TensorProto.UINT8, [])]), opset_imports=[helper.make_opsetid("", 17)])
    x = np.zeros(shape, np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    if x.size:
        want = ReferenceEvaluator(model).run(None, {"x": x})
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    assert got[1] == np.float32(1) / np.float32(255) and got[2] == 0 and not got[0].any()
    scale, zero, codes = dynamic_uint8(x)
    assert scale == got[1] and zero == 0 and not codes.any()
