"""Graphs specialized per input signature (session/specialize.py): shape subgraphs fold, the results equal the
generic plan's, a decode loop's growing dimension becomes symbolic after its second length, and what cannot be
specialized runs the generic plan."""

from __future__ import annotations

import functools

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(5)
HIDDEN = 8


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


@functools.cache
def _model():
    """y = Reshape(x @ W, (batch, seq, 2, HIDDEN / 2)) with the target computed from Shape(x) the way exporters
    spell it (Shape -> Gather -> Unsqueeze -> Concat), plus a Range over the sequence length (a value onnx's
    inference cannot compute from its computed bounds) broadcast onto it; the past's length feeds the output's
    sum only through a Shape of a symbolic dimension."""
    inits = [_init("w", RNG.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)), _init("zero", np.array(0)),
             _init("one", np.array(1)), _init("axes0", np.array([0])), _init("heads", np.array([2])),
             _init("size", np.array([HIDDEN // 2])), _init("tail", np.array([1, 2]))]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["p"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"]),
        helper.make_node("Gather", ["shape", "one"], ["seq"]),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        helper.make_node("Unsqueeze", ["seq", "axes0"], ["seq1"]),
        helper.make_node("Concat", ["batch1", "seq1", "heads", "size"], ["target"], axis=0),
        helper.make_node("Reshape", ["p", "target"], ["r"]),
        helper.make_node("Range", ["zero", "seq", "one"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["positions_f", "tail"], ["positions_3"]),
        helper.make_node("Add", ["r", "positions_3"], ["y"]),
        helper.make_node("Shape", ["past"], ["past_shape"], start=1, end=2),
        helper.make_node("Cast", ["past_shape"], ["past_length"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["past"], ["past_total"], keepdims=0),
        helper.make_node("Add", ["past_total", "past_length"], ["z"]),
    ]
    inputs = [tensor_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
              tensor_info("past", TensorProto.FLOAT, ["batch", "past_len"])]
    outputs = [tensor_info("y", TensorProto.FLOAT, None), tensor_info("z", TensorProto.FLOAT, None)]
    return make_model(nodes, inputs, outputs, inits, opset=17).SerializeToString()


def _feeds(batch, seq, past):
    return {"x": RNG.standard_normal((batch, seq, HIDDEN)).astype(np.float32),
            "past": RNG.standard_normal((batch, past)).astype(np.float32)}


def _expected(sess_generic, feeds):
    return sess_generic.run(None, feeds)


def _session(**config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(_model(), options, providers=["cpu"])


def _ops(graph):
    return [node.op_type for node in graph.nodes]


def test_a_signature_folds_the_shape_subgraphs_and_gives_the_generic_results():
    sess, generic = _session(), _session(**{"session.specialize_shapes": "0"})
    assert generic.graph_for(_feeds(2, 3, 4)) is generic.model.graph and "Shape" in _ops(generic.model.graph)
    feeds = _feeds(2, 3, 4)
    for got, want in zip(sess.run(None, feeds), generic.run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    ops = _ops(sess.graph_for(feeds))
    assert not {"Shape", "Gather", "Concat", "Range"} & set(ops), ops


def test_a_dimension_that_changes_becomes_symbolic_and_one_plan_serves_every_length():
    sess, generic = _session(), _session(**{"session.specialize_shapes": "0"})
    specializer = sess._specializer
    first = sess.graph_for(_feeds(1, 1, 4))
    for past in (5, 6, 9):  # a decode loop: the past grows, the step stays one token
        feeds = _feeds(1, 1, past)
        for got, want in zip(sess.run(None, feeds), generic.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    symbolic = sess.graph_for(_feeds(1, 1, 12))
    assert symbolic is not first and sess.graph_for(_feeds(1, 1, 20)) is symbolic
    assert len(specializer._templates) == 1 and len(specializer._exact) == 1
    ops = _ops(symbolic)
    # The token's shapes are still known: their subgraph folds; the past's length is read at run time.
    assert "Concat" not in ops and "Range" not in ops and "Shape" in ops, ops
    assert sess.graph_for(_feeds(2, 1, 12)) is not symbolic  # another batch: not the template's


def test_symbols_shared_by_dimensions_that_agreed_hold_only_while_they_agree():
    from onnx_runtime.session.shape_program import Template

    template = Template(((1, (0, 0)), ((0, 0), 8)), 1)
    assert template.matches(((1, 5), (5, 8)))
    assert not template.matches(((1, 5), (6, 8)))
    assert not template.matches(((2, 5), (5, 8)))
    assert not template.matches(((1, 5, 1), (5, 8)))


def test_specializations_are_bounded_and_then_the_generic_plan_runs(monkeypatch):
    from onnx_runtime.session import specialize

    monkeypatch.setattr(specialize, "LIMIT", 2)
    sess, generic = _session(), _session(**{"session.specialize_shapes": "0"})
    for batch in (1, 2, 3, 4):  # batch and seq both change: exact, then a template, then the bound
        feeds = _feeds(batch, batch + 1, 3)
        for got, want in zip(sess.run(None, feeds), generic.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    specializer = sess._specializer
    assert len(specializer._exact) + len(specializer._templates) <= 2


def test_static_inputs_and_disabled_optimization_need_no_specializer():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", TensorProto.FLOAT, [2, 3])],
                       [tensor_info("y", TensorProto.FLOAT, None)])
    assert ort.InferenceSession(model.SerializeToString(), providers=["cpu"])._specializer is None
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert ort.InferenceSession(_model(), options, providers=["cpu"])._specializer is None


def test_a_failed_specialization_warns_once_and_runs_the_generic_plan(monkeypatch):
    sess = _session()
    monkeypatch.setattr(sess._specializer, "_prepare", lambda graph: 1 / 0)
    feeds = _feeds(1, 2, 3)
    with pytest.warns(RuntimeWarning, match="shape specialization failed"):
        got = sess.run(None, feeds)
    want = _session(**{"session.specialize_shapes": "0"}).run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert sess.graph_for(_feeds(1, 3, 3)) is sess.model.graph  # no second attempt: the generic plan


def test_closing_the_session_closes_its_specializations():
    sess = _session()
    sess.run(None, _feeds(1, 2, 3))
    sess.close()
    assert not sess._specializer._exact and not sess._specializer._templates


@functools.cache
def _guarded_model():
    """A model shaped like exported voice/streaming models: an If on a feed (a sample rate) whose branches pad
    ``x`` by computed amounts, then squeeze its last axis only when it is 1 (If(Shape(x)[-1] == 1)), and
    check the rank of the result before a reduction (If(Size(Shape(v)) == 2)). Nothing of this is constant
    until ``x``'s shape is known, and then only inside the branches."""
    def branch(prefix, scale):
        def guard(name, cond, then_nodes, then_out, source):
            then = helper.make_graph(then_nodes, f"{name}_then", [], [tensor_info(then_out, shape=None)])
            other = helper.make_graph([helper.make_node("Identity", [source], [f"{name}_id"])], f"{name}_else", [],
                                      [tensor_info(f"{name}_id", shape=None)])
            return helper.make_node("If", [cond], [f"{name}_v"], then_branch=then, else_branch=other)

        body = [
            helper.make_node("Concat", ["zeros2", "pad_amount"], [f"{prefix}_pads"], axis=0),
            helper.make_node("Pad", ["x", f"{prefix}_pads"], [f"{prefix}_padded"]),
            helper.make_node("Shape", [f"{prefix}_padded"], [f"{prefix}_shape"]),
            helper.make_node("Gather", [f"{prefix}_shape", "last"], [f"{prefix}_dim"]),
            helper.make_node("Equal", [f"{prefix}_dim", "one"], [f"{prefix}_is_one"]),
            helper.make_node("Squeeze", [f"{prefix}_is_one"], [f"{prefix}_cond"]),
            guard(f"{prefix}_sq", f"{prefix}_cond",
                  [helper.make_node("Squeeze", [f"{prefix}_padded", "last"], [f"{prefix}_squeezed"])],
                  f"{prefix}_squeezed", f"{prefix}_padded"),
            helper.make_node("Shape", [f"{prefix}_sq_v"], [f"{prefix}_vshape"]),
            helper.make_node("Size", [f"{prefix}_vshape"], [f"{prefix}_rank"]),
            helper.make_node("Equal", [f"{prefix}_rank", "two"], [f"{prefix}_is_matrix"]),
            guard(f"{prefix}_mx", f"{prefix}_is_matrix",
                  [helper.make_node("Unsqueeze", [f"{prefix}_sq_v", "last"], [f"{prefix}_lifted"])],
                  f"{prefix}_lifted", f"{prefix}_sq_v"),
            helper.make_node("Mul", [f"{prefix}_mx_v", scale], [f"{prefix}_scaled"]),
            helper.make_node("ReduceSum", [f"{prefix}_scaled", "last"], [f"{prefix}_out"], keepdims=0),
        ]
        return helper.make_graph(body, prefix, [], [tensor_info(f"{prefix}_out", shape=None)])

    nodes = [helper.make_node("Equal", ["rate", "rate_16k"], ["is_16k"]),
             helper.make_node("If", ["is_16k"], ["y"], then_branch=branch("wide", "two_f"),
                              else_branch=branch("narrow", "three_f"))]
    inits = [_init("zeros2", np.zeros(3, np.int64)), _init("pad_amount", np.array([0, 0, 0], np.int64)),
             _init("last", np.array([-1], np.int64)), _init("one", np.array([1], np.int64)),
             _init("two", np.array(2, np.int64)), _init("rate_16k", np.array(16000, np.int64)),
             _init("two_f", np.array(2, np.float32)), _init("three_f", np.array(3, np.float32))]
    inputs = [tensor_info("x", TensorProto.FLOAT, ["a", "b", "c"]), tensor_info("rate", TensorProto.INT64, [])]
    return make_model(nodes, inputs, [tensor_info("y", TensorProto.FLOAT, None)], inits, opset=17).SerializeToString()


def _branch_ops(graph):
    ops = []
    for node in graph.walk():
        ops.append(node.op_type)
    return ops


@pytest.mark.parametrize("shape", [(2, 4, 1), (2, 4, 3), (4, 1, 1)])
def test_shape_guards_inside_branches_fold_once_the_shapes_are_known(shape):
    sess = ort.InferenceSession(_guarded_model(), providers=["cpu"])
    generic = _session_of(_guarded_model(), **{"session.specialize_shapes": "0"})
    x = RNG.standard_normal(shape).astype(np.float32)
    for rate in (16000, 8000):
        feeds = {"x": x, "rate": np.array(rate, np.int64)}
        got, want = sess.run(None, feeds)[0], generic.run(None, feeds)[0]
        squeezed = x[..., 0] if shape[-1] == 1 else x
        lifted = squeezed[..., None] if squeezed.ndim == 2 else squeezed
        np.testing.assert_allclose(got, (lifted * (2 if rate == 16000 else 3)).sum(-1), rtol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    ops = _branch_ops(sess.graph_for(feeds))
    assert ops.count("If") == 1 and not {"Shape", "Size", "Gather", "Equal"} & set(ops[2:]), ops
    assert "If" in _branch_ops(generic.graph_for(feeds))[2:]  # generically, the guards stay


def _session_of(model, **config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(model, options, providers=["cpu"])


@functools.cache
def _chunk_model():
    """A channel chunk as torch's exporter writes it for a dynamic shape: the bound ``Mul(Div(C, 2), 1)`` ends a
    Slice, and a Reshape reads the slice's own Shape. The optimized graph drops the multiplication by one, so the
    bound's value exists only as the model's node, which the model's inference reads."""
    inits = [_init("one", np.array(1)), _init("two", np.array(2)), _init("axes0", np.array([0])),
             _init("start", np.array([0])), _init("channel_axis", np.array([1])), _init("gather0", np.array(0)),
             _init("gather2", np.array(2)), _init("groups", np.array([2])), _init("minus1", np.array([-1]))]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "channel_axis"], ["channels"]),
        helper.make_node("Div", ["channels", "two"], ["half"]),
        helper.make_node("Mul", ["half", "one"], ["bound"]),
        helper.make_node("Slice", ["x", "start", "bound", "channel_axis"], ["chunk"]),
        helper.make_node("Relu", ["chunk"], ["active"]),
        helper.make_node("Shape", ["active"], ["active_shape"]),
        helper.make_node("Gather", ["active_shape", "gather0"], ["batch"]),
        helper.make_node("Gather", ["active_shape", "gather2"], ["length"]),
        helper.make_node("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        helper.make_node("Unsqueeze", ["length", "axes0"], ["length1"]),
        helper.make_node("Concat", ["batch1", "groups", "minus1", "length1"], ["target"], axis=0),
        helper.make_node("Reshape", ["active", "target"], ["y"]),
    ]
    inputs = [tensor_info("x", TensorProto.FLOAT, ["batch", "channels", "length"])]
    return make_model(nodes, inputs, [tensor_info("y", TensorProto.FLOAT, None)], inits, opset=17).SerializeToString()


def test_values_the_optimized_graph_dropped_are_computed_from_the_model_and_the_shapes_fold():
    sess = ort.InferenceSession(_chunk_model(), providers=["cpu"])
    x = RNG.standard_normal((2, 8, 5)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    want = np.maximum(x[:, :4].astype(np.float64), 0).reshape(2, 2, 2, 5)
    assert y.shape == want.shape and np.abs(y - want).max() == 0
    ops = _ops(sess.graph_for({"x": x}))
    assert not {"Shape", "Gather", "Div", "Concat"} & set(ops), ops
