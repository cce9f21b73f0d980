"""Sibling products of one input as one ProjectionGroup (projection_groups.group_sibling_projections): a decoder's
query, key and value products read through head splits (then rotary embeddings and the cache's Concat), and a
gated feed-forward block's gate and up products read by SwishMul. A synthetic decoder layer with odd sizes
against a float64 reference and the unfused graph; products read by anything else, or graph outputs, keep
their nodes; the zoo's decoders from both torch exporters (and the optimizer's output) against the float64
reference (onnxruntime for the optimizer's contrib operators) and the graph with the pass off. A product cut by
a Split of its last axis (GPT-2's c_attn) as one ProjectionGroup (projection_groups.split_projection_outputs):
sizes given or equal parts, against float64 and the unfused graph; a Split read elsewhere kept."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info, zoo_model
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import attention_heads, projection_groups, provider
from reference64 import assert_within, gamma, run_float64


def _unfused(monkeypatch) -> None:
    """The provider's passes without any grouping (the attention's, which takes q, k and v where an Attention
    reads them directly, the siblings' and the split products')."""
    gone = (projection_groups.group_sibling_projections, projection_groups.group_attention_projections,
            projection_groups.split_projection_outputs)
    kept = [p for p in attention_heads.HEADS_PASSES if p not in gone]
    monkeypatch.setattr(provider, "HEADS_PASSES", kept, raising=False)


def _layer(batch, length, embed, q_heads, kv_heads, size, hidden, q_bias: bool, extra_reader: str = ""):
    """x -> q, k, v products (q with an Add of a bias where ``q_bias``) -> head split (Reshape + Transpose) ->
    causal Attention -> head merge -> y; x -> gate, up products -> Swish(gate) * up -> down product -> z.
    ``extra_reader``: "graph" makes the up product a graph output too, "add" adds a second reader of it."""
    rng = np.random.default_rng(embed * 7 + hidden)
    weights: dict[str, np.ndarray] = {}
    nodes = []
    for name, width in (("q", q_heads * size), ("k", kv_heads * size), ("v", kv_heads * size)):
        weights[f"w{name}"] = (rng.standard_normal((embed, width)) / 3).astype(np.float32)
        product = f"{name}_flat"
        nodes.append(helper.make_node("MatMul", ["x", f"w{name}"], [product]))
        if name == "q" and q_bias:
            weights["bq"] = rng.standard_normal(width).astype(np.float32)
            nodes.append(helper.make_node("Add", [product, "bq"], ["q_biased"]))
            product = "q_biased"
        weights[f"{name}_shape"] = np.array([batch, length, -1, size], np.int64)
        nodes += [helper.make_node("Reshape", [product, f"{name}_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    weights["merged_shape"] = np.array([batch, length, -1], np.int64)
    nodes += [helper.make_node("Attention", ["q_heads", "k_heads", "v_heads"], ["y_heads"], is_causal=1),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    for name, shape in (("wg", (embed, hidden)), ("wu", (embed, hidden)), ("wd", (hidden, embed))):
        weights[name] = (rng.standard_normal(shape) / 3).astype(np.float32)
    nodes += [helper.make_node("MatMul", ["x", "wg"], ["gate"]), helper.make_node("MatMul", ["x", "wu"], ["up"]),
              helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"]),
              helper.make_node("Mul", ["gate", "gate_sigmoid"], ["swish"]),
              helper.make_node("Mul", ["swish", "up"], ["gated"]),
              helper.make_node("MatMul", ["gated", "wd"], ["z"])]
    outputs = [tensor_info("y", TensorProto.FLOAT, None), tensor_info("z", TensorProto.FLOAT, None)]
    if extra_reader == "graph":
        outputs.append(tensor_info("up", TensorProto.FLOAT, None))
    elif extra_reader == "add":
        nodes.append(helper.make_node("Add", ["up", "up"], ["up_twice"]))
        outputs.append(tensor_info("up_twice", TensorProto.FLOAT, None))
    initializers = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, length, embed])], outputs, initializers,
                       opset=23)
    return model, weights


def _reference(x: np.ndarray, weights: dict, q_heads: int, kv_heads: int, size: int) -> tuple[list, list]:
    """(y, z) in float64, and bounds on a float32 computation's error (the products' gamma times magnitudes,
    carried through the softmax-weighted sums and the gate)."""
    x = x.astype(np.float64)
    batch, length, embed = x.shape
    w = {name: value.astype(np.float64) for name, value in weights.items()}

    def heads(name, count):
        y = x @ w[f"w{name}"] + (w["bq"] if name == "q" and "bq" in w else 0)
        return y.reshape(batch, length, count, size).transpose(0, 2, 1, 3)

    q, k, v = heads("q", q_heads), heads("k", kv_heads), heads("v", kv_heads)
    k, v = np.repeat(k, q_heads // kv_heads, axis=1), np.repeat(v, q_heads // kv_heads, axis=1)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(size)
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
    scale = max(float(np.abs(q).max()), float(np.abs(k).max()), float(np.abs(v).max()), 1.0)
    y_bound = (gamma(embed + 1) * 40 + gamma(size + length + 8) * 40) * scale * (1 + scale * np.sqrt(size))
    gate, up = x @ w["wg"], x @ w["wu"]
    gated = gate / (1 + np.exp(-gate)) * up
    z = gated @ w["wd"]
    magnitude = np.abs(x) @ np.maximum(np.abs(w["wg"]), np.abs(w["wu"]))
    gated_bound = gamma(embed + 8) * 4 * magnitude * (np.abs(gate) + np.abs(up) + magnitude)
    z_bound = gated_bound @ np.abs(w["wd"]) + gamma(z.shape[-1] + gated.shape[-1]) * (np.abs(gated) @ np.abs(w["wd"]))
    return [y, z], [np.full(y.shape, y_bound), z_bound]


LAYERS = [
    # batch, length, embed, query heads, KV heads, head size, feed-forward width, query bias
    (1, 16, 64, 4, 2, 16, 128, False),  # the zoo LLaMA's layer (grouped-query heads)
    (2, 7, 13, 3, 3, 5, 11, True),  # odd sizes, a query bias (FusedMatMul member), a batch of two
    (1, 1, 24, 4, 1, 6, 40, False),  # a decode step's one row
]


@pytest.mark.parametrize("case", LAYERS, ids=[f"b{c[0]}s{c[1]}e{c[2]}h{c[3]}-{c[4]}d{c[5]}f{c[6]}qb{int(c[7])}"
                                              for c in LAYERS])
def test_sibling_groups_match_the_float64_reference_and_the_unfused_graph(case, made, monkeypatch):
    batch, length, embed, q_heads, kv_heads, size, hidden, q_bias = case
    model, weights = _layer(*case)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    for seed in (0, 1):  # the planned kernels on new values
        x = np.random.default_rng(seed).standard_normal((batch, length, embed)).astype(np.float32)
        got = session.run(None, {"x": x})
        exact, bounds = _reference(x, weights, q_heads, kv_heads, size)
        for name, value, reference, bound in zip("yz", got, exact, bounds):
            assert_within(value, reference, bound, f"{name}, seed {seed}")
    groups = [shapes for op, shapes in made if op == "ProjectionGroup"]
    # q, k, v (read by the Attention once its head split is folded in) and gate, up (SwishMul's)
    assert sorted(shape[1] for shape in groups) == sorted([(embed, (q_heads + 2 * kv_heads) * size),
                                                           (embed, 2 * hidden)]), made
    ops = [op for op, _ in made]
    assert ops.count("MatMul") == 1 and "FusedMatMul" not in ops, ops  # only the down product is left alone
    _unfused(monkeypatch)
    made.clear()
    unfused = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    assert not [op for op, _ in made if op == "ProjectionGroup"]
    for name, value, plain, bound in zip("yz", got, unfused, bounds):
        assert_within(value, plain.astype(np.float64), 2 * bound, f"{name} against the unfused graph")


@pytest.mark.parametrize("extra_reader", ["graph", "add"])
def test_a_product_read_elsewhere_keeps_its_node(extra_reader, made):
    """The up product also a graph output, or read by an Add: gate and up stay two products (q, k, v still
    merge), and every output is the reference's."""
    model, weights = _layer(2, 5, 12, 2, 2, 3, 9, True, extra_reader)
    x = np.random.default_rng(4).standard_normal((2, 5, 12)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    exact, bounds = _reference(x, weights, 2, 2, 3)
    for name, value, reference, bound in zip("yz", got, exact, bounds):
        assert_within(value, reference, bound, name)
    up = x.astype(np.float64) @ weights["wu"].astype(np.float64)
    extra = up if extra_reader == "graph" else 2 * up
    assert_within(got[2], extra, 4 * gamma(13) * (np.abs(x.astype(np.float64)) @ np.abs(weights["wu"])), "up")
    groups = [shapes for op, shapes in made if op == "ProjectionGroup"]
    assert [shape[1] for shape in groups] == [(12, 18)], made


def _split_layer(batch, length, embed, heads, size, sizes: bool, extra_reader: bool = False):
    """x -> one product by [Wq | Wk | Wv] + bias -> Split of the last axis (its sizes as an input, or
    num_outputs) -> head splits -> causal Attention -> head merge -> y (GPT-2's c_attn). ``extra_reader``: the
    key part is also a graph output."""
    rng = np.random.default_rng(embed * 5 + size)
    width = heads * size
    weights = {"wqkv": (rng.standard_normal((embed, 3 * width)) / 3).astype(np.float32),
               "bqkv": rng.standard_normal(3 * width).astype(np.float32),
               "sizes": np.array([width] * 3, np.int64),
               "heads_shape": np.array([batch, length, heads, size], np.int64),
               "merged_shape": np.array([batch, length, width], np.int64)}
    split = helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=2) if sizes else \
        helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=-1, num_outputs=3)
    nodes = [helper.make_node("MatMul", ["x", "wqkv"], ["qkv_flat"]),
             helper.make_node("Add", ["qkv_flat", "bqkv"], ["qkv"]), split]
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [name, "heads_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Attention", ["q_heads", "k_heads", "v_heads"], ["y_heads"], is_causal=1),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    outputs = [tensor_info("y", TensorProto.FLOAT, None)] + ([tensor_info("k", TensorProto.FLOAT, None)]
                                                              if extra_reader else [])
    if not sizes:
        del weights["sizes"]
    initializers = [numpy_helper.from_array(value, name) for name, value in weights.items()]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, length, embed])], outputs, initializers,
                       opset=23)
    parts = np.split(weights["wqkv"], 3, axis=1)
    biases = np.split(weights["bqkv"], 3)
    as_layer = {"wq": parts[0], "wk": parts[1], "wv": parts[2], "bq": biases[0]}
    return model, as_layer, biases


