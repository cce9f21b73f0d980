"""Gradient (ai.onnx.preview.training) against finite differences, with broadcasting and MatMul."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import tensor_info
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidGraphError

TRAINING = "ai.onnx.preview.training"


def _model(nodes, inputs, outputs):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)]
    ).SerializeToString()


def _loss(a, b, c):
    return np.tanh(np.matmul(a, b) * c + c).sum()


def test_gradient_matches_finite_differences():
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["ab"]),
        helper.make_node("Mul", ["ab", "c"], ["abc"]),
        helper.make_node("Add", ["abc", "c"], ["s"]),
        helper.make_node("Tanh", ["s"], ["y"]),
        helper.make_node("Gradient", ["a", "b", "c"], ["da", "db", "dc"], domain=TRAINING, xs=["a", "b", "c"], y="y"),
    ]
    model = _model(
        nodes,
        [tensor_info(n, TensorProto.DOUBLE, s) for n, s in (("a", [2, 3]), ("b", [3, 4]), ("c", [4]))],
        [tensor_info(n, TensorProto.DOUBLE) for n in ("da", "db", "dc")],
    )
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(s) for s in ((2, 3), (3, 4), (4,)))
    sess = ort.InferenceSession(model, providers=["cpu"])
    grads = sess.run(None, {"a": a, "b": b, "c": c})
    eps = 1e-6
    for index, (value, grad) in enumerate(zip((a, b, c), grads)):
        assert grad.shape == value.shape and grad.dtype == np.float64
        numeric = np.zeros_like(value)
        for pos in np.ndindex(value.shape):
            args = [a.copy(), b.copy(), c.copy()]
            args[index][pos] += eps
            up = _loss(*args)
            args[index][pos] -= 2 * eps
            numeric[pos] = (up - _loss(*args)) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)


def test_gradient_through_an_unsupported_operator_is_a_typed_error():
    nodes = [
        helper.make_node("Softmax", ["a"], ["y"]),
        helper.make_node("Gradient", ["a"], ["da"], domain=TRAINING, xs=["a"], y="y"),
    ]
    model = _model(nodes, [tensor_info("a", shape=[3])], [tensor_info("da")])
    with pytest.raises(InvalidGraphError, match=r"differentiating Softmax .* is not supported"):
        ort.InferenceSession(model, providers=["cpu"])
