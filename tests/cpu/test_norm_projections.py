"""A normalization folded into the projection that alone reads it (norm_projections.fold_norms_into_projections):
LayerNormalization (with and without its shift) or RMSNormalization in front of a biased product with Gelu (a
FusedMatMul) and of sibling gate/up products (a ProjectionGroup read by SwishMul). One row (a decode step: the
normalization and the product bound as one compiled call), a few and many rows (a prefill: the normalization's
kernel, then the product), against onnx's float64 reference and the graph with the pass off; a normalization read
by two nodes, or a graph output, keeps its node."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, record_calls, session_without_passes, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.ops import linalg
from reference64 import assert_within, run_float64

NORMS = ("layer", "layer_no_shift", "rms")


def _norm_node(kind: str, source: str, output: str, weights: dict, rng, embed: int):
    weights[f"{output}_scale"] = (1 + rng.standard_normal(embed) / 4).astype(np.float32)
    if kind == "rms":
        return helper.make_node("RMSNormalization", [source, f"{output}_scale"], [output], axis=-1, epsilon=1e-5)
    inputs = [source, f"{output}_scale"]
    if kind == "layer":
        weights[f"{output}_shift"] = (rng.standard_normal(embed) / 4).astype(np.float32)
        inputs.append(f"{output}_shift")
    return helper.make_node("LayerNormalization", inputs, [output], axis=-1, epsilon=1e-5)


def _block(rows: int, embed: int, hidden: int, kind: str, extra_reader: str = ""):
    """x -> norm -> MatMul + Add -> Gelu -> MatMul + Add -> y; y -> norm -> gate, up MatMuls -> Swish(gate) * up ->
    MatMul -> z. ``extra_reader``: "graph" makes the first norm's output a graph output too, "add" adds a second
    reader of it."""
    rng = np.random.default_rng(rows * 31 + embed + len(kind))
    weights: dict[str, np.ndarray] = {}
    for name, shape in (("w1", (embed, hidden)), ("w2", (hidden, embed)), ("wg", (embed, hidden)),
                        ("wu", (embed, hidden)), ("wd", (hidden, embed))):
        weights[name] = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    weights["b1"] = rng.standard_normal(hidden).astype(np.float32) / 4
    weights["b2"] = rng.standard_normal(embed).astype(np.float32) / 4
    nodes = [_norm_node(kind, "x", "n1", weights, rng, embed),
             helper.make_node("MatMul", ["n1", "w1"], ["p1"]), helper.make_node("Add", ["p1", "b1"], ["h1"]),
             helper.make_node("Gelu", ["h1"], ["g1"]),
             helper.make_node("MatMul", ["g1", "w2"], ["p2"]), helper.make_node("Add", ["p2", "b2"], ["y"]),
             _norm_node(kind, "y", "n2", weights, rng, embed),
             helper.make_node("MatMul", ["n2", "wg"], ["gate"]), helper.make_node("MatMul", ["n2", "wu"], ["up"]),
             helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"]),
             helper.make_node("Mul", ["gate", "gate_sigmoid"], ["swish"]),
             helper.make_node("Mul", ["swish", "up"], ["gated"]),
             helper.make_node("MatMul", ["gated", "wd"], ["z"])]
    outputs = [tensor_info("z", TensorProto.FLOAT, None)]
    if extra_reader == "graph":
        outputs.append(tensor_info("n1", TensorProto.FLOAT, None))
    elif extra_reader == "add":
        nodes.append(helper.make_node("Add", ["n1", "n1"], ["n1_twice"]))
        outputs.append(tensor_info("n1_twice", TensorProto.FLOAT, None))
    initializers = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, rows, embed])], outputs, initializers, opset=23)


def _bound(reference: np.ndarray, hidden: int) -> np.ndarray:
    """float32's error through two normalizations and three products of up to ``hidden`` terms, for values and
    weights of order one (the block's), with room for the Gelu and the gate."""
    return 8 * hidden * np.finfo(np.float32).eps * (1 + np.abs(reference))


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("kind", NORMS)
def test_folded_normalizations_match_the_float64_reference_and_the_unfused_graph(rows, kind, made, monkeypatch):
    embed, hidden = 48, 80
    model = _block(rows, embed, hidden, kind)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = [op for op, _ in made]
    assert "LayerNormalization" not in ops and "RMSNormalization" not in ops, ops
    assert "FusedMatMul" in ops and "ProjectionGroup" in ops, ops
    xs = [np.random.default_rng(seed).standard_normal((1, rows, embed)).astype(np.float32) * 2 for seed in range(4)]
    got = [session.run(None, {"x": x})[0] for x in xs]  # (the later runs: the bound calls, at few rows)
    taken = record_calls(monkeypatch, products.PackedProduct)
    again = session.run(None, {"x": xs[-1]})[0]
    assert np.array_equal(again, got[-1])
    if rows == 1:
        assert not taken  # the normalized products ran through their bound calls
    unfused = session_without_passes(model.SerializeToString(), monkeypatch, "NORM_PASSES",
                                     "fold_norms_into_projections")
    for x, value in zip(xs, got):
        (reference,) = run_float64(model, {"x": x})
        assert_within(value, reference, _bound(reference, hidden), f"{kind}, {rows} rows")
        (plain,) = unfused.run(None, {"x": x})
        assert_within(value, plain.astype(np.float64), 2 * _bound(reference, hidden), "against the unfused graph")


@pytest.mark.parametrize("extra_reader", ["graph", "add"])
def test_a_normalization_read_elsewhere_keeps_its_node(extra_reader, made):
    model = _block(1, 32, 64, "layer", extra_reader)
    x = np.random.default_rng(5).standard_normal((1, 1, 32)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    got = session.run(None, {"x": x})
    ops = [op for op, _ in made]
    assert ops.count("LayerNormalization") == 1, ops  # the first kept, the second folded
    for value, reference in zip(got, run_float64(model, {"x": x})):
        assert_within(value, reference, _bound(reference, 64), extra_reader)


@pytest.mark.parametrize("size", [2, 4])
def test_a_folded_normalization_reads_a_channels_last_view_as_a_contiguous_input(size, made, monkeypatch):
    # ConvNeXt's block: Transpose(NCHW map, (0, 2, 3, 1)) -> LayerNormalization -> MatMul + Add -> Gelu. The folded
    # FusedMatMul reads the Transpose's view: its planned kernel copies it once and runs as for a contiguous input
    # (the normalization's loop, then its product), not through the general kernel (linalg.product's dispatch).
    channels, hidden = 32, 64
    rng = np.random.default_rng(size)
    weights = {"w1": (rng.standard_normal((channels, hidden)) / np.sqrt(channels)).astype(np.float32),
               "b1": (rng.standard_normal(hidden) / 4).astype(np.float32)}
    nodes = [helper.make_node("Transpose", ["x"], ["pixels"], perm=[0, 2, 3, 1]),
             _norm_node("layer", "pixels", "n1", weights, rng, channels),
             helper.make_node("MatMul", ["n1", "w1"], ["p1"]), helper.make_node("Add", ["p1", "b1"], ["h1"]),
             helper.make_node("Gelu", ["h1"], ["y"])]
    initializers = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, channels, size, size])],
                       [tensor_info("y", TensorProto.FLOAT, None)], initializers, opset=23)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])
    ops = [op for op, _ in made]
    assert "LayerNormalization" not in ops and "FusedMatMul" in ops, ops
    xs = [np.random.default_rng(seed).standard_normal((1, channels, size, size)).astype(np.float32) * 2
          for seed in range(3)]
    got = [session.run(None, {"x": x})[0] for x in xs]
    general = []
    real = linalg.product
    monkeypatch.setattr(linalg, "product", lambda *args: general.append(args) or real(*args))
    again = session.run(None, {"x": xs[-1]})[0]
    assert np.array_equal(again, got[-1])
    assert not general
    for x, value in zip(xs, got):
        (reference,) = run_float64(model, {"x": x})
        assert_within(value, reference, _bound(reference, channels), f"{size}x{size}")