SPLITS = [
    # batch, length, embed, heads, head size, sizes as an input (else num_outputs)
    (1, 16, 64, 4, 16, True),  # the zoo GPT-2's layer
    (2, 5, 13, 3, 5, False),  # odd sizes, equal parts
]


@pytest.mark.parametrize("case", SPLITS, ids=[f"b{c[0]}s{c[1]}e{c[2]}h{c[3]}d{c[4]}sizes{int(c[5])}" for c in SPLITS])
def test_a_split_product_matches_the_float64_reference_and_the_unfused_graph(case, made, monkeypatch):
    batch, length, embed, heads, size, sizes = case
    model, weights, biases = _split_layer(*case)
    x = np.random.default_rng(9).standard_normal((batch, length, embed)).astype(np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    exact = _reference_with_biases(x, np.ones((batch, length, 1), np.float32), weights, biases, heads, size)
    assert_within(y, exact[0], exact[1], "y")
    ops = [op for op, _ in made]
    assert ops.count("ProjectionGroup") == 1 and "Split" not in ops, ops
    _unfused(monkeypatch)
    made.clear()
    (unfused,) = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    assert "Split" in [op for op, _ in made]
    assert_within(y, unfused.astype(np.float64), 2 * exact[1], "y against the unfused graph")


def _reference_with_biases(x, ones, weights, biases, heads, size):
    """_reference's y for q, k and v each with its bias: the input widened by a column of ones whose weights
    are the biases."""
    widened = np.concatenate([x, ones], axis=-1)
    layer = {name: np.concatenate([weights[name], bias[None]], axis=0)
             for name, bias in zip(("wq", "wk", "wv"), biases)}
    no_gate = np.zeros((widened.shape[-1], 1), np.float32)  # (_reference's feed-forward part, unused here)
    layer.update({"wg": no_gate, "wu": no_gate, "wd": np.zeros((1, 1), np.float32)})
    (y, _), (bound, _) = _reference(widened, layer, heads, heads, size)
    return y, bound


def test_a_split_read_elsewhere_keeps_its_nodes(made):
    model, weights, biases = _split_layer(2, 5, 13, 3, 5, True, extra_reader=True)
    x = np.random.default_rng(10).standard_normal((2, 5, 13)).astype(np.float32)
    y, key = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, {"x": x})
    exact = _reference_with_biases(x, np.ones((2, 5, 1), np.float32), weights, biases, 3, 5)
    assert_within(y, exact[0], exact[1], "y")
    k64 = x.astype(np.float64) @ weights["wk"] + biases[1]
    assert_within(key, k64, 4 * gamma(14) * (np.abs(x.astype(np.float64)) @ np.abs(weights["wk"]) + np.abs(biases[1])))
    ops = [op for op, _ in made]
    assert "Split" in ops and "ProjectionGroup" not in ops, ops


