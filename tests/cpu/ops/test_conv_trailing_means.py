"""ReduceMean and ReduceSum over a tensor's trailing axes (a squeeze-and-excitation block's pooling, as the
dynamo exporter writes GlobalAveragePool): one sum per leading index by the plane loop (rows up to its
PLANE_SUM_LIMIT) or numpy's pairwise sum over the 2-D view (longer rows), against float64 sums, for every
spelling of the axes; other axes, dtypes and layouts keep the general reduction, checked against onnx's
reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_reference import check, i64, make_kernel
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.compiled import pooling

RNG = np.random.default_rng(11)


def _expected(x, axes, keepdims, mean):
    total = x.astype(np.float64).sum(axis=axes, keepdims=keepdims)
    return total / np.prod([x.shape[a] for a in axes]) if mean else total


@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum"])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,axes", [
    ((2, 24, 5, 7), [2, 3]), ((2, 24, 5, 7), [-1, -2]), ((1, 96, 4, 4), [3, -2]), ((3, 10, 64), [-1]),
    ((2, 3, 4, 5), [1, 2, 3]),
    ((1, 3, 80, 80), [2, 3]),  # rows past the plane loop's limit: numpy's pairwise sum
])  # fmt: skip
def test_trailing_axes_against_float64(op, keepdims, dtype, shape, axes):
    x = (RNG.standard_normal(shape) + 0.5).astype(dtype)
    opset = 18 if op == "ReduceMean" else 13
    kernel = make_kernel(op, [x, i64(axes)], {"keepdims": keepdims}, opset)
    (y,) = kernel(x, i64(axes))
    (again,) = kernel(x, i64(axes))  # the plan kept for this signature
    normalized = tuple(sorted(a % len(shape) for a in axes))
    expected = _expected(x, normalized, bool(keepdims), op == "ReduceMean")
    assert y.dtype == dtype and y.shape == expected.shape
    scale = _expected(np.abs(x), normalized, bool(keepdims), op == "ReduceMean")
    eps = np.finfo(dtype).eps
    assert np.all(np.abs(y - expected) <= 16 * eps * scale * np.log2(x.size))
    np.testing.assert_array_equal(again, y)
    # the attribute form (before opset 18/13) gives the same
    (by_attribute,) = make_kernel(op, [x], {"keepdims": keepdims, "axes": axes}, 11)(x)
    np.testing.assert_array_equal(by_attribute, y)


def test_short_rows_take_the_plane_loop(monkeypatch):
    calls = []
    real = pooling.plane_means
    monkeypatch.setattr(pooling, "plane_means", lambda *args: calls.append(args[0].shape) or real(*args))
    x = RNG.standard_normal((2, 16, 6, 6)).astype(np.float32)
    check("ReduceMean", [x, i64([2, 3])], opset=18)
    assert calls == [(32, 36)]


@pytest.mark.parametrize("case", ["middle axes", "float16", "transposed", "empty", "noop", "all axes"])
def test_other_reductions_keep_the_general_path(case):
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    axes, attrs = [2, 3], {}
    if case == "middle axes":
        axes = [1, 2]
    elif case == "float16":
        x = x.astype(np.float16)
    elif case == "transposed":
        x = x.transpose(0, 1, 3, 2)
    elif case == "empty":
        x = x[:, :, :0]
    elif case == "noop":
        axes, attrs = [], {"noop_with_empty_axes": 1}
    elif case == "all axes":
        axes = [0, 1, 2, 3]
    for op in ("ReduceMean", "ReduceSum"):
        check(op, [x, i64(axes)], attrs, opset=18)
