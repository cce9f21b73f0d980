"""Fusions on the spellings the two torch exporters write (TorchScript at opset 17, dynamo at opset 18+), as
the zoo's exports contain them: each small graph runs fused and is compared with a float64 reference of
what the unfused graph computes, and the fused kernel must be what runs."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

INT64_MAX = np.iinfo(np.int64).max


def _const(name, value, dtype=None):
    array = np.asarray(value)
    dtype = dtype or (np.float32 if array.dtype.kind == "f" else np.int64)
    return numpy_helper.from_array(array.astype(dtype), name)


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def _ops(sess):
    return [n.op_type for n in sess.placement()]


# -- no-ops the exporters write ------------------------------------------------------------------

def test_same_type_cast_one_input_concat_and_product_with_one_are_bypassed():
    nodes = [
        helper.make_node("Cast", ["x"], ["c"], to=TensorProto.FLOAT),  # TorchScript's float -> float
        helper.make_node("Mul", ["one", "c"], ["m"]),  # rotary's cos * attention_scaling (1.0)
        helper.make_node("Concat", ["m"], ["k"], axis=-2),  # a past/present Concat of one input
        helper.make_node("Div", ["k", "one"], ["d"]),
        helper.make_node("Relu", ["d"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[2, 3])], [tensor_info("y", shape=[2, 3])],
                       [_const("one", 1.0)])
    sess = _session(model)
    assert _ops(sess) == ["Relu"]
    x = np.array([[-1.0, -0.0, 2.0], [np.inf, -np.inf, 0.5]], np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))


def test_casts_that_convert_and_products_that_broadcast_stay():
    nodes = [
        helper.make_node("Cast", ["x"], ["c"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["c"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f", "ones"], ["y"]),  # [1, 1, 1] against [2, 3]: the result has rank 3
    ]
    model = make_model(nodes, [tensor_info("x", shape=[2, 3])], [tensor_info("y", shape=[1, 2, 3])],
                       [_const("ones", np.ones((1, 1, 1)))])
    sess = _session(model)
    assert _ops(sess).count("Cast") == 2 and "Mul" in _ops(sess)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = sess.run(None, {"x": x})[0]
    assert got.shape == (1, 2, 3)
    np.testing.assert_array_equal(got, x[None])


# -- RMS normalization ---------------------------------------------------------------------------

def _rms_nodes(spelling: str):
    """x -> RMSNorm(x) * w as each exporter writes LlamaRMSNorm / T5LayerNorm."""
    if spelling == "torchscript":  # opset 17: axes an attribute, rsqrt as 1 / sqrt, float casts around it
        return [
            helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
            helper.make_node("Pow", ["xf", "two"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
            helper.make_node("Add", ["ms", "eps"], ["mse"]),
            helper.make_node("Sqrt", ["mse"], ["rms"]),
            helper.make_node("Div", ["one", "rms"], ["inv"]),
            helper.make_node("Mul", ["xf", "inv"], ["xn"]),
            helper.make_node("Cast", ["xn"], ["xc"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["w", "xc"], ["y"]),
        ], 17
    if spelling == "dynamo":  # opset 18+: axes an input, rsqrt as Reciprocal(Sqrt), the weight first
        return [
            helper.make_node("Pow", ["x", "two"], ["sq"]),
            helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
            helper.make_node("Add", ["ms", "eps"], ["mse"]),
            helper.make_node("Sqrt", ["mse"], ["rms"]),
            helper.make_node("Reciprocal", ["rms"], ["inv"]),
            helper.make_node("Mul", ["x", "inv"], ["xn"]),
            helper.make_node("Mul", ["w", "xn"], ["y"]),
        ], 20
    return [  # x / sqrt(...)
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["xn"]),
        helper.make_node("Mul", ["xn", "w"], ["y"]),
    ], 18


@pytest.mark.parametrize("spelling", ["torchscript", "dynamo", "divide"])
def test_rms_norm_in_each_exporters_spelling_becomes_one_node(spelling):
    nodes, opset = _rms_nodes(spelling)
    w = np.linspace(0.5, 1.5, 16).astype(np.float32)
    inits = [_const("two", 2.0), _const("eps", 1e-6), _const("one", 1.0), _const("axes", [-1]),
             numpy_helper.from_array(w, "w")]
    used = {name for node in nodes for name in node.input}
    model = make_model(nodes, [tensor_info("x", shape=[1, 5, 16])], [tensor_info("y", shape=[1, 5, 16])],
                       [i for i in inits if i.name in used], opset=opset)
    sess = _session(model)
    assert _ops(sess) == ["RMSNormalization"], _ops(sess)
    x = np.random.default_rng(0).standard_normal((1, 5, 16)).astype(np.float32) * 3
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=2e-6, atol=1e-6)


def test_rms_norm_whose_reciprocal_is_read_elsewhere_stays_unfused():
    nodes, opset = _rms_nodes("dynamo")
    w = np.ones(16, np.float32)
    inits = [_const("two", 2.0), _const("eps", 1e-6), _const("axes", [-1]), numpy_helper.from_array(w, "w")]
    model = make_model(nodes, [tensor_info("x", shape=[1, 5, 16])],
                       [tensor_info("y", shape=[1, 5, 16]), tensor_info("inv", shape=[1, 5, 1])], inits, opset=opset)
    sess = _session(model)
    assert "RMSNormalization" not in _ops(sess)
    x = np.random.default_rng(1).standard_normal((1, 5, 16)).astype(np.float32)
    y, inv = sess.run(None, {"x": x})
    want_inv = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(inv, want_inv, rtol=2e-6)
    np.testing.assert_allclose(y, x * want_inv, rtol=2e-6, atol=1e-6)


# -- rotary embedding ----------------------------------------------------------------------------

@pytest.mark.parametrize("axis,end", [(3, INT64_MAX), (-1, 16), (3, 16)])
def test_rotate_half_with_the_axis_counted_from_the_front_and_an_open_end(axis, end):
    """Both exporters slice LLaMA's rotate_half over axis 3 of the [batch, heads, seq, head_dim] query, the
    second half up to INT64_MAX."""
    nodes = [
        helper.make_node("Mul", ["q", "cos"], ["qc"]),
        helper.make_node("Slice", ["q", "zero", "half", "axis", "step"], ["q1"]),
        helper.make_node("Slice", ["q", "half", "end", "axis", "step"], ["q2"]),
        helper.make_node("Neg", ["q2"], ["nq2"]),
        helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["qc", "rs"], ["y"]),
    ]
    inits = [_const("zero", [0]), _const("half", [8]), _const("end", [end]), _const("axis", [axis]),
             _const("step", [1])]
    q_shape, table_shape = [1, 4, 3, 16], [1, 1, 3, 16]
    model = make_model(nodes, [tensor_info("q", shape=q_shape), tensor_info("cos", shape=table_shape),
                               tensor_info("sin", shape=table_shape)], [tensor_info("y", shape=q_shape)], inits)
    sess = _session(model)
    assert _ops(sess) == ["RotateHalfEmbedding"]
    rng = np.random.default_rng(2)
    q = rng.standard_normal(q_shape).astype(np.float32)
    angles = rng.standard_normal(table_shape)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    q64 = q.astype(np.float64)
    want = q64 * cos + np.concatenate((-q64[..., 8:], q64[..., :8]), -1) * sin
    np.testing.assert_allclose(sess.run(None, {"q": q, "cos": cos, "sin": sin})[0], want, rtol=1e-6, atol=1e-6)


def test_rotate_half_whose_half_is_read_elsewhere_stays_unfused():
    nodes = [
        helper.make_node("Mul", ["q", "cos"], ["qc"]),
        helper.make_node("Slice", ["q", "zero", "half", "axis"], ["q1"]),
        helper.make_node("Slice", ["q", "half", "end", "axis"], ["q2"]),
        helper.make_node("Neg", ["q2"], ["nq2"]),
        helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["qc", "rs"], ["y"]),
    ]
    inits = [_const("zero", [0]), _const("half", [8]), _const("end", [INT64_MAX]), _const("axis", [3])]
    q_shape = [1, 2, 3, 16]
    model = make_model(nodes, [tensor_info(n, shape=q_shape) for n in ("q", "cos", "sin")],
                       [tensor_info("y", shape=q_shape), tensor_info("q2", shape=[1, 2, 3, 8])], inits)
    sess = _session(model)
    assert "RotateHalfEmbedding" not in _ops(sess)
    rng = np.random.default_rng(3)
    q, cos, sin = (rng.standard_normal(q_shape).astype(np.float32) for _ in range(3))
    y, q2 = sess.run(None, {"q": q, "cos": cos, "sin": sin})
    np.testing.assert_array_equal(q2, q[..., 8:])
    want = q.astype(np.float64) * cos + np.concatenate((-q[..., 8:], q[..., :8]), -1).astype(np.float64) * sin
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


def test_expand_and_reshape_to_the_shape_a_value_has_are_bypassed():
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["f"]),  # TorchScript's mask: Reshape(-1), then back
        helper.make_node("Reshape", ["f", "back"], ["b"]),
        helper.make_node("Expand", ["b", "same"], ["e"]),
        helper.make_node("Relu", ["e"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[1, 1, 1, 6])], [tensor_info("y", shape=[1, 1, 1, 6])],
                       [_const("flat", [-1]), _const("back", [1, 1, 1, 6]), _const("same", [1, 1, 1, 6])])
    sess = _session(model)
    # The outer Reshape reads x directly (its target copies nothing from [6]), then keeps x's shape.
    assert _ops(sess) == ["Relu"]
    x = np.arange(-3, 3, dtype=np.float32).reshape(1, 1, 1, 6)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))


def test_reshapes_that_copy_a_dimension_from_the_inner_one_stay_chained():
    nodes = [
        helper.make_node("Reshape", ["x", "split"], ["f"]),
        helper.make_node("Reshape", ["f", "copy"], ["y"]),  # 0 copies f's dimension 0 (2), not x's (6)
    ]
    model = make_model(nodes, [tensor_info("x", shape=[6, 2])], [tensor_info("y", shape=[2, 6])],
                       [_const("split", [2, 3, 2]), _const("copy", [0, -1])])
    sess = _session(model)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x.reshape(2, 6))
    assert _ops(sess).count("Reshape") == 2


def test_an_expand_that_broadcasts_stays():
    nodes = [helper.make_node("Expand", ["x", "wide"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[1, 1, 6])], [tensor_info("y", shape=[1, 2, 6])],
                       [_const("wide", [1, 2, 1])])
    sess = _session(model)
    assert _ops(sess) == ["Expand"]
    x = np.arange(6, dtype=np.float32).reshape(1, 1, 6)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.broadcast_to(x, (1, 2, 6)))


# -- attention -----------------------------------------------------------------------------------

def _attention_model(bias_first: bool):
    """T5's attention in both exporters: unscaled scores, + a (folded) relative position bias, + the mask
    built from attention_mask (here an input), Softmax, times V."""
    scores = helper.make_node("MatMul", ["q", "kt"], ["s"])
    biased = helper.make_node("Add", ["s", "bias"] if bias_first else ["bias", "s"], ["sb"])
    masked = helper.make_node("Add", ["sb", "mask"] if bias_first else ["mask", "sb"], ["sm"])
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        scores, biased, masked,
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    shape = [1, 4, 6, 8]
    bias = np.random.default_rng(4).standard_normal((1, 4, 6, 6)).astype(np.float32)
    return make_model(nodes, [tensor_info(n, shape=shape) for n in ("q", "k", "v")]
                      + [tensor_info("mask", shape=[1, 1, 1, 6])], [tensor_info("y", shape=shape)],
                      [numpy_helper.from_array(bias, "bias")], opset=17), bias


@pytest.mark.parametrize("bias_first", [True, False])
def test_attention_with_a_position_bias_and_a_mask_becomes_one_node(bias_first):
    model, bias = _attention_model(bias_first)
    sess = _session(model)
    ops = _ops(sess)
    assert "Attention" in ops and "Softmax" not in ops and "MatMul" not in ops, ops
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 4, 6, 8)).astype(np.float32) for _ in range(3))
    mask = np.where(np.arange(6) < 4, 0.0, np.finfo(np.float32).min).astype(np.float32).reshape(1, 1, 1, 6)
    scores = q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2) + bias + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ v
    got = sess.run(None, {"q": q, "k": k, "v": v, "mask": mask})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _gqa_model(seq):
    """LLaMA's grouped-query attention as the exporters write it: repeat_kv (Unsqueeze at axis 2, Expand,
    Reshape merging the head axes) on K and V, scores scaled, a mask added. ``seq``: the sequence length, or
    a symbol (the generic graph then fuses Attention before the repeats are provable)."""
    nodes = [
        helper.make_node("Unsqueeze", ["k", "two"], ["k5"]),
        helper.make_node("Expand", ["k5", "k_wide"], ["k_rep"]),
        helper.make_node("Reshape", ["k_rep", "k_merged"], ["k_all"], allowzero=1),
        helper.make_node("Unsqueeze", ["v", "two"], ["v5"]),
        helper.make_node("Expand", ["v5", "v_wide"], ["v_rep"]),
        helper.make_node("Reshape", ["v_rep", "v_merged"], ["v_all"], allowzero=1),
        helper.make_node("Transpose", ["k_all"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Add", ["ss", "mask"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v_all"], ["y"]),
    ]
    if isinstance(seq, int):  # constant targets, as specialization folds them
        targets = [_const("k_wide", [1, 2, 2, seq, 8]), _const("k_merged", [1, 4, seq, 8]),
                   _const("v_wide", [1, 2, 2, seq, 8]), _const("v_merged", [1, 4, seq, 8])]
        extra_nodes = []
    else:  # computed from Shape(k), as exported
        extra_nodes = [
            helper.make_node("Shape", ["k"], ["k_shape"]),
            helper.make_node("Gather", ["k_shape", "axis2"], ["len"], axis=0),
            helper.make_node("Concat", ["one_two_two", "len", "eight"], ["k_wide"], axis=0),
            helper.make_node("Concat", ["one_four", "len", "eight"], ["k_merged"], axis=0),
            helper.make_node("Identity", ["k_wide"], ["v_wide"]),
            helper.make_node("Identity", ["k_merged"], ["v_merged"]),
        ]
        targets = [_const("axis2", [2]), _const("one_two_two", [1, 2, 2]), _const("eight", [8]),
                   _const("one_four", [1, 4])]
    model = make_model(
        extra_nodes + nodes,
        [tensor_info("q", shape=[1, 4, seq, 8]), tensor_info("k", shape=[1, 2, seq, 8]),
         tensor_info("v", shape=[1, 2, seq, 8]), tensor_info("mask", shape=[1, 1, seq, seq])],
        [tensor_info("y", shape=[1, 4, seq, 8])],
        [_const("two", [2]), _const("scale", 8 ** -0.5)] + targets, opset=17)
    if not isinstance(seq, int):  # dynamo declares every value's symbolic shape: Attention fuses generically
        model.graph.value_info.extend(tensor_info(name, shape=[1, 4, seq, 8]) for name in ("k_all", "v_all"))
    return model


def _gqa_feeds_and_reference(seq):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, seq, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, seq, 8)).astype(np.float32) for _ in range(2))
    mask = np.triu(np.full((seq, seq), np.finfo(np.float32).min, np.float32), 1).reshape(1, 1, seq, seq)
    k_all, v_all = (np.repeat(t.astype(np.float64), 2, axis=1) for t in (k, v))
    scores = q.astype(np.float64) @ k_all.transpose(0, 1, 3, 2) * 8 ** -0.5 + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return {"q": q, "k": k, "v": v, "mask": mask}, (weights / weights.sum(-1, keepdims=True)) @ v_all


@pytest.mark.parametrize("seq", [5, "seq"])
def test_grouped_query_attention_reads_the_unrepeated_key_and_value(seq):
    sess = _session(_gqa_model(seq))
    feeds, want = _gqa_feeds_and_reference(5)
    ops = [node.op_type for node in sess.graph_for(feeds).nodes]
    assert "Attention" in ops and not {"Expand", "Unsqueeze", "Reshape", "Softmax"} & set(ops), ops
    np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)


def test_attention_whose_query_is_scaled_before_its_heads_are_split_takes_the_scale():
    """Whisper's attention (both exporters): q_proj(x) * head_dim**-0.5, then Reshape and Transpose into heads,
    and unscaled scores."""
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["xs"]),
        helper.make_node("Reshape", ["xs", "heads"], ["xh"]),
        helper.make_node("Transpose", ["xh"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[1, 6, 8]), tensor_info("k", shape=[1, 2, 6, 4]),
                               tensor_info("v", shape=[1, 2, 6, 4])], [tensor_info("y", shape=[1, 2, 6, 4])],
                       [_const("scale", 0.3), _const("heads", [1, 6, 2, 4])])
    sess = _session(model)
    ops = _ops(sess)
    assert "Attention" in ops and "Mul" not in ops and "Softmax" not in ops, ops
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 6, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(2))
    q = (x.astype(np.float64) * np.float32(0.3)).reshape(1, 6, 2, 4).transpose(0, 2, 1, 3)
    scores = q @ k.astype(np.float64).transpose(0, 1, 3, 2)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(sess.run(None, {"x": x, "k": k, "v": v})[0], want, rtol=1e-5, atol=1e-6)


def test_a_query_scale_that_broadcasts_stays_a_product():
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["xs"]),  # per-feature scale: not a scalar, not Attention's
        helper.make_node("Reshape", ["xs", "heads"], ["xh"]),
        helper.make_node("Transpose", ["xh"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["y"]),
    ]
    scale = np.linspace(0.1, 0.8, 8).astype(np.float32)
    model = make_model(nodes, [tensor_info("x", shape=[1, 6, 8]), tensor_info("k", shape=[1, 2, 6, 4]),
                               tensor_info("v", shape=[1, 2, 6, 4])], [tensor_info("y", shape=[1, 2, 6, 4])],
                       [numpy_helper.from_array(scale, "scale"), _const("heads", [1, 6, 2, 4])])
    sess = _session(model)
    assert "Mul" in _ops(sess)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 6, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(2))
    q = (x.astype(np.float64) * scale).reshape(1, 6, 2, 4).transpose(0, 2, 1, 3)
    scores = q @ k.astype(np.float64).transpose(0, 1, 3, 2)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ v
    np.testing.assert_allclose(sess.run(None, {"x": x, "k": k, "v": v})[0], want, rtol=1e-5, atol=1e-6)


def test_an_expand_to_the_symbolic_shape_its_input_has_is_bypassed():
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Expand", ["x", "shape"], ["e"]),  # inference gives e x's symbols: nothing grows
        helper.make_node("Relu", ["e"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[1, "n"])], [tensor_info("y", shape=[1, "n"])],
                       opset=17)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"],
                                sess_options=_no_specialization())
    assert [n.op_type for n in sess.model.graph.nodes] == ["Relu"]
    x = np.linspace(-1, 1, 5, dtype=np.float32).reshape(1, 5)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))


def _no_specialization():
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", "0")
    return options


def test_a_gemm_over_the_heads_flattened_view_becomes_a_fused_matmul():
    """The dynamo GPT-2 export's attention projection: heads [1, H, S, D] -> Transpose -> Reshape(-1, H * D)
    -> Gemm(W, b) -> Reshape(1, S, N) -> + residual."""
    nodes = [
        helper.make_node("Transpose", ["heads"], ["t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["t", "flat"], ["view"]),
        helper.make_node("Gemm", ["view", "w", "b"], ["mm"]),
        helper.make_node("Reshape", ["mm", "back"], ["proj"]),
        helper.make_node("Add", ["proj", "residual"], ["y"]),
    ]
    rng = np.random.default_rng(9)
    w = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    model = make_model(nodes, [tensor_info("heads", shape=[1, 2, 5, 4]), tensor_info("residual", shape=[1, 5, 6])],
                       [tensor_info("y", shape=[1, 5, 6])],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), _const("flat", [-1, 8]),
                        _const("back", [1, 5, 6])], opset=17)
    sess = _session(model)
    ops = _ops(sess)
    assert "Gemm" not in ops and "FusedMatMul" in ops and "Add" not in ops, ops
    heads = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    residual = rng.standard_normal((1, 5, 6)).astype(np.float32)
    view = heads.astype(np.float64).transpose(0, 2, 1, 3).reshape(-1, 8)
    want = (view @ w + b).reshape(1, 5, 6) + residual
    np.testing.assert_allclose(sess.run(None, {"heads": heads, "residual": residual})[0], want, rtol=1e-5, atol=1e-5)


# -- ConvNeXt's layer scale ------------------------------------------------------------------------

def _layer_scale_model(scale_first: bool, scale_shape, residual: bool, shared_weight: bool = False):
    """ConvNeXt's block tail, channels last: x [1, 3, 3, 8] @ W [8, 4] + b, times a constant layer scale
    (TorchScript and dynamo both write Mul(scale, product); the other order too), then back to channels first
    and + the block's input (or, ``residual``, + a channels-last residual straight after the product)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["b", "mm"], ["biased"]),
        helper.make_node("Mul", ["scale", "biased"] if scale_first else ["biased", "scale"], ["scaled"]),
    ]
    if residual:
        nodes.append(helper.make_node("Add", ["scaled", "r"], ["y"]))
        inputs = [tensor_info("x", shape=[1, 3, 3, 8]), tensor_info("r", shape=[1, 3, 3, 4])]
        out = tensor_info("y", shape=None if len(scale_shape) > 4 else [1, 3, 3, 4])
    else:
        nodes += [helper.make_node("Transpose", ["scaled"], ["t"], perm=[0, 3, 1, 2]),
                  helper.make_node("Add", ["r", "t"], ["y"])]
        inputs = [tensor_info("x", shape=[1, 3, 3, 8]), tensor_info("r", shape=[1, 4, 3, 3])]
        out = tensor_info("y", shape=[1, 4, 3, 3])
    outputs = [out]
    if shared_weight:  # the same weight read unscaled elsewhere keeps its values
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["plain"]))
        outputs.append(tensor_info("plain", shape=[1, 3, 3, 4]))
    rng = np.random.default_rng(12)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    scale = (rng.standard_normal(scale_shape) * 1e-2).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"), numpy_helper.from_array(scale, "scale")]
    return make_model(nodes, inputs, outputs, inits, opset=17), w, b, scale


