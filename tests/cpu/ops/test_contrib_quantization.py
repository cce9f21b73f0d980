"""The com.microsoft quantized operators (ops/contrib_quantization.py, contrib_qlinear_*.py,
contrib_integer_matmul.py and contrib_qattention.py) against onnxruntime's CPU provider: integer outputs
exactly, or within 1 where the spec leaves a requantization's float rounding to the implementation (said per
test); float outputs within a bound set by the quantization step."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from contrib_reference import (
    RNG,
    assert_floats,
    assert_integers,
    operand_a,
    quantized,
    run_both,
    run_ours,
    zero_point,
)
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError, OnnxRuntimeError

U8, I8 = np.uint8, np.int8
F32 = np.float32
EIGHT_BIT = [U8, I8]


def f32(value):
    return np.array(value, F32)


# -- QLinearAdd, QLinearMul ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("shapes", [((3, 4, 5), (3, 4, 5)), ((2, 3, 4), (4,)), ((1, 5), (3, 1))])
@pytest.mark.parametrize("constant", [False, True])
def test_qlinear_binary(op, dtype, shapes, constant):
    # constant: the parameters are initializers, which the kernel checks once and keeps.
    a, b = quantized(shapes[0], dtype), quantized(shapes[1], dtype)
    scales = (f32(0.05), f32(0.031), f32(0.11 if op == "QLinearAdd" else 0.7))
    zeros = (zero_point(dtype, 3), zero_point(dtype, -2 if dtype == I8 else 120), zero_point(dtype))
    ours, theirs = run_both(op, [a, scales[0], zeros[0], b, scales[1], zeros[1], scales[2], zeros[2]],
                            constants=(1, 2, 4, 5, 6, 7) if constant else ())
    # The float rounding of the requantization is the implementation's: ties may round either way.
    assert_integers(ours[0], theirs[0], off_by_one=True)


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_binary_zero_points_omitted(op):
    # onnxruntime's type inference needs A's and B's zero points; C's may be omitted (zero).
    a, b = quantized((4, 6), U8), quantized((4, 6), U8)
    ours, theirs = run_both(op, [a, f32(0.02), zero_point(U8, 3), b, f32(0.03), zero_point(U8, 9), f32(0.05)])
    assert_integers(ours[0], theirs[0], off_by_one=True)
    (all_omitted,) = run_ours(op, [a, f32(0.02), None, b, f32(0.03), None, f32(0.05)])
    assert_integers(all_omitted, run_ours(op, [a, f32(0.02), zero_point(U8, 0), b, f32(0.03), zero_point(U8, 0),
                                               f32(0.05), zero_point(U8, 0)])[0])


# -- QLinearSigmoid, QLinearLeakyRelu --------------------------------------------------------------


def every_value(dtype):
    return np.arange(256, dtype=np.uint8).view(dtype).reshape(16, 16)


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("alpha", [None, 0.1, 1.7])
def test_qlinear_leaky_relu_every_value(dtype, alpha):
    attrs = {} if alpha is None else {"alpha": alpha}
    y_zero = zero_point(dtype, -5 if dtype == I8 else 60)
    inputs = [every_value(dtype), f32(0.04), zero_point(dtype, 10), f32(0.03), y_zero]
    ours, theirs = run_both("QLinearLeakyRelu", inputs, attrs)
    assert_integers(ours[0], theirs[0])  # a table of float32 products, quantized as QuantizeLinear does: exact


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("with_zero_points", [True, False])
def test_qlinear_sigmoid_every_value(dtype, with_zero_points):
    zeros = (zero_point(dtype, 7), zero_point(dtype)) if with_zero_points else (None, None)
    ours, theirs = run_both("QLinearSigmoid", [every_value(dtype), f32(0.05), zeros[0], f32(1 / 256), zeros[1]])
    # onnxruntime's sigmoid is a float32 approximation; a value at a rounding tie may land either side.
    assert_integers(ours[0], theirs[0], off_by_one=True)


# -- QLinearSoftmax --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("opset,axis,shape", [(13, -1, (3, 4, 10)), (13, 1, (2, 6, 5)), (11, 1, (2, 3, 4)),
                                              (12, None, (4, 8)), (13, None, (2, 3, 7))])
def test_qlinear_softmax(dtype, opset, axis, shape):
    # Logits within a narrow band: no probability rounds to 1 (onnxruntime's int8 path wraps 1.0 around).
    x = RNG.integers(-20, 21, size=shape).astype(dtype) + np.array(0 if dtype == I8 else 100, dtype)
    y_zero = zero_point(dtype, -128 if dtype == I8 else 0)
    attrs = {"opset": opset} | ({} if axis is None else {"axis": axis})
    ours, theirs = run_both("QLinearSoftmax", [x, f32(0.08), zero_point(dtype, 3), f32(1 / 256), y_zero], attrs)
    # The exponentials' float rounding is the implementation's: 1 off at a tie.
    assert_integers(ours[0], theirs[0], off_by_one=True)


@pytest.mark.parametrize("dtype", EIGHT_BIT)
def test_qlinear_softmax_rows_match_float64(dtype):
    """The last-axis rows run in one compiled pass (a 256-entry exp table): the spec's arithmetic in float64,
    each probability rounded to float32 and quantized; the full code range, ties aside, exactly."""
    x = RNG.integers(np.iinfo(dtype).min, np.iinfo(dtype).max + 1, size=(5, 3, 40)).astype(dtype)
    y_zero = zero_point(dtype, -128 if dtype == I8 else 0)
    (y,) = run_ours("QLinearSoftmax", [x, f32(0.05), zero_point(dtype, 3), f32(1 / 256), y_zero], {"opset": 13})
    e = np.exp((x.astype(np.int64) - x.astype(np.int64).max(axis=-1, keepdims=True)) * np.float64(F32(0.05)))
    p = (e / e.sum(axis=-1, keepdims=True)).astype(F32)
    info = np.iinfo(dtype)
    want = np.clip(np.rint(p / F32(1 / 256)).astype(np.float64) + int(y_zero), info.min, info.max).astype(dtype)
    assert_integers(y, want, off_by_one=True)


def test_qlinear_softmax_saturates_a_certain_class():
    # A probability of 1 quantizes past int8's range with zero point -128 and saturates to 127 (onnxruntime's
    # int8 kernel wraps it around instead, so this checks the spec alone).
    x = np.array([[-128, 127, -128]], I8)
    (y,) = run_ours("QLinearSoftmax", [x, f32(0.5), zero_point(I8), f32(1 / 256), zero_point(I8, -128)], {"opset": 13})
    np.testing.assert_array_equal(y, np.array([[-128, 127, -128]], I8))


# -- QLinearConcat ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("axis", [1, -1, 0])
def test_qlinear_concat(dtype, axis):
    shapes = {1: [(2, 3, 4), (2, 5, 4), (2, 1, 4)], -1: [(2, 3, 1), (2, 3, 4), (2, 3, 2)],
              0: [(1, 3, 2), (2, 3, 2), (3, 3, 2)]}[axis]
    y_scale, y_zero = f32(0.05), zero_point(dtype, 4)
    params = [(f32(0.02), zero_point(dtype, -3 if dtype == I8 else 100)), (y_scale, y_zero),  # copied as it is
              (f32(0.3), zero_point(dtype))]
    inputs = [y_scale, y_zero]
    for shape, (scale, zero) in zip(shapes, params):
        inputs += [quantized(shape, dtype), scale, zero]
    ours, theirs = run_both("QLinearConcat", inputs, {"axis": axis})
    assert_integers(ours[0], theirs[0])  # dequantize and quantize in float32, as onnxruntime's tables: exact


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((3, 1), (1, 4), (3, 4)), ((4,), (2, 4), ())])
def test_qlinear_where(dtype, shapes):
    condition = RNG.integers(0, 2, size=shapes[0]).astype(bool)
    x, y = quantized(shapes[1], dtype), quantized(shapes[2], dtype)
    y_zero = zero_point(dtype, -1 if dtype == I8 else 90)
    inputs = [condition, x, f32(0.021), zero_point(dtype, 3), y, f32(0.047), y_zero, f32(0.033), zero_point(dtype, 5)]
    ours, theirs = run_both("QLinearWhere", inputs)
    assert_integers(ours[0], theirs[0])  # dequantize and quantize in float32, as onnxruntime's tables: exact


# -- QLinearGlobalAveragePool, QLinearAveragePool --------------------------------------------------


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 4, 7), (1, 2, 3, 2, 3)])
def test_qlinear_global_average_pool(dtype, channels_last, shape):
    x = quantized(shape, dtype)
    inputs = [x, f32(0.05), zero_point(dtype, 5), f32(0.03), zero_point(dtype, -7 if dtype == I8 else 130)]
    ours, theirs = run_both("QLinearGlobalAveragePool", inputs, {"channels_last": channels_last})
    assert_integers(ours[0], theirs[0], off_by_one=True)  # the mean's float rounding is the implementation's


POOLS = [
    ((1, 3, 7, 6), {"kernel_shape": [3, 3]}),
    ((2, 2, 8, 8), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1]}),
    ((1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ((1, 2, 7, 8), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 6, 5), {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER"}),
    ((2, 3, 9), {"kernel_shape": [4], "strides": [2], "pads": [1, 2]}),
    ((1, 2, 4, 5, 4), {"kernel_shape": [2, 3, 2], "pads": [0, 1, 0, 1, 1, 1]}),
]


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("channels_last", [0, 1])
@pytest.mark.parametrize("shape,attrs", POOLS)
def test_qlinear_average_pool(dtype, channels_last, shape, attrs):
    if channels_last:
        shape = (shape[0],) + shape[2:] + (shape[1],)
    x = quantized(shape, dtype)
    inputs = [x, f32(0.0517), zero_point(dtype, 5), f32(0.0433), zero_point(dtype, -3 if dtype == I8 else 125)]
    ours, theirs = run_both("QLinearAveragePool", inputs, attrs | {"channels_last": channels_last})
    assert_integers(ours[0], theirs[0], off_by_one=True)  # float32 sums in another order: ties may differ


def test_qlinear_average_pool_zero_points_omitted():
    # onnxruntime's type inference needs x_zero_point; y_zero_point may be omitted (zero).
    x = quantized((1, 2, 5, 5), U8)
    inputs = [x, f32(0.05), zero_point(U8, 3), f32(0.04)]
    ours, theirs = run_both("QLinearAveragePool", inputs, {"kernel_shape": [2, 2]})
    assert_integers(ours[0], theirs[0], off_by_one=True)


# -- QGemm -----------------------------------------------------------------------------------------

QGEMM_TYPES = [(U8, U8), (U8, I8), (I8, I8)]


def qgemm_inputs(a_type, b_type, trans_a, trans_b, per_column, m=5, k=7, n=6):
    a = operand_a((k, m) if trans_a else (m, k), a_type, b_type)
    b = quantized((n, k) if trans_b else (k, n), b_type)
    b_scale = f32(RNG.uniform(0.01, 0.05, n)) if per_column else f32(0.03)
    b_zero = (quantized((n,), b_type) if per_column else zero_point(b_type, 3)) if b_type == U8 else (
        np.zeros(n, b_type) if per_column else zero_point(b_type))
    return [a, f32(0.02), zero_point(a_type, 7 if a_type == U8 else -4), b, b_scale, b_zero]


@pytest.mark.parametrize("a_type,b_type", QGEMM_TYPES)
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("per_column", [False, True])
def test_qgemm_float_output(a_type, b_type, trans_a, trans_b, per_column):
    inputs = qgemm_inputs(a_type, b_type, trans_a, trans_b, per_column)
    c = RNG.integers(-3000, 3000, size=(1, 6)).astype(np.int32)
    ours, theirs = run_both("QGemm", inputs + [c], {"transA": trans_a, "transB": trans_b, "alpha": 0.75})
    assert_floats(ours[0], theirs[0], atol=1e-5)  # an exact integer sum rescaled: float32 rounding only


@pytest.mark.parametrize("a_type,b_type", QGEMM_TYPES)
@pytest.mark.parametrize("c_shape", [None, (6,), (5, 6)])
def test_qgemm_quantized_output(a_type, b_type, c_shape):
    inputs = qgemm_inputs(a_type, b_type, 0, 1, per_column=True)
    c = None if c_shape is None else RNG.integers(-5000, 5000, size=c_shape).astype(np.int32)
    # onnxruntime's kernels quantize Y to A's type.
    y = [f32(0.4), zero_point(a_type, 10 if a_type == U8 else -10)]
    ours, theirs = run_both("QGemm", inputs + [c] + y, {"transB": 1, "alpha": 2.0})
    assert_integers(ours[0], theirs[0], off_by_one=True)  # the requantization's float rounding: 1 off at a tie


def test_integer_products_are_exact_over_the_full_range():
    # Full-range uint8 x int8 (where onnxruntime's AVX2 kernels saturate) and a deep K: the sums are exact.
    a, b = quantized((6, 700), U8), quantized((700, 5), I8)
    a_zero, b_zero = zero_point(U8, 131), quantized((5,), I8)
    exact = (a.astype(np.int64) - 131) @ (b.astype(np.int64) - b_zero)
    (y,) = run_ours("QGemm", [a, f32(1.0), a_zero, b, f32(np.ones(5)), b_zero])
    np.testing.assert_array_equal(y, exact.astype(F32))
    (y,) = run_ours("MatMulIntegerToFloat", [a, b, f32(1.0), f32(1.0), a_zero, b_zero])
    np.testing.assert_array_equal(y, exact.astype(F32))


# -- MatMulIntegerToFloat, DynamicQuantizeMatMul ---------------------------------------------------

MITF_TYPES = [(U8, U8), (U8, I8), (I8, I8)]


@pytest.mark.parametrize("a_type,b_type", MITF_TYPES)
@pytest.mark.parametrize("a_shape,b_shape", [((4, 8), (8, 5)), ((2, 3, 8), (8, 5)), ((2, 3, 8), (2, 8, 5)),
                                             ((8,), (8, 5))])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("optional", [(True, True, True), (False, False, False), (False, True, True)])
@pytest.mark.parametrize("constant", [False, True])
def test_matmul_integer_to_float(a_type, b_type, a_shape, b_shape, per_column, optional, constant):
    # constant: B, its parameters and the bias are initializers (B packed once and kept).
    with_a_zero, with_b_zero, with_bias = optional
    a, b = operand_a(a_shape, a_type, b_type), quantized(b_shape, b_type)
    # Per column of each matrix of a batched B: (batch, 1, N), as onnxruntime takes them.
    columns = b_shape[:-2] + (1, 5) if len(b_shape) > 2 else (5,)
    b_scale = f32(RNG.uniform(0.01, 0.05, columns)) if per_column else f32(0.02)
    b_zero = (quantized(columns, b_type) if per_column else zero_point(b_type, 2)) if with_b_zero else None
    a_zero = zero_point(a_type, 9) if with_a_zero else None
    bias = f32(RNG.standard_normal(5)) if with_bias else None
    ours, theirs = run_both("MatMulIntegerToFloat", [a, b, f32(0.03), b_scale, a_zero, b_zero, bias],
                            constants=(1, 3, 5, 6) if constant else ())
    assert_floats(ours[0], theirs[0], atol=1e-5)


def test_matmul_integer_to_float_half_scales():
    a, b = operand_a((3, 16), U8, I8), quantized((16, 4), I8)
    inputs = [a, b, np.float16(0.01), np.float16(0.02), zero_point(U8, 5), zero_point(I8, 1), np.float16([1, 2, 3, 4])]
    ours, theirs = run_both("MatMulIntegerToFloat", [np.asarray(x) for x in inputs])
    assert_floats(ours[0], theirs[0], atol=1e-2, rtol=1e-3)  # one float16 rounding of the result


def test_matmul_integer_to_float_per_column_a_follows_the_spec():
    # onnxruntime only takes a per-tensor A scale; the spec allows one per column of A (per K), so the
    # expectation is the documented formula.
    a, b = quantized((3, 6), U8), quantized((6, 4), I8)
    a_scale, a_zero = f32(RNG.uniform(0.01, 0.1, 6)), quantized((6,), U8)
    (y,) = run_ours("MatMulIntegerToFloat", [a, b, a_scale, f32(0.5), a_zero, None])
    expected = ((a.astype(np.float64) - a_zero) * a_scale) @ (b.astype(np.float64) * 0.5)
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("b_type", EIGHT_BIT)
@pytest.mark.parametrize("a_shape,b_shape", [((4, 8), (8, 5)), ((2, 3, 8), (8, 5)), ((2, 3, 8), (2, 8, 5))])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("with_optional", [False, True])
def test_dynamic_quantize_matmul(b_type, a_shape, b_shape, per_column, with_optional):
    a = f32(RNG.standard_normal(a_shape))
    # A quantizes to the full uint8 range: int8 weights stay within 7 bits (onnxruntime's u8 x s8 kernels
    # saturate int16 pair sums, see operand_a).
    b = quantized(b_shape, b_type) if b_type == U8 else RNG.integers(-64, 64, size=b_shape).astype(I8)
    columns = b_shape[:-2] + (1, 5) if len(b_shape) > 2 else (5,)
    b_scale = f32(RNG.uniform(0.01, 0.05, columns)) if per_column else f32(0.02)
    b_zero = (RNG.integers(-64, 64, columns).astype(b_type) if b_type == I8 else quantized(columns, b_type)) if (
        per_column and with_optional) else (zero_point(b_type, 1) if with_optional else None)
    bias = f32(RNG.standard_normal(5)) if with_optional else None
    ours, theirs = run_both("DynamicQuantizeMatMul", [a, b, b_scale, b_zero, bias])
    # A is quantized the same way by both (DynamicQuantizeLinear); a value one step apart (a float tie) moves
    # the result by at most a_scale times a column of |B - zero point| * b_scale.
    a_scale = (max(a.max(), 0) - min(a.min(), 0)) / 255
    real_b = np.abs(b.astype(np.float64) - (0 if b_zero is None else b_zero)) * b_scale
    assert_floats(ours[0], theirs[0], atol=a_scale * real_b.max() + 1e-5)


def test_dynamic_quantize_matmul_all_zero_input():
    b = quantized((4, 3), I8)
    ours, theirs = run_both("DynamicQuantizeMatMul", [np.zeros((2, 4), F32), b, f32(0.1)])
    assert_floats(ours[0], theirs[0], atol=0)


# -- QuantizeLinear, DequantizeLinear (com.microsoft) ----------------------------------------------

Q_TYPES = [np.int8, np.uint8, np.int16, np.uint16]


@pytest.mark.parametrize("dtype", Q_TYPES)
@pytest.mark.parametrize("x_type", [F32, np.float16])
def test_contrib_quantize_linear_per_tensor(dtype, x_type):
    x = (RNG.standard_normal((3, 50)) * 400).astype(x_type)
    x[0, :4] = [0.5, 1.5, 2.5, -0.5]  # ties round to even
    ours, theirs = run_both("QuantizeLinear", [x, np.asarray(0.5, x_type), zero_point(dtype, 3)])
    assert_integers(ours[0], theirs[0])


@pytest.mark.parametrize("dtype", Q_TYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_contrib_quantize_dequantize_per_axis(dtype, axis):
    x = f32(RNG.standard_normal((3, 4, 5)) * 50)
    n = x.shape[axis]
    scale, zero = f32(RNG.uniform(0.1, 1, n)), quantized((n,), dtype)
    ours, theirs = run_both("QuantizeLinear", [x, scale, zero], {"axis": axis})
    assert_integers(ours[0], theirs[0])
    ours, theirs = run_both("DequantizeLinear", [theirs[0], scale, zero], {"axis": axis})
    assert_floats(ours[0], theirs[0], atol=0, rtol=0)


def test_contrib_quantize_linear_one_dimensional_parameters_without_axis():
    # The spec wants scalars without 'axis'; onnxruntime takes 1-D parameters along axis 1, as ONNX does.
    x = f32(RNG.standard_normal((2, 3, 4)) * 30)
    scale, zero = f32([0.5, 0.25, 1.5]), quantized((3,), I8)
    ours, theirs = run_both("QuantizeLinear", [x, scale, zero])
    assert_integers(ours[0], theirs[0])


def test_contrib_quantize_linear_defaults_to_uint8():
    x = f32(RNG.standard_normal((4, 5)) * 100)
    ours, theirs = run_both("QuantizeLinear", [x, f32(0.7)])
    assert_integers(ours[0], theirs[0])


@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.uint4])
def test_contrib_quantize_linear_int4(dtype):
    # onnxruntime's Python API has no int4 arrays: both read the result through a Cast to int8.
    x = f32(RNG.standard_normal((2, 9)) * 6)
    zero = np.array(1, dtype)
    ours, theirs = run_both("QuantizeLinear", [x, f32(0.5), zero], constants=(2,), after=("Cast", {"to": 3}))
    assert_integers(ours[0], theirs[0])


@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.uint4, np.int32, np.int16, np.uint16])
@pytest.mark.parametrize("scale_type", [F32, np.float16])
def test_contrib_dequantize_linear(dtype, scale_type):
    info = ml_dtypes.iinfo(np.dtype(dtype))
    lo, hi = max(int(info.min), -1000), min(int(info.max), 1000)
    x = RNG.integers(lo, hi + 1, size=(3, 7)).astype(dtype)
    zero = np.array(0 if dtype == np.int32 else 1, dtype)
    ours, theirs = run_both("DequantizeLinear", [x, np.asarray(0.25, scale_type), zero], constants=(0, 2))
    assert_floats(ours[0], theirs[0], atol=0, rtol=0)


# -- QAttention ------------------------------------------------------------------------------------


def qattention_inputs(w_type, per_column, batch=2, seq=4, hidden=8, heads=2, d=6):
    x = operand_a((batch, seq, d), U8, w_type)
    w = quantized((d, 3 * hidden), w_type)
    bias = f32(RNG.standard_normal(3 * hidden) * 0.1)
    w_scale = f32(RNG.uniform(0.005, 0.02, 3 * hidden)) if per_column else f32(0.01)
    w_zero = quantized((3 * hidden,), w_type) if per_column else zero_point(w_type, 2)
    return [x, w, bias, f32(0.02), w_scale], [zero_point(U8, 120), w_zero]


MASKS = {
    "none": None,
    "lengths": np.array([3, 4], np.int32),
    "end_start": np.array([4, 3, 1, 0], np.int32),
    "raw_2d": np.array([[1, 1, 0, 1], [1, 1, 1, 1]], np.int32),
    "raw_3d": (np.tril(np.ones((4, 4), np.int32))[None] * np.ones((2, 1, 1), np.int32)).astype(np.int32),
}


@pytest.mark.parametrize("w_type", EIGHT_BIT)
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_qattention_masks(w_type, per_column, mask):
    head, zeros = qattention_inputs(w_type, per_column)
    ours, theirs = run_both("QAttention", head + [MASKS[mask]] + zeros, {"num_heads": 2})
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)  # float32 attention in onnxruntime


@pytest.mark.parametrize("attrs", [{"unidirectional": 1}, {"scale": 0.3}, {"mask_filter_value": -50.0}])
def test_qattention_attributes(attrs):
    head, zeros = qattention_inputs(I8, True)
    mask = np.array([2, 4], np.int32)
    ours, theirs = run_both("QAttention", head + [mask] + zeros, {"num_heads": 2} | attrs)
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)


def test_qattention_scale_zero_is_the_default():
    # onnxruntime reads scale = 0 as "not given": 1 / sqrt(head size), as for com.microsoft Attention.
    head, zeros = qattention_inputs(I8, True)
    mask = np.array([2, 4], np.int32)
    ours, theirs = run_both("QAttention", head + [mask] + zeros, {"num_heads": 2, "scale": 0.0})
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)
    default, _ = run_both("QAttention", head + [mask] + zeros, {"num_heads": 2})
    assert_floats(ours[0], default[0], atol=0, rtol=0)


def test_qattention_unidirectional_with_a_raw_mask():
    head, zeros = qattention_inputs(U8, False)
    ours, theirs = run_both("QAttention", head + [MASKS["raw_2d"]] + zeros, {"num_heads": 2, "unidirectional": 1})
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("unidirectional", [0, 1])
@pytest.mark.parametrize("seq", [1, 3])
def test_qattention_past_and_present(unidirectional, seq):
    head, zeros = qattention_inputs(I8, False, seq=seq)
    past = f32(RNG.standard_normal((2, 2, 2, 5, 4)))
    ours, theirs = run_both("QAttention", head + [None] + zeros + [past],
                            {"num_heads": 2, "unidirectional": unidirectional}, n_outputs=2)
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)
    assert_floats(ours[1], theirs[1], atol=1e-5, rtol=1e-5)


def test_qattention_zero_points_omitted():
    head, _ = qattention_inputs(I8, False)
    ours, theirs = run_both("QAttention", head, {"num_heads": 2})
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)


# -- QEmbedLayerNormalization ----------------------------------------------------------------------


def qembed_inputs(dtype, with_segment, with_mask, batch=2, seq=5, hidden=8):
    def table(rows):
        return quantized((rows, hidden), dtype), f32(RNG.uniform(0.01, 0.05)), zero_point(dtype, 3)

    words, positions, segments = table(20), table(seq + 2), table(2)
    gamma = (quantized((hidden,), dtype), f32(0.02), zero_point(dtype, 1))
    beta = (quantized((hidden,), dtype), f32(0.01), zero_point(dtype, 2))
    ids = RNG.integers(0, 20, size=(batch, seq)).astype(np.int32)
    segment_ids = RNG.integers(0, 2, size=(batch, seq)).astype(np.int32) if with_segment else None
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], np.int32) if with_mask else None
    seg = segments if with_segment else (None, None, None)
    return [ids, segment_ids, words[0], positions[0], seg[0], gamma[0], beta[0], mask,
            words[1], positions[1], seg[1], gamma[1], beta[1], words[2], positions[2], seg[2], gamma[2], beta[2]]


@pytest.mark.parametrize("dtype", EIGHT_BIT)
@pytest.mark.parametrize("with_segment", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_qembed_layer_normalization(dtype, with_segment, with_mask):
    inputs = qembed_inputs(dtype, with_segment, with_mask)
    ours, theirs = run_both("QEmbedLayerNormalization", inputs, {"epsilon": 1e-5}, n_outputs=2)
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)
    assert_integers(ours[1], theirs[1])


def test_qembed_mask_index_counts_ones_only():
    # Entries other than 0 and 1 are not words: onnxruntime counts mask == 1, as EmbedLayerNormalization does.
    inputs = qembed_inputs(I8, True, True)
    inputs[7] = np.array([[1, 2, 1, 0, 0], [1, 0, -1, 1, 1]], np.int32)
    ours, theirs = run_both("QEmbedLayerNormalization", inputs, {"epsilon": 1e-5}, n_outputs=2)
    assert_integers(ours[1], theirs[1])
    assert_integers(ours[1], np.array([2, 3], np.int32))


# -- bad inputs ------------------------------------------------------------------------------------


BAD = [
    ("QLinearAdd", lambda: [quantized((2, 3), U8), f32(0.1), None, quantized((2, 3), I8), f32(0.1), None, f32(0.1)],
     {}, "must have one type"),
    ("QLinearAdd", lambda: [quantized((2, 3), U8), f32([0.1, 0.2]), None, quantized((2, 3), U8), f32(0.1), None,
                            f32(0.1)], {}, "expected a scalar"),
    ("QLinearMul", lambda: [quantized((2, 3), U8), f32(0.1), None, quantized((4,), U8), f32(0.1), None, f32(0.1)],
     {}, "do not broadcast"),
    ("QLinearSigmoid", lambda: [np.ones((2,), np.int16), f32(0.1), None, f32(0.1)], {}, "expected uint8 or int8"),
    ("QLinearConcat", lambda: [f32(0.1), zero_point(U8), quantized((2, 3), U8), f32(0.1)], {"axis": 0},
     "triples"),
    ("QLinearConcat", lambda: [f32(0.1), zero_point(U8), quantized((2, 3), U8), f32(0.1), zero_point(U8),
                               quantized((2, 4), U8), f32(0.1), zero_point(U8)], {"axis": 0}, "outside axis"),
    ("QGemm", lambda: [quantized((2, 3), U8), f32(0.1), zero_point(U8), quantized((4, 2), U8), f32(0.1),
                       zero_point(U8)], {}, "inner dimensions"),
    ("QGemm", lambda: [quantized((2, 3), U8), f32(0.1), zero_point(U8), quantized((3, 2), U8), f32([0.1, 0.2, 0.3]),
                       zero_point(U8)], {}, "expected a scalar or \\(2,\\)"),
    ("MatMulIntegerToFloat", lambda: [quantized((2, 3), U8), quantized((3, 4), I8), f32(0.1), f32(0.1), None, None,
                                      f32([1, 2])], {}, "bias"),
    ("DynamicQuantizeMatMul", lambda: [np.ones((2, 3), np.float64), quantized((3, 4), I8), f32(0.1)], {},
     "must be float32"),
    ("QuantizeLinear", lambda: [f32(np.ones((2, 3))), f32([0.1, 0.2]), zero_point(U8)], {"axis": 1},
     "expected \\(3,\\)"),
    ("DequantizeLinear", lambda: [np.ones((2, 3), np.int64), f32(0.1)], {}, "expected int8"),
    ("QAttention", lambda: [quantized((1, 2, 4), U8), quantized((5, 24), I8), f32(np.zeros(24)), f32(0.1), f32(0.1)],
     {"num_heads": 2}, "do not fit"),
    ("QAttention", lambda: [quantized((2, 2, 4), U8), quantized((4, 24), I8), f32(np.zeros(24)), f32(0.1), f32(0.1),
                            np.array([1, 2, 3], np.int32)], {"num_heads": 2}, "mask_index has shape"),
]


@pytest.mark.parametrize("op,inputs,attrs,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_raise_typed_errors_naming_the_node(op, inputs, attrs, message):
    with pytest.raises(InvalidArgumentError, match=message) as info:
        run_ours(op, inputs(), attrs)
    assert "'n'" in str(info.value) and op in str(info.value)


@pytest.mark.parametrize("op,attrs,inputs", [
    ("QLinearSoftmax", {}, lambda: [quantized((2, 3), U8), f32(0.1), None, f32(0.1), zero_point(U8)]),
    ("QLinearConcat", {}, lambda: [f32(0.1), zero_point(U8), quantized((2, 3), U8), f32(0.1), zero_point(U8)]),
    ("QAttention", {}, lambda: [quantized((1, 2, 4), U8), quantized((4, 24), I8), f32(np.zeros(24)), f32(0.1),
                                f32(0.1)]),
    ("QLinearGlobalAveragePool", {"channels_last": 2},
     lambda: [quantized((1, 2, 3, 3), U8), f32(0.1), None, f32(0.1), None]),
])
def test_bad_attributes_raise_graph_errors(op, attrs, inputs):
    with pytest.raises(OnnxRuntimeError, match="attribute") as info:
        run_ours(op, inputs(), attrs)
    assert isinstance(info.value, InvalidGraphError) or isinstance(info.value.__cause__, InvalidGraphError)
    assert "'n'" in str(info.value)


@pytest.mark.parametrize("quantized_output", [False, True])
@pytest.mark.parametrize("c_shape", [None, (1,), (6,), (1, 6)])
def test_qgemm_compiled_path_matches_the_general_one(quantized_output, c_shape):
    # transA = 0 runs in one compiled pass, transA = 1 through the exact general path: the same codes and
    # the same float32 values, bit for bit, including C wrapping in the int32 accumulator.
    inputs = qgemm_inputs(U8, I8, 0, 1, per_column=True)
    c = None if c_shape is None else RNG.integers(-2**31, 2**31 - 1, size=c_shape, dtype=np.int64).astype(np.int32)
    y = [f32(0.4), zero_point(U8, 10)] if quantized_output else []
    (fast,) = run_ours("QGemm", inputs + [c] + y, {"transB": 1, "alpha": 0.75})
    (general,) = run_ours("QGemm", [inputs[0].T.copy()] + inputs[1:] + [c] + y,
                          {"transA": 1, "transB": 1, "alpha": 0.75})
    np.testing.assert_array_equal(fast, general)
