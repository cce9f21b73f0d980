"""A ReLU feed-forward block over 2-D rows (OPT's decoder layers) as two FusedMatMuls (gemm_epilogues.fuse_gemm_relu):
both torch exporters' spellings (TorchScript's Gemm with its bias as C, dynamo's without a bias of zeros) within the
float64 bound, one and several rows; the fold off keeps Gemm, Relu and Add; Gemms it cannot take keep their kernel;
the relu epilogue keeps NaN as Relu does."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import decoder_fusions, gemm_epilogues, provider
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.registry import lookup
from reference64 import assert_within, gamma, run_float64

EMBED, HIDDEN = 16, 32


def _block(rows: int, biases: bool, **gemm_attrs):
    """x (rows, EMBED) -> LayerNorm-free MLP: Relu(Gemm(x, W1; transB)) -> Gemm(., W2; transB) + x."""
    rng = np.random.default_rng(rows + biases)
    weights = {"w1": (rng.standard_normal((HIDDEN, EMBED)) / 3).astype(np.float32),
               "w2": (rng.standard_normal((EMBED, HIDDEN)) / 3).astype(np.float32)}
    if biases:
        weights.update(b1=rng.standard_normal(HIDDEN).astype(np.float32),
                       b2=rng.standard_normal(EMBED).astype(np.float32))
    attrs = {"transB": 1, **gemm_attrs}
    nodes = [helper.make_node("Gemm", ["x", "w1"] + (["b1"] if biases else []), ["h"], **attrs),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"] + (["b2"] if biases else []), ["p"], transB=1),
             helper.make_node("Add", ["p", "x"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [rows, EMBED])],
                       [tensor_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(v, n) for n, v in weights.items()], opset=17)
    return model, weights


def _bound(x, weights):
    first = np.abs(x) @ np.abs(weights["w1"].T).astype(np.float64) + np.abs(weights.get("b1", 0))
    second = first @ np.abs(weights["w2"].T).astype(np.float64) + np.abs(weights.get("b2", 0))
    return gamma(EMBED + HIDDEN + 4) * (second + np.abs(x)) * 4


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("biases", [True, False], ids=["torchscript-bias", "dynamo-no-bias"])
def test_the_block_is_two_fused_products_within_the_float64_bound(rows, biases, made):
    model, weights = _block(rows, biases)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    rng = np.random.default_rng(7)
    for _ in range(3):
        x = rng.standard_normal((rows, EMBED)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert_within(y, exact, _bound(x.astype(np.float64), weights), "y")
    ops = [op for op, _ in made]
    assert ops.count("FusedMatMul") == 2 and not {"Gemm", "Relu", "Add"} & set(ops), ops


def test_without_the_fold_gemm_relu_and_add_stay(made, monkeypatch):
    monkeypatch.setattr(provider, "DECODER_PASSES",
                        [p for p in decoder_fusions.DECODER_PASSES if p is not gemm_epilogues.fuse_gemm_relu],
                        raising=False)
    model, _ = _block(1, True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    session.run(None, {"x": np.ones((1, EMBED), np.float32)})
    ops = [op for op, _ in made]
    assert ops.count("Gemm") == 2 and "Relu" in ops and "FusedMatMul" not in ops, ops


@pytest.mark.parametrize("attrs", [{"alpha": 0.5}, {"beta": 2.0}])
def test_a_gemm_it_cannot_take_keeps_its_kernel(attrs, made):
    model, weights = _block(2, True, **attrs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    x = np.random.default_rng(1).standard_normal((2, EMBED)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    (exact,) = run_float64(model, {"x": x})
    assert_within(y, exact, _bound(x.astype(np.float64), weights) * 2, "y")
    assert "Gemm" in [op for op, _ in made]


def test_the_relu_epilogue_keeps_nan_and_clamps_the_rest():
    node = Node("FusedMatMul", ["a", "b", "bias"], ["y"], name="fc1/fused", domain=FUSED_DOMAIN,
                attrs={"activation": "relu"}, opset=1)
    kernel = lookup("FusedMatMul", FUSED_DOMAIN, 1)(node, [(1, 3), (3, 4), (4,)], 1)
    a = np.array([[1.0, 2.0, 3.0]], np.float32)
    b = np.eye(3, 4, dtype=np.float32)
    b[1, 1] = np.nan  # (column 1 alone NaN)
    bias = np.array([-5.0, 0.0, 1.0, -1.0], np.float32)
    (y,) = kernel(a, b, bias)
    assert np.isnan(y[0, 1]) and y[0, 0] == 0 and y[0, 2] == 4 and y[0, 3] == 0


@pytest.mark.parametrize("shapes", [[None, None, None], [(2, None), (None, 4), (4,)]], ids=["unknown", "symbolic"])
def test_the_relu_epilogue_runs_where_no_shape_was_planned(shapes):
    """Without a planned shape the "none" product is the 4-argument kernel; the relu epilogue must call it so (fuzz
    seed 78: a Gemm+Relu of an unplanned shape raised a TypeError)."""
    node = Node("FusedMatMul", ["a", "b", "bias"], ["y"], name="fc1/fused", domain=FUSED_DOMAIN,
                attrs={"activation": "relu"}, opset=1)
    kernel = lookup("FusedMatMul", FUSED_DOMAIN, 1)(node, shapes, 1)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    (y,) = kernel(a, b, bias)
    exact = np.maximum(a.astype(np.float64) @ b.astype(np.float64) + bias, 0)
    bound = gamma(4) * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64) + np.abs(bias))
    assert_within(y, exact, bound, "y")
