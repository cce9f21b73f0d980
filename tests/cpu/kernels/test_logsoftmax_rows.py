"""LogSoftmax's compiled rows (compiled/log_softmax.py) and their numpy twin (compiled/generic.py) against a float64
reference: rows of one to a thousand classes, -inf, +inf, NaN and huge entries, every axis and both opset rules
(the input coerced to 2-D before opset 13, one axis from 13), through the op's kernel as a session runs it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.compiled import generic
from onnx_runtime_ep_cpu.compiled import log_softmax as compiled_log_softmax
from onnx_runtime_ep_cpu.registry import lookup

F32 = np.float32
KEY = "onnx_runtime_ep_cpu.compiled.log_softmax.log_softmax_rows_float32_"


def _exact(rows: np.ndarray) -> np.ndarray:
    """The float64 formula over 2-D rows; NaN wherever the row has a NaN, +inf, or no finite value."""
    x = rows.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        shifted = x - x.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _hard_rows(width: int, seed: int) -> np.ndarray:
    """Random rows plus the awkward ones: -inf entries, a row all -inf, +inf, NaN, huge and tiny magnitudes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((9, width)) * 6).astype(F32)
    x[1, ::2] = -np.inf  # masked entries: -inf out, the rest as if absent (a row of width 1: all -inf)
    x[2] = -np.inf
    x[3, -1] = np.inf
    x[4, 0] = np.nan
    x[5] *= F32(1e36)  # shifts far below exp's range (yet within float32's): those entries are x - peak exactly
    x[6] = F32(3e38)  # equal huge entries: -log(width) each
    x[7] *= F32(1e-30)
    x[8, -1] = F32(-1e4)
    return x


def _check(y: np.ndarray, rows: np.ndarray) -> None:
    exact = _exact(rows)
    assert y.dtype == F32 and y.shape == rows.shape
    assert np.array_equal(np.isnan(y), np.isnan(exact))
    np.testing.assert_allclose(y, exact, rtol=2e-6, atol=3e-6)


@pytest.mark.parametrize("width", [1, 2, 7, 30, 96, 1000])
@pytest.mark.parametrize("path", ["compiled", "numpy twin"])
def test_rows_against_float64(width, path):
    loop = compiled_log_softmax.log_softmax_rows_float32_ if path == "compiled" else generic.GENERIC[KEY]
    x = _hard_rows(width, seed=width)
    before = x.copy()
    y = np.full(x.shape, 7, F32)
    assert loop(x, y) is None
    np.testing.assert_array_equal(x, before)
    _check(y, x)


@pytest.mark.parametrize("path", ["compiled", "numpy twin"])
@pytest.mark.parametrize("opset,shape,axis", [
    (13, (1, 30), -1), (13, (1, 1, 30), 2), (13, (5, 1), -1), (13, (3, 4, 1000), -1),
    (13, (2, 3, 4), 0), (13, (2, 3, 4), 1), (13, (2, 3, 4), -2),  # other axes: numpy's formula
    (11, (2, 3, 4), 1), (11, (2, 3, 4), 0), (11, (2, 3, 4), -1), (1, (4, 30), 1), (1, (1, 1000, 1, 1), 1),
])
def test_op_every_axis(monkeypatch, path, opset, shape, axis):
    calls = []
    loop = compiled_log_softmax.log_softmax_rows_float32_ if path == "compiled" else generic.GENERIC[KEY]
    monkeypatch.setattr(compiled_log_softmax, "log_softmax_rows_float32_",
                        lambda a, b: calls.append(a.shape) or loop(a, b))
    rng = np.random.default_rng(len(shape) * 100 + axis)
    x = (rng.standard_normal(shape) * 8).astype(F32)
    x.reshape(-1)[0] = -np.inf
    x.reshape(-1)[-1] = F32(1e30)
    node = Node("LogSoftmax", ["x"], ["y"], attrs={"axis": axis}, opset=opset)
    (y,) = lookup("LogSoftmax", "", opset)(node, [x.shape], opset)(x)
    a = axis % x.ndim
    if opset < 13:
        rows = x.reshape(math.prod(x.shape[:a]), -1)
        _check(y.reshape(rows.shape), rows)
    else:
        moved = np.moveaxis(x, a, -1)
        _check(np.moveaxis(y, a, -1).reshape(-1, x.shape[a]), moved.reshape(-1, x.shape[a]))
    assert bool(calls) == (opset < 13 or a == x.ndim - 1)  # the rows serve every contiguous case they can


def test_float16_and_float64_keep_numpy():
    node = Node("LogSoftmax", ["x"], ["y"], attrs={}, opset=13)
    for dtype in (np.float16, np.float64):
        x = np.random.default_rng(3).standard_normal((3, 17)).astype(dtype)
        (y,) = lookup("LogSoftmax", "", 13)(node, [x.shape], 13)(x)
        assert y.dtype == dtype
        np.testing.assert_allclose(y, _exact(x), rtol=2e-3 if dtype == np.float16 else 1e-12, atol=2e-3)
