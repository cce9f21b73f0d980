"""A merged q/k/v product whose normalization was folded first still becomes a ProjectionGroup with its heads split
(projection_groups.split_projection_outputs taking a normalized FusedMatMul, fold_head_splits reading a head
split's copied dimensions off the column's static shape).

onnxruntime's offline-optimized decoders (the zoo's *.optimized, both torch exporters) read a layer's normalized
input by the merged product directly, so over symbolic lengths the generic plan folds the normalization into the
FusedMatMul (norm_projections) before a specialized plan's static shapes let the product be grouped; and
TorchScript writes a head split's target as [0, 0, heads, size], whose zeros copy the column's dimensions. A
decode-style layer over symbolic lengths, with each normalization kind, against float64; the same layer without
the normalized member keeps its Split; the zoo's optimized decoders keep no Split or head split step."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info, zoo_model
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import projection_groups
from reference64 import assert_within, gamma, run_float64

NORMS = ("layer", "layer_no_shift", "rms", "none")  # (none: the head splits' zeros alone)


def _layer(kind: str, embed: int, heads: int, size: int, zero_copy: bool, batch: int, length: int):
    """x -> normalization -> MatMul by [Wq | Wk | Wv] + bias -> Split(axis 2) -> head splits (Reshape + Transpose)
    -> k, v after the cache's past (Concat) -> Attention -> head merge -> y; the lengths symbolic. With
    ``zero_copy`` the head splits' targets are TorchScript's [0, 0, -1, size], else [batch, length, -1, size]."""
    rng = np.random.default_rng(embed + heads + len(kind))
    width = heads * size
    weights = {"w": (rng.standard_normal((embed, 3 * width)) / np.sqrt(embed)).astype(np.float32),
               "bias": (rng.standard_normal(3 * width) / 4).astype(np.float32),
               "scale": (1 + rng.standard_normal(embed) / 4).astype(np.float32),
               "split_shape": np.array([0, 0, -1, size] if zero_copy else [batch, length, -1, size], np.int64),
               "merged_shape": np.array([0, 0, -1], np.int64)}
    if kind == "none":
        norm = helper.make_node("Identity", ["x"], ["n"])
    elif kind == "rms":
        norm = helper.make_node("RMSNormalization", ["x", "scale"], ["n"], axis=-1, epsilon=1e-5)
    else:
        inputs = ["x", "scale"]
        if kind == "layer":
            weights["shift"] = (rng.standard_normal(embed) / 4).astype(np.float32)
            inputs.append("shift")
        norm = helper.make_node("LayerNormalization", inputs, ["n"], axis=-1, epsilon=1e-5)
    nodes = [norm, helper.make_node("MatMul", ["n", "w"], ["product"]),
             helper.make_node("Add", ["product", "bias"], ["qkv"]),
             helper.make_node("Split", ["qkv"], ["q_flat", "k_flat", "v_flat"], axis=2, num_outputs=3)]
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [f"{name}_flat", "split_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Concat", ["past_k", "k_heads"], ["present_k"], axis=2),
              helper.make_node("Concat", ["past_v", "v_heads"], ["present_v"], axis=2),
              helper.make_node("Attention", ["q_heads", "present_k", "present_v"], ["y_heads"]),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    cache = ["batch", heads, "past", size]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["batch", "length", embed]),
                               tensor_info("past_k", TensorProto.FLOAT, cache),
                               tensor_info("past_v", TensorProto.FLOAT, cache)],
                       [tensor_info(n, TensorProto.FLOAT, None) for n in ("y", "present_k", "present_v")],
                       [numpy_helper.from_array(v, n) for n, v in weights.items()], opset=23)
    return model, weights


def _normalized64(kind: str, x: np.ndarray, weights: dict) -> np.ndarray:
    x64 = x.astype(np.float64)
    if kind == "none":
        return x64
    if kind == "rms":
        return x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * weights["scale"]
    centered = x64 - x64.mean(-1, keepdims=True)
    n = centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-5) * weights["scale"]
    return n + weights["shift"] if "shift" in weights else n


def _check_layer(kind, case, zero_copy):
    batch, length, past, embed, heads, size = case
    model, weights = _layer(kind, embed, heads, size, zero_copy, batch, length)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])
    rng = np.random.default_rng(7)
    for step in range(3):  # (the specialized plan, where the passes fire, is made at a first run; the cache grows)
        feeds = {"x": (rng.standard_normal((batch, length, embed)) * 2).astype(np.float32),
                 "past_k": rng.standard_normal((batch, heads, past + step, size)).astype(np.float32),
                 "past_v": rng.standard_normal((batch, heads, past + step, size)).astype(np.float32)}
        got = session.run(None, feeds)
        exact = run_float64(model, feeds)
        # float32's error in the normalization and the product (terms of |n| |w| + |bias|), carried through the
        # softmax's weights (up to its logits' size) and the values' sum
        n64 = np.abs(_normalized64(kind, feeds["x"], weights))
        product = float((n64 @ np.abs(weights["w"].astype(np.float64)) + np.abs(weights["bias"])).max())
        bound = gamma(2 * embed + 8) * product * 8 * (1 + product * np.sqrt(size)) \
            + gamma(size + past + step + length + 8) * 40
        for name, value, reference in zip(("y", "present_k", "present_v"), got, exact):
            assert_within(value, reference, bound, f"{kind}, {name}, step {step}")


CASES = [(1, 1, 5, 24, 3, 8), (2, 1, 3, 16, 2, 8), (1, 4, 6, 24, 3, 8)]


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zeros", "sizes"])
@pytest.mark.parametrize("case", CASES, ids=["decode", "decode-b2", "prefill-rows"])
@pytest.mark.parametrize("kind", NORMS)
def test_a_normalized_merged_product_becomes_a_split_group_within_the_float64_bound(kind, case, zero_copy, made):
    _check_layer(kind, case, zero_copy)
    ops = [op for op, _ in made]
    assert "ProjectionGroup" in ops, ops
    assert not {"Split", "ReshapeTranspose", "LayerNormalization", "RMSNormalization"} & set(ops), ops


def test_without_the_normalized_member_the_split_stays(made, monkeypatch):
    """The new member is what groups it: with _folded_norm declining, the folded product keeps its Split."""
    monkeypatch.setattr(projection_groups, "_folded_norm", lambda view, fed, node: None)
    _check_layer("layer", CASES[0], True)
    ops = [op for op, _ in made]
    assert "Split" in ops and "ProjectionGroup" not in ops, ops


def test_a_head_split_of_an_unknown_column_shape_keeps_its_zeros():
    """A 0 that copies a dimension is resolved only from a static column shape; without one the split stays."""
    from onnx_runtime.dtypes import DataType
    from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
    from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN, GraphView

    split = Node("ReshapeTranspose", ["column"], ["heads"], name="split", domain=FUSED_DOMAIN,
                 attrs={"shape": [0, 0, -1, 8], "perm": [0, 2, 1, 3], "allowzero": 0}, opset=1)
    reader = Node("Identity", ["heads"], ["out"], name="reader")
    graph = Graph("g", [split, reader], [], [ValueInfo("out")], {}, {}, {"": 23})
    for shape, expected in ((("b", "s", 24), None), ((1, 1, 24), [4, 1, 1, -1, 8, 0, 2, 1, 3]),
                            ((24,), None), (None, None)):  # (the second 0 copies no dimension of a vector)
        graph.value_info["column"] = ValueInfo("column", TypeInfo("tensor", DataType.FLOAT, shape))
        found = projection_groups._head_split(graph, GraphView(graph), "column")  # noqa: SLF001
        assert (None if found is None else found[1]) == expected, (shape, found)
    split.attrs["allowzero"] = 1  # (a literal 0: an empty dimension, no copy)
    assert projection_groups._head_split(graph, GraphView(graph), "column") is None  # noqa: SLF001


OPTIMIZED_DECODERS = ["gpt2.torchscript.optimized", "gpt2.dynamo.optimized", "llama.torchscript.optimized"]


@pytest.mark.parametrize("name", OPTIMIZED_DECODERS)
def test_optimized_zoo_decoders_keep_no_split_or_head_split_step(name, made):
    """The zoo's onnxruntime-optimized decoders plan a decode step as their fp32 exports do (their outputs against
    onnxruntime: test_zoo.py)."""
    entry, path = zoo_model(name)
    from zoo_feeds import make_feeds

    session = ort.InferenceSession(path, providers=["cpu"])
    feeds = make_feeds(entry["calls"]["decode"])
    for _ in range(2):
        session.run(None, feeds)
    ops = [op for op, _ in made]
    assert "ProjectionGroup" in ops and not {"Split", "ReshapeTranspose"} & set(ops), ops