def _layer_scale_reference(w, b, scale, x, r, residual):
    product = (x.astype(np.float64) @ w.astype(np.float64) + b) * scale.astype(np.float64)
    return product + r if residual else product.transpose(0, 3, 1, 2) + r


@pytest.mark.parametrize("scale_first", [True, False])
@pytest.mark.parametrize("scale_shape", [(4,), (1, 1, 1, 4)])
@pytest.mark.parametrize("residual", [False, True])
def test_a_constant_column_scale_after_a_biased_product_folds_into_its_weights(scale_first, scale_shape, residual):
    model, w, b, scale = _layer_scale_model(scale_first, scale_shape, residual, shared_weight=True)
    sess = _session(model)
    fused = [n for n in sess.model.graph.nodes if n.op_type == "FusedMatMul"]
    assert len(fused) == 1 and "Mul" not in [n.op_type for n in sess.model.graph.nodes], _ops(sess)
    assert residual == (len(fused[0].inputs) == 4)
    rng = np.random.default_rng(13)
    for _ in range(2):
        x = rng.standard_normal((1, 3, 3, 8)).astype(np.float32)
        r = rng.standard_normal((1, 3, 3, 4) if residual else (1, 4, 3, 3)).astype(np.float32)
        y, plain = sess.run(None, {"x": x, "r": r})
        np.testing.assert_allclose(y, _layer_scale_reference(w, b, scale, x, r, residual), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(plain, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale_shape", [(3, 1, 4), (1, 3, 1, 1), (1, 1, 1, 1, 4)])
def test_a_scale_that_varies_along_other_axes_or_grows_the_rank_stays_a_product(scale_shape):
    model, w, b, scale = _layer_scale_model(True, scale_shape, residual=True)
    sess = _session(model)
    assert "Mul" in _ops(sess), _ops(sess)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((1, 3, 3, 8)).astype(np.float32)
    r = rng.standard_normal((1, 3, 3, 4)).astype(np.float32)
    want = _layer_scale_reference(w, b, scale, x, r, True)
    got = sess.run(None, {"x": x, "r": r})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
