"""A merged product cut by a Split of its last axis whose parts each get a constant bias by an Add after the Split
(untuned OPT's dynamo export: the optimizer merges the q/k/v products, the biases stay after) runs as one
ProjectionGroup with the biases side by side (projection_groups.split_projection_outputs): against a float64
reference and the graph with the grouping off, with the bias first or second in its Add and a part without one; an
Add whose bias is not a constant, or of another width, keeps the nodes."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import attention_heads, projection_groups, provider

BATCH, LENGTH, EMBED, HEADS, SIZE = 1, 5, 12, 2, 4
WIDTH = HEADS * SIZE


def _layer(case: str):
    """x -> MatMul [Wq | Wk | Wv] -> Split -> q + bq, bk + k, v (no bias) -> head splits -> causal Attention -> y."""
    rng = np.random.default_rng(3)
    values = {"w": (rng.standard_normal((EMBED, 3 * WIDTH)) / 3).astype(np.float32),
              "bq": rng.standard_normal(WIDTH).astype(np.float32),
              "bk": rng.standard_normal(WIDTH).astype(np.float32),
              "sizes": np.array([WIDTH] * 3, np.int64),
              "heads_shape": np.array([BATCH, LENGTH, HEADS, SIZE], np.int64)}
    inputs = [tensor_info("x", TensorProto.FLOAT, [BATCH, LENGTH, EMBED])]
    if case == "bias fed":
        del values["bk"]
        inputs.append(tensor_info("bk", TensorProto.FLOAT, [WIDTH]))
    if case == "broadcast bias":
        values["bk"] = values["bk"][:1].copy()  # (1,): adds as one value across the part
    nodes = [helper.make_node("MatMul", ["x", "w"], ["qkv"]),
             helper.make_node("Split", ["qkv", "sizes"], ["q0", "k0", "v"], axis=-1),
             helper.make_node("Add", ["q0", "bq"], ["q"]),
             helper.make_node("Add", ["bk", "k0"], ["k"])]
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [name, "heads_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    nodes.append(helper.make_node("Attention", ["q_heads", "k_heads", "v_heads"], ["y"], is_causal=1))
    initializers = [numpy_helper.from_array(value, name) for name, value in values.items()]
    model = make_model(nodes, inputs, [tensor_info("y", TensorProto.FLOAT, None)], initializers, opset=23)
    return model.SerializeToString(), values


def _reference(x, values, bk):
    x, w = x.astype(np.float64), values["w"].astype(np.float64)
    q, k, v = np.split(x @ w, 3, axis=-1)
    q, k = q + values["bq"], k + bk

    def heads(t):
        return t.reshape(BATCH, LENGTH, HEADS, SIZE).transpose(0, 2, 1, 3)

    scores = heads(q) @ heads(k).swapaxes(-1, -2) / np.sqrt(SIZE)
    scores = np.where(np.triu(np.ones((LENGTH, LENGTH), bool), 1), -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ heads(v)


def _run(model: bytes, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model, providers=["cpu"])
    for _ in range(2):  # (the specialized plan, where the grouping fires, is made at a first run)
        (y,) = session.run(None, feeds)
    return y


@pytest.mark.parametrize("case", ["constant biases", "bias fed", "broadcast bias"])
def test_split_parts_with_biases_group_where_the_biases_are_constant_vectors(case, made, monkeypatch):
    model, values = _layer(case)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((BATCH, LENGTH, EMBED)).astype(np.float32)}
    bk = values.get("bk")
    if case == "bias fed":
        bk = feeds["bk"] = rng.standard_normal(WIDTH).astype(np.float32)
    y = _run(model, feeds)
    np.testing.assert_allclose(y, _reference(feeds["x"], values, bk), rtol=1e-5, atol=1e-5)
    ops = [op for op, _ in made]
    if case == "constant biases":
        assert ops.count("ProjectionGroup") == 1 and "Split" not in ops and "Add" not in ops, ops
    else:  # a bias the group cannot take: the product, Split and Adds stay
        assert "ProjectionGroup" not in ops and "Split" in ops, ops
    gone = (projection_groups.group_sibling_projections, projection_groups.group_attention_projections,
            projection_groups.split_projection_outputs)
    monkeypatch.setattr(provider, "HEADS_PASSES", [p for p in attention_heads.HEADS_PASSES if p not in gone],
                        raising=False)
    made.clear()
    unfused = _run(model, feeds)
    assert "ProjectionGroup" not in [op for op, _ in made]
    np.testing.assert_allclose(y, unfused, rtol=1e-6, atol=1e-6)
