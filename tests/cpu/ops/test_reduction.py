"""Reductions against onnx's reference evaluator: axes as attribute or input, keepdims, empty sets."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_reference import check, f32, i32, i64, run_kernel
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)

# -- reduction ----------------------------------------------------------------------------------------

REDUCE_OPS = [
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
]  # fmt: skip


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_axes_attribute(op, keepdims):
    x = f32(2, 3, 4, low=0.1, high=2)
    for axes in (None, [1], [0, -1]):
        attrs = {"keepdims": keepdims} | ({} if axes is None else {"axes": axes})
        check(op, [x], attrs, opset=11)
        check(op, [x.astype(np.float64)], attrs, opset=11)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_input(op):
    x = f32(2, 3, 4, low=0.1, high=2)
    opset = 18
    check(op, [x, i64([1])], opset=opset)
    check(op, [x, i64([-1, 0])], {"keepdims": 0}, opset=opset)
    check(op, [x], opset=opset)
    check(op, [x, i64([])], opset=opset)
    (y,) = check(op, [x, i64([])], {"noop_with_empty_axes": 1}, opset=opset)
    assert y.shape == x.shape


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceMean"])
def test_reduce_integers_keep_dtype(op):
    x = i32(3, 4, low=-3, high=4)
    (y,) = check(op, [x], {"axes": [1]}, opset=11)
    assert y.dtype == np.int32


def test_reduce_sum_versions_and_empty():
    x = f32(2, 3)
    check("ReduceSum", [x, i64([1])], opset=13)
    check("ReduceSum", [x], {"axes": [1]}, opset=11)
    empty = np.zeros((0, 3), np.float32)
    for op in ("ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin", "ReduceLogSumExp", "ReduceL2"):
        check(op, [empty, i64([0])], opset=18)
    check("ReduceMax", [np.array([[True, False], [False, False]]), i64([1])], opset=20)


def test_reduce_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf]], np.float32)
    (y,) = run_kernel("ReduceLogSumExp", [x, i64([1])], opset=18)
    np.testing.assert_allclose(y[:, 0], [1000 + np.log(2), -np.inf])


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("select_last_index", [0, 1])
def test_arg_max_min(op, select_last_index):
    x = np.array([[3, 1, 3, 1], [2, 2, 0, 0]], np.int32)
    for axis in (0, 1, -1):
        for keepdims in (0, 1):
            attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": select_last_index}
            check(op, [x], attrs, opset=13)
    check(op, [f32(3, 4)], {}, opset=1)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cum_sum(exclusive, reverse):
    attrs = {"exclusive": exclusive, "reverse": reverse}
    check("CumSum", [f32(3, 4), np.array(1, np.int32)], attrs, opset=14)
    check("CumSum", [i32(3, 4), i64(-2)], attrs, opset=14)
    check("CumSum", [i32(5), i64(0)], attrs, opset=11)
