"""Constant folding's work is bounded, not only its result's size: a product of two constants with a long inner
dimension is small to hold but can take minutes at creation, so past ``MAX_FOLD_WORK`` multiply-adds (or past
``MAX_FOLD_SECONDS`` of CPU in one pass) a node is left to the run, which computes the same values."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime.optimizer import constant_folding

RNG = np.random.default_rng(22)


def _product_model(equation: str | None = None):
    """y = x + A @ B with A and B constants (MatMul, or Einsum with ``equation``)."""
    a, b = RNG.standard_normal((16, 24)).astype(np.float32), RNG.standard_normal((24, 8)).astype(np.float32)
    product = helper.make_node("Einsum", ["a", "b"], ["p"], equation=equation) if equation else \
        helper.make_node("MatMul", ["a", "b"], ["p"])
    graph = helper.make_graph([product, helper.make_node("Add", ["x", "p"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 8])],
                              [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    opset = 12 if equation else 17
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return model.SerializeToString(), a.astype(np.float64) @ b.astype(np.float64)


def _ops_and_result(model: bytes) -> tuple[list[str], np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = np.zeros((16, 8), np.float32)
    return [node.op_type for node in session.model.graph.nodes], session.run(None, {"x": x})[0]


@pytest.mark.parametrize("equation", [None, "ij,jk->ik"])
def test_a_product_within_the_work_budget_folds(equation):
    model, expected = _product_model(equation)
    ops, result = _ops_and_result(model)
    assert ops == ["Add"]
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation", [None, "ij,jk->ik"])
def test_a_product_past_the_work_budget_is_left_to_the_run(monkeypatch, equation):
    # 16 x 24 x 8 = 3,072 multiply-adds: past a budget of 3,000, within one of 3,072.
    model, expected = _product_model(equation)
    monkeypatch.setattr(constant_folding, "MAX_FOLD_WORK", 3_000)
    ops, result = _ops_and_result(model)
    assert ops == ["Einsum" if equation else "MatMul", "Add"]
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(constant_folding, "MAX_FOLD_WORK", 3_072)
    assert _ops_and_result(model)[0] == ["Add"]


def test_nothing_is_evaluated_once_the_pass_has_used_its_cpu_time(monkeypatch):
    model, expected = _product_model()
    monkeypatch.setattr(constant_folding, "MAX_FOLD_SECONDS", -1.0)
    ops, result = _ops_and_result(model)
    assert ops == ["MatMul", "Add"]
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


def test_convolution_and_pool_work_is_counted_per_output_and_tap():
    x, w = np.zeros((1, 3, 10, 10), np.float32), np.zeros((4, 3, 3, 3), np.float32)
    conv = Node("Conv", ["x", "w"], ["y"], attrs={}, opset=17)
    assert constant_folding.fold_work(conv, [x, w], 1 * 4 * 8 * 8 * 4) == (4 * 8 * 8) * (3 * 3 * 3)
    pool = Node("MaxPool", ["x"], ["y"], attrs={"kernel_shape": [5, 5]}, opset=17)
    assert constant_folding.fold_work(pool, [x], 1 * 3 * 6 * 6 * 4) == (3 * 10 * 10) * 25
    relu = Node("Relu", ["x"], ["y"], attrs={}, opset=17)
    assert constant_folding.fold_work(relu, [x], x.nbytes) == 0  # linear: bounded by the size caps
