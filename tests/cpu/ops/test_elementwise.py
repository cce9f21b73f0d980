"""Elementwise kernels (arithmetic, math, activations without attributes, comparison, logic, bitwise,
Clip, variadic ops, Where, Cast) against onnx's reference evaluator: opsets, broadcasting, dtypes, empties."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from kernel_reference import check, f32, i32, i64, make_kernel, rng, run_kernel, run_reference
from onnx import TensorProto
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.ops import elementwise

# -- elementwise --------------------------------------------------------------------------------------

UNARY_DOMAINS = {
    "Sqrt": (0.01, 5),
    "Log": (0.01, 5),
    "Reciprocal": (0.5, 5),
    "Asin": (-0.99, 0.99),
    "Acos": (-0.99, 0.99),
    "Atanh": (-0.99, 0.99),
    "Acosh": (1.01, 5),
}
UNARY_OPS = [
    "Neg", "Abs", "Sqrt", "Exp", "Log", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Tanh", "Sigmoid",
    "Softplus", "Softsign", "Mish", "HardSwish", "Erf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh",
    "Cosh", "Asinh", "Acosh", "Atanh", "Relu", "Identity", "IsNaN",
]  # fmt: skip


@pytest.mark.parametrize("op", UNARY_OPS)
def test_unary_float(op):
    x = f32(3, 4, low=UNARY_DOMAINS.get(op, (-4, 4))[0], high=UNARY_DOMAINS.get(op, (-4, 4))[1])
    check(op, [x])
    check(op, [x.astype(np.float64)])
    check(op, [np.zeros((0, 3), np.float32)])


def test_round_is_half_to_even():
    check("Round", [np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.6], np.float32)], opset=11)


def test_erf_accuracy_across_ranges():
    x = np.concatenate([np.linspace(-6, 6, 2001), [0, 1e-8, -1e-4, 0.49999, 0.5, np.inf, -np.inf, np.nan]])
    check("Erf", [x.astype(np.float32)], opset=13)
    check("Erf", [x], opset=13)
    (half,) = run_kernel("Erf", [x.astype(np.float16)], opset=13)
    assert half.dtype == np.float16


def test_integer_unary_keep_dtype():
    x = np.array([-128, -3, 0, 5, 127], np.int8)
    for op in ("Neg", "Abs", "Sign"):
        check(op, [x], opset=13)
    check("Relu", [x], opset=14)
    check("Not", [np.array([True, False])], opset=1)
    check("BitwiseNot", [np.array([0, 5, 255], np.uint8)], opset=18)


@pytest.mark.parametrize(
    "op, attrs",
    [
        ("LeakyRelu", {}),
        ("LeakyRelu", {"alpha": 0.3}),
        ("Elu", {"alpha": 0.7}),
        ("Selu", {}),
        ("Selu", {"alpha": 2.0, "gamma": 3.0}),
        ("Celu", {"alpha": 1.5}),
        ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
        ("ThresholdedRelu", {"alpha": 0.5}),
    ],
)
def test_activations_with_attributes(op, attrs):
    actual = check(op, [f32(2, 5)], attrs)
    assert actual[0].dtype == np.float32


def test_prelu_broadcasts_slope():
    check("PRelu", [f32(2, 3, 4), f32(3, 1)], opset=16)
    check("PRelu", [f32(2, 3, 4), f32(4)], opset=9)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("opset", [7, 14])
def test_arithmetic_broadcasting(op, opset):
    check(op, [f32(2, 3, 4), f32(3, 1)], opset=opset)
    b = i32(4)
    b[b == 0] = 3
    check(op, [i32(2, 3, 4), b], opset=opset)
    check(op, [np.zeros((0, 4), np.float32), f32(4)], opset=opset)


def test_integer_div_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 6, -1], np.int64)
    b = np.array([2, 2, -2, -2, 3, 5], np.int64)
    (y,) = check("Div", [a, b], opset=14)
    np.testing.assert_array_equal(y, [3, -3, -3, 3, 2, 0])
    check("Div", [a.astype(np.uint8) % 8, np.full(6, 3, np.uint8)], opset=14)


def test_legacy_broadcast_with_axis():
    a, b = f32(2, 3, 4), f32(3)
    (y,) = run_kernel("Add", [a, b], {"broadcast": 1, "axis": 1}, opset=6)
    np.testing.assert_array_equal(y, a + b[:, None])
    (y,) = run_kernel("Mul", [a, f32(4)], {"broadcast": 1}, opset=6)
    assert y.shape == a.shape


def test_pow_keeps_base_dtype():
    check("Pow", [f32(3, 4, low=0.1, high=3), f32(4, low=-2, high=2)], opset=15)
    check("Pow", [f32(3, 4, low=0.1, high=3), i64([1, 2, 3, 0])], opset=15)
    check("Pow", [i32(3, 4, low=1, high=5), np.array([0, 1, 2, 3], np.int32)], opset=15)
    (y,) = run_kernel("Pow", [np.array([2, 1, -1, 4], np.int64), i64([-1, -3, -3, 1])], opset=15)
    np.testing.assert_array_equal(y, [0, 1, -1, 4])


@pytest.mark.parametrize("fmod", [0, 1])
def test_mod(fmod):
    a, b = i32(4, 5), i32(5, low=1, high=6) * np.array([1, -1, 1, -1, 1], np.int32)
    check("Mod", [a, b], {"fmod": fmod}, opset=13)
    check("Mod", [f32(4, 5), f32(5, low=0.5, high=2)], {"fmod": 1}, opset=13)


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
def test_comparisons(op):
    check(op, [i32(3, 4, low=0, high=3), i32(4, low=0, high=3)], opset=16)
    check(op, [f32(3, 4), f32(3, 1)], opset=16)


def test_equal_on_strings():
    a = np.array(["a", "b", "c"], dtype=object)
    check("Equal", [a, np.array(["a", "x", "c"], dtype=object)], opset=19)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op):
    check(op, [rng.random((3, 4)) > 0.5, rng.random(4) > 0.5], opset=7)


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
def test_bitwise(op):
    check(op, [i32(3, 4, low=-100, high=100), i32(4, low=-100, high=100)], opset=18)
    check(op, [np.array([1, 200], np.uint8), np.array([3, 7], np.uint8)], opset=18)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bit_shift(direction):
    x = np.array([1, 4, 255, 16], np.uint8)
    check("BitShift", [x, np.array([1, 2, 3, 7], np.uint8)], {"direction": direction}, opset=11)
    check("BitShift", [x.astype(np.uint64), np.array([1], np.uint64)], {"direction": direction}, opset=11)


def test_bit_shift_rejects_bad_direction():
    with pytest.raises(InvalidGraphError, match="direction"):
        make_kernel("BitShift", [i32(2), i32(2)], {"direction": "UP"}, opset=11)


def test_where_broadcasts():
    check("Where", [rng.random((3, 1)) > 0.5, f32(3, 4), f32(4)], opset=16)
    check("Where", [np.array([True, False]), np.array(["a", "b"], object), np.array(["c", "d"], object)])


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic(op):
    check(op, [f32(3, 4), f32(4), f32(3, 1)], opset=13)
    check(op, [f32(2, 2)], opset=13)
    if op != "Mean":
        check(op, [i32(3, 4), i32(4)], opset=13)


def test_min_max_propagate_nan():
    a = np.array([1.0, np.nan, 3.0], np.float32)
    check("Max", [a, np.array([2.0, 2.0, np.nan], np.float32)], opset=13)


def test_clip_versions():
    x = f32(3, 4)
    check("Clip", [x], {"min": -1.0, "max": 0.5}, opset=6)
    check("Clip", [x], {}, opset=6)
    check("Clip", [x, np.array(-1, np.float32), np.array(1, np.float32)], opset=11)
    check("Clip", [x, None, np.array(0.2, np.float32)], opset=13)
    check("Clip", [x, np.array(0.2, np.float32)], opset=13)
    check("Clip", [i32(5), np.array(-2, np.int32), np.array(3, np.int32)], opset=13)
    (y,) = check("Clip", [x, np.array(2, np.float32), np.array(1, np.float32)], opset=13)
    assert (y == 1).all()  # min > max gives max everywhere


def test_is_inf_and_is_nan():
    x = np.array([np.inf, -np.inf, np.nan, 0.0, 1.0], np.float32)
    for pos in (0, 1):
        for neg in (0, 1):
            check("IsInf", [x], {"detect_positive": pos, "detect_negative": neg}, opset=10)
    check("IsNaN", [x], opset=13)


CAST_TARGETS = [
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
    TensorProto.INT8,
    TensorProto.UINT8,
    TensorProto.INT32,
    TensorProto.INT64,
    TensorProto.BOOL,
    TensorProto.STRING,
]


@pytest.mark.parametrize("to", CAST_TARGETS)
def test_cast_numeric(to):
    check("Cast", [np.array([-2.75, -1, 0, 0.5, 1.5, 100], np.float32)], {"to": to}, opset=13)
    check("Cast", [np.array([-3, 0, 1, 7], np.int32)], {"to": to}, opset=13)
    check("Cast", [np.array([True, False])], {"to": to}, opset=13)


def test_cast_from_strings():
    s = np.array(["1.5", "-2", "1e-5", "INF", "-inf", "NaN"], dtype=object)
    check("Cast", [s], {"to": TensorProto.FLOAT}, opset=13)
    check("Cast", [s], {"to": TensorProto.DOUBLE}, opset=13)
    (y,) = run_kernel("Cast", [np.array(["12", "-3", "9000000000"], dtype=object)], {"to": TensorProto.INT64})
    np.testing.assert_array_equal(y, [12, -3, 9000000000])


def test_cast_v1_takes_a_type_name():
    (y,) = run_kernel("Cast", [i32(4)], {"to": "FLOAT"}, opset=1)
    assert y.dtype == np.float32


@pytest.mark.parametrize(
    "to", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ]
)
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_float8(to, saturate):
    x = np.array([0.0, 0.3, -1.7, 300.0, 1e6, -1e6, 60000.0], np.float32)
    actual = run_kernel("Cast", [x], {"to": to, "saturate": saturate}, opset=19)[0]
    expected = run_reference("Cast", [x], {"to": to, "saturate": saturate}, opset=19)[0]
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
def test_cast_float8e8m0(round_mode):
    x = np.array([1.0, 1.5, 3.0, 0.3, 1e30, 2.0**-120], np.float32)
    actual = run_kernel("Cast", [x], {"to": TensorProto.FLOAT8E8M0, "round_mode": round_mode}, opset=24)[0]
    expected = run_reference("Cast", [x], {"to": TensorProto.FLOAT8E8M0, "round_mode": round_mode}, opset=24)[0]
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


def test_cast_int4_and_cast_like():
    check("Cast", [np.array([-8, -1, 0, 7], np.int32)], {"to": TensorProto.INT4}, opset=21)
    check("CastLike", [f32(3), np.zeros(1, np.int64)], opset=15)
    check("CastLike", [f32(3), np.zeros(1, np.float16)], opset=19)
    check("CastLike", [np.array([1.5, 1e6], np.float32), np.zeros(1, ml_dtypes.float8_e4m3fn)], opset=19)


@pytest.mark.parametrize("op", sorted(elementwise.NEVER_WARN - {"Not", "BitwiseNot"}))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_unary_ops_run_without_errstate_never_warn(op, dtype):
    # These kernels skip np.errstate (its cost exceeds theirs on small tensors): they must not raise
    # a floating-point error for any value, even with every numpy warning turned into an error.
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e4, -1e4, 6e4, 1e-8, 2.5, -2.5]).astype(dtype)
    kernel = make_kernel(op, [x], opset=20)
    with np.errstate(all="raise"):
        (y,) = kernel(x)
    assert y.shape == x.shape