# -- the zoo's decoders ------------------------------------------------------------------------------------------

ZOO_DECODERS = ["llama.torchscript.fp32", "llama.dynamo.fp32", "t5_decoder.torchscript.fp32",
                "t5_decoder.dynamo.fp32", "llama.torchscript.optimized", "llama.dynamo.optimized",
                "gpt2.torchscript.fp32", "gpt2.dynamo.fp32"]


@pytest.mark.parametrize("name", ZOO_DECODERS)
def test_zoo_decoders_group_siblings_and_match(name, made, monkeypatch):
    entry, path = zoo_model(name)
    from zoo_feeds import make_feeds

    session = ort.InferenceSession(path, providers=["cpu"])
    calls = {call: make_feeds(spec) for call, spec in entry["calls"].items()}
    ours = {}
    for call, feeds in calls.items():
        for _ in range(2):  # (the specialized plan, where the passes fire, is made at a first run)
            ours[call] = session.run(None, feeds)
    groups = [shapes[1] for op, shapes in made if op == "ProjectionGroup"]
    # Per layer (two) and call signature (prefill, decode): the self-attention's q, k, v (GPT-2's one split
    # product); LLaMA's gate and up too
    per_call = 4 if name.startswith("llama") else 2
    if name.startswith("gpt2"):
        assert "Split" not in [op for op, _ in made], made
    assert len(groups) >= per_call * len(calls), made
    _unfused(monkeypatch)
    plain_session = ort.InferenceSession(path, providers=["cpu"])
    if name.endswith(".fp32"):
        reference = {call: run_float64(onnx.load(path), feeds) for call, feeds in calls.items()}
    else:  # the optimizer's contrib operators: onnxruntime as the oracle
        oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
        theirs = oracle.InferenceSession(path, providers=["CPUExecutionProvider"])
        reference = {call: theirs.run(None, feeds) for call, feeds in calls.items()}
    for call, feeds in calls.items():
        unfused = plain_session.run(None, feeds)
        for got, plain, exact in zip(ours[call], unfused, reference[call]):
            scale = float(np.abs(exact).max()) + 1e-6
            np.testing.assert_allclose(got, plain, rtol=0, atol=2e-5 * scale, err_msg=f"{call}: the unfused graph")
            np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * scale, err_msg=f"{call}: the reference")
