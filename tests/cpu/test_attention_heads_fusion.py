"""The head split and merge around an exported attention fold into a 3-D Attention (attention_heads.py), whose
kernel reads and writes the (B, S, H * D) layout in place: results against a float64 reference over odd head
sizes, grouped-query heads, value heads of another size, masks, causal frontiers and batches above one, on the
few-row loop and the larger paths; the fold is made only where every folded value has no other reader."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.session import executor, steps
from onnx_runtime_ep_cpu import provider


def _model(batch, length, q_heads, kv_heads, size, value_size, mask: bool, causal: int, exposed: str = ""):
    """x (B, S, E) -> q/k/v projections split into heads as both exporters do (Reshape, Transpose 0 2 1 3) ->
    Attention-23 -> Transpose 0 2 1 3 -> Reshape (B, S, -1); ``exposed``: a head split also made a graph output."""
    rng = np.random.default_rng(7)
    embed = 12
    weights = {"wq": (embed, q_heads * size), "wk": (embed, kv_heads * size), "wv": (embed, kv_heads * value_size)}
    initializers = [numpy_helper.from_array((rng.standard_normal(shape) / 3).astype(np.float32), name)
                    for name, shape in weights.items()]
    nodes = []
    for name, width in (("q", size), ("k", size), ("v", value_size)):
        initializers.append(numpy_helper.from_array(np.array([batch, length, -1, width], np.int64), f"{name}_shape"))
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_flat"]),
                  helper.make_node("Reshape", [f"{name}_flat", f"{name}_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    initializers.append(numpy_helper.from_array(np.array([batch, length, -1], np.int64), "merged_shape"))
    inputs = ["q_heads", "k_heads", "v_heads"] + (["mask"] if mask else [])
    nodes += [helper.make_node("Attention", inputs, ["y_heads"], is_causal=causal),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    graph_inputs = [tensor_info("x", TensorProto.FLOAT, [batch, length, embed])]
    if mask:
        graph_inputs.append(tensor_info("mask", TensorProto.FLOAT, [batch, 1, length, length]))
    outputs = [tensor_info("y", TensorProto.FLOAT, None)] + ([tensor_info(exposed, TensorProto.FLOAT, None)]
                                                            if exposed else [])
    model = make_model(nodes, graph_inputs, outputs, initializers, opset=23)
    return model, {t.name: numpy_helper.to_array(t) for t in initializers}


def _reference(feeds, weights, q_heads, kv_heads, size, value_size, causal) -> np.ndarray:
    x = feeds["x"].astype(np.float64)
    batch, length = x.shape[:2]

    def heads(name, count, width):
        return (x @ weights[name].astype(np.float64)).reshape(batch, length, count, width).transpose(0, 2, 1, 3)

    q, k, v = heads("wq", q_heads, size), heads("wk", kv_heads, size), heads("wv", kv_heads, value_size)
    k, v = np.repeat(k, q_heads // kv_heads, axis=1), np.repeat(v, q_heads // kv_heads, axis=1)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(size)
    if "mask" in feeds:
        scores = scores + feeds["mask"].astype(np.float64)
    if causal:
        scores = np.where(np.arange(length)[None, :] > np.arange(length)[:, None], -np.inf, scores)
    weights_ = np.exp(scores - scores.max(-1, keepdims=True))
    y = (weights_ / weights_.sum(-1, keepdims=True)) @ v
    return y.transpose(0, 2, 1, 3).reshape(batch, length, -1)


@pytest.fixture
def attention_inputs(monkeypatch) -> list:
    """The input shapes of every Attention kernel the session makes."""
    made: list = []
    original = steps.make_kernel

    def recording(handle, node, shapes, graph):
        if node.op_type == "Attention":
            made.append(tuple(shapes))
        return original(handle, node, shapes, graph)

    monkeypatch.setattr(steps, "make_kernel", recording)
    monkeypatch.setattr(executor, "make_kernel", recording)  # (a static graph's kernels are made at planning)
    return made


def _feeds(batch, length, mask: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((batch, length, 12)).astype(np.float32)}
    if mask:
        hidden = rng.random((batch, 1, length, length)) < 0.3
        hidden[..., 0] = False  # every row sees a key
        feeds["mask"] = np.where(hidden, -np.inf, rng.standard_normal((batch, 1, length, length))).astype(np.float32)
    return feeds


CASES = [
    # batch, length, query heads, KV heads, head size, value head size, mask, causal
    (1, 17, 4, 4, 16, 16, False, 0),  # a ViT's: the few-row loop
    (2, 9, 3, 3, 5, 5, True, 0),  # odd head size, batch of two, a mask with hidden keys
    (2, 6, 4, 2, 7, 7, True, 0),  # grouped-query heads
    (1, 8, 2, 2, 4, 4, False, 1),  # a causal frontier
    (1, 5, 2, 2, 3, 6, False, 0),  # value heads wider than the query heads
    (2, 40, 4, 4, 16, 16, True, 0),  # too long for the few-row loop: the products path
    (1, 48, 2, 2, 32, 32, False, 1),  # a causal prefill: the tiles where the host has them
]


@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}s{c[1]}h{c[2]}-{c[3]}d{c[4]}-{c[5]}m{int(c[6])}c{c[7]}"
                                             for c in CASES])
def test_folded_heads_match_the_float64_reference(case, attention_inputs):
    batch, length, q_heads, kv_heads, size, value_size, mask, causal = case
    model, weights = _model(*case)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = _feeds(batch, length, mask)
    (y,) = sess.run(None, feeds)
    np.testing.assert_allclose(y, _reference(feeds, weights, q_heads, kv_heads, size, value_size, causal),
                               rtol=2e-5, atol=2e-6)
    assert attention_inputs and all(len(shapes[0]) == 3 for shapes in attention_inputs), attention_inputs
    (again,) = sess.run(None, _feeds(batch, length, mask, seed=1))  # the planned kernel on new values
    np.testing.assert_allclose(again, _reference(_feeds(batch, length, mask, seed=1), weights, q_heads, kv_heads,
                                                 size, value_size, causal), rtol=2e-5, atol=2e-6)


def test_a_head_split_read_elsewhere_stays(attention_inputs):
    model, weights = _model(2, 9, 3, 3, 5, 5, True, 0, exposed="k_heads")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = _feeds(2, 9, True)
    y, k_heads = sess.run(None, feeds)
    np.testing.assert_allclose(y, _reference(feeds, weights, 3, 3, 5, 5, 0), rtol=2e-5, atol=2e-6)
    assert k_heads.shape == (2, 3, 9, 5)
    assert attention_inputs and all(len(shapes[0]) == 4 for shapes in attention_inputs)


def test_a_fully_masked_row_gives_what_the_unfolded_graph_gives(monkeypatch):
    """A row that sees no key leaves the few-row loop for the general path, in either layout."""
    model, _ = _model(2, 9, 3, 3, 5, 5, True, 0)
    feeds = _feeds(2, 9, True)
    feeds["mask"][1, 0, 4, :] = -np.inf
    folded = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, feeds)[0]
    monkeypatch.setattr(provider, "HEADS_PASSES", [], raising=False)
    unfolded = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, feeds)[0]
    np.testing.assert_allclose(folded, unfolded, rtol=1e-6, atol=1e-7)
    assert np.isfinite(folded[0]).all()
