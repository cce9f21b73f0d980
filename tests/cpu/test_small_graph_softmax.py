"""Softmax on float32 contiguous inputs whose rows are the axis calls the compiled rows straight (ops/softmax.py):
a streaming model's closing Softmax runs every frame. Both opset forms (the flattened 2-D of opset < 13 and the
last axis of 13) against a float64 softmax, non-finite rows included; other axes and dtypes keep the general path."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.compiled import deferred, transformer

CPU = ["CPUExecutionProvider"]


@pytest.fixture(autouse=True)
def loops_linked(monkeypatch):
    """As after the background loader's switch: compiled loops serve (not numpy meanwhile)."""
    monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(deferred.state, "guarding", False)
    monkeypatch.setattr(deferred.state, "deferring", False)


def _reference(x, axis: int, flattened: bool):
    x = x.astype(np.float64)
    shaped = x.reshape(int(np.prod(x.shape[:axis])), -1) if flattened else np.moveaxis(x, axis, -1)
    with np.errstate(invalid="ignore"):
        e = np.exp(shaped - shaped.max(axis=-1, keepdims=True))
        y = e / e.sum(axis=-1, keepdims=True)
    return y.reshape(x.shape) if flattened else np.moveaxis(y, -1, axis)


def _session(opset: int, axis: int, elem=TensorProto.FLOAT):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=axis)
    model = make_model([node], [tensor_info("x", elem)], [tensor_info("y", elem)], opset=opset)
    return ort.InferenceSession(model.SerializeToString(), providers=CPU)


@pytest.mark.parametrize("opset, axis, shape, compiled", [
    (13, -1, (1, 12), True), (13, 2, (2, 3, 30), True), (13, 1, (2, 5, 4), False),
    (11, 1, (1, 12), True), (11, 1, (2, 3, 4), True), (11, 0, (3, 4), True), (11, -1, (2, 3, 4), True),
])
def test_softmax_rows_agree_with_float64(monkeypatch, opset, axis, shape, compiled):
    calls = []
    real = transformer.softmax_rows_float32_
    monkeypatch.setattr(transformer, "softmax_rows_float32_", lambda x, y: calls.append(1) or real(x, y))
    session = _session(opset, axis)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 20).astype(np.float32)
    for _ in range(3):
        (y,) = session.run(None, {"x": x})
        assert y.dtype == np.float32 and y.shape == x.shape
        a = axis % len(shape)
        np.testing.assert_allclose(y, _reference(x, a, opset < 13), rtol=2e-6, atol=1e-7)
    assert (len(calls) == 3) == compiled, calls


def test_non_finite_rows_as_the_formula_gives():
    session = _session(13, -1)
    x = np.array([[0.0, np.inf, 1.0], [np.nan, 1.0, 2.0], [-np.inf, -np.inf, -np.inf], [-np.inf, 0.0, -np.inf],
                  [1e30, -1e30, 1e30]], np.float32)
    (y,) = session.run(None, {"x": x})
    assert np.isnan(y[:3]).all()
    np.testing.assert_array_equal(y[3], [0, 1, 0])
    np.testing.assert_allclose(y[4], [0.5, 0, 0.5], atol=1e-7)


def test_other_dtypes_keep_the_general_path():
    session = _session(13, -1, TensorProto.DOUBLE)
    x = np.random.default_rng(4).standard_normal((2, 7))
    (y,) = session.run(None, {"x": x})
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, _reference(x, 1, False), rtol=1e-12)
