"""Flatten and the softmax family (Softmax, LogSoftmax, Hardmax) against onnx's reference evaluator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from node_reference import F16, F32, RNG, check, rand, reference
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.registry import lookup

# -- Flatten and the softmax family --------------------------------------------------------------


@pytest.mark.parametrize("opset,axis", [(1, 0), (1, 1), (9, 2), (11, -1), (13, 4), (21, -3)])
def test_flatten(opset, axis):
    check("Flatten", [rand(2, 3, 4, 5)], {"axis": axis}, opset)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@pytest.mark.parametrize("opset,attrs", [(1, {}), (11, {"axis": 2}), (11, {"axis": -1}), (13, {}),
                                         (13, {"axis": 0}), (13, {"axis": 1})])
def test_softmax_family(op, opset, attrs):
    x = rand(2, 3, 4, low=-5, high=5)
    expected = None
    if opset < 13:
        # Before opset 13 the input is coerced to 2-D at axis; the reference ignores that, so the
        # oracle is opset 13's reference over the coerced matrix.
        axis = attrs.get("axis", 1) % x.ndim
        flat = x.reshape(math.prod(x.shape[:axis]), -1)
        expected = [reference(op, [flat], {"axis": 1}, 13)[0].reshape(x.shape)]
    check(op, [x], attrs, opset, expected=expected)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax_family_half_and_ties(op):
    check(op, [rand(3, 5, dtype=F16, low=-3, high=3)], {}, 13)
    x = np.array([[1, 3, 3, 0], [2, 2, 2, 2]], F32)  # Hardmax marks the first maximum
    check(op, [x], {"axis": 1}, 11)


@pytest.mark.parametrize("opset,shape", [(13, (2, 1000)), (13, (3, 4, 7)), (11, (1, 1000, 1, 1)), (13, (5, 1))])
def test_small_float32_softmax_runs_one_compiled_call(monkeypatch, opset, shape):
    """A CNN's closing Softmax: one compiled pass per row (the largest non-NaN value, the vectorized exp and
    the sum, the scaling) within float32 rounding of the exact formula; NaN and infinities as numpy's."""
    from onnx_runtime_ep_cpu.compiled import transformer

    calls = []
    real = transformer.softmax_rows_float32_
    monkeypatch.setattr(transformer, "softmax_rows_float32_", lambda x, y: calls.append(x.shape) or real(x, y))
    x = (RNG.standard_normal(shape) * 6).astype(F32)
    flat = x.reshape(-1, x.shape[-1]) if opset >= 13 else x.reshape(x.shape[0], -1)
    flat[0, :3] = [np.nan, 1.0, 2.0][: flat.shape[1]]
    if flat.shape[0] > 2:
        flat[1] = -np.inf
        flat[2, 0] = np.inf
    node = Node("Softmax", ["x"], ["y"], attrs={}, opset=opset)
    (y,) = lookup("Softmax", "", opset)(node, [x.shape], opset)(x)
    with np.errstate(invalid="ignore"):  # (inf - inf: NaN rows, as the formula gives)
        exact = np.exp(flat.astype(np.float64) - np.fmax.reduce(flat, axis=1, keepdims=True))
        exact /= exact.sum(axis=1, keepdims=True)
    assert calls and y.dtype == F32 and y.shape == x.shape
    np.testing.assert_allclose(y.reshape(flat.shape), exact, rtol=3e-6, atol=1e-12)
