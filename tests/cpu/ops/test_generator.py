"""Generators (constants, ranges, eye-likes, random ops) against onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_reference import check, f32, i32, i64, make_kernel, run_kernel
from onnx import TensorProto
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)

# -- generators ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [
        {"value": np.arange(6, dtype=np.float32).reshape(2, 3)},
        {"value": np.array(["a", "bc"], dtype=object)},
        {"value_float": 1.5},
        {"value_floats": [1.0, 2.5]},
        {"value_int": 7},
        {"value_ints": [1, -2, 3]},
        {"value_string": "hello"},
        {"value_strings": ["x", "yz"]},
    ],
)
def test_constant(attrs):
    check("Constant", [], attrs, opset=13)


def test_constant_needs_exactly_one_value():
    with pytest.raises(InvalidGraphError, match="Constant"):
        make_kernel("Constant", [], {"value_int": 1, "value_float": 2.0}, opset=13)


def test_constant_of_shape():
    check("ConstantOfShape", [i64([2, 3])], opset=9)
    check("ConstantOfShape", [i64([2, 0])], opset=9)
    check("ConstantOfShape", [i64([])], {"value": np.array([4], np.int32)}, opset=9)
    check("ConstantOfShape", [i64([3])], {"value": np.array([True])}, opset=20)


def test_range():
    check("Range", [np.array(3, np.int64), np.array(9, np.int64), np.array(3, np.int64)], opset=11)
    check("Range", [np.array(10, np.int32), np.array(4, np.int32), np.array(-2, np.int32)], opset=11)
    check("Range", [np.array(1, np.int32), np.array(1, np.int32), np.array(2, np.int32)], opset=11)
    check("Range", [np.array(0.5, np.float32), np.array(3.2, np.float32), np.array(0.3, np.float32)], opset=11)
    check("Range", [np.array(5, np.float64), np.array(-1, np.float64), np.array(-1.5, np.float64)], opset=11)
    # stash_type=1 computes a float16 range in float32, rounding each element once.
    (y,) = run_kernel("Range", [np.array(v, np.float16) for v in (0.1, 40, 0.1)], opset=27)
    steps = np.arange(y.size, dtype=np.float32)
    np.testing.assert_array_equal(y, (np.float32(np.float16(0.1)) * (steps + 1)).astype(np.float16))


def test_eye_like():
    check("EyeLike", [f32(3, 4)], opset=9)
    check("EyeLike", [f32(4, 3)], {"k": -1, "dtype": TensorProto.INT32}, opset=9)
    check("EyeLike", [i32(3, 3)], {"k": 2}, opset=9)


@pytest.mark.parametrize("op", ["RandomUniform", "RandomNormal"])
def test_random(op):
    attrs = {"shape": [200, 3], "seed": 5.0, "dtype": TensorProto.DOUBLE}
    if op == "RandomUniform":
        attrs |= {"low": 2.0, "high": 3.0}
    first = run_kernel(op, [], attrs, opset=1)[0]
    again = run_kernel(op, [], attrs, opset=1)[0]
    assert first.shape == (200, 3) and first.dtype == np.float64
    np.testing.assert_array_equal(first, again)  # same seed, same values
    if op == "RandomUniform":
        assert ((first >= 2) & (first < 3)).all()
    (like,) = run_kernel(op + "Like", [np.zeros((2, 5), np.float16)], {}, opset=1)
    assert like.shape == (2, 5) and like.dtype == np.float16


def test_bernoulli():
    p = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    (y,) = run_kernel("Bernoulli", [p], {"seed": 1.0}, opset=15)
    np.testing.assert_array_equal(y, p)
    (y,) = run_kernel("Bernoulli", [p], {"dtype": TensorProto.INT64}, opset=15)
    assert y.dtype == np.int64
