"""The generic graph optimizer: each pass on small graphs (the rewritten node list, and outputs equal to
the unoptimized session's on random inputs), optimization levels, subgraphs, and the light models."""

from __future__ import annotations

import os

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import LIGHT_DIR, make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

LEVEL = ort.GraphOptimizationLevel
RNG = np.random.default_rng(0)


def _session(model, level=LEVEL.ORT_ENABLE_ALL, **kwargs):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    data = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=["cpu"], **kwargs)


def _random_feeds(sess):
    feeds = {}
    for arg in sess.get_inputs():
        shape = [d if isinstance(d, int) else 3 for d in arg.shape]
        dtype = np.float64 if arg.type == "tensor(double)" else np.float32
        feeds[arg.name] = RNG.standard_normal(shape).astype(dtype)
    return feeds


def _optimized(model, level=LEVEL.ORT_ENABLE_ALL, rtol=1e-5, atol=1e-6, **kwargs):
    """The session at ``level``, after checking its outputs against the unoptimized session's."""
    sess, plain = _session(model, level, **kwargs), _session(model, LEVEL.ORT_DISABLE_ALL)
    feeds = _random_feeds(plain)
    for got, want in zip(sess.run(None, feeds), plain.run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return sess


def _ops(sess):
    """The graph's operators in order; a FusedSegment (the CPU provider's last pass) as the nodes of its body."""
    ops = []
    for node in sess.model.graph.nodes:
        ops.extend([n.op_type for n in node.attr("body").nodes] if node.op_type == "FusedSegment" else [node.op_type])
    return ops


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _check_value_info(graph, outer=False):
    """value_info describes exactly the values that exist (inputs, outputs, initializers, node outputs, and in a
    subgraph the outer values it reads)."""
    existing = {vi.name for vi in graph.inputs + graph.outputs} | set(graph.initializers)
    existing |= {out for node in graph.nodes for out in node.outputs if out}
    if outer:
        existing |= set(graph.outer_names)
    assert set(graph.value_info) <= existing, set(graph.value_info) - existing


# -- constant folding --------------------------------------------------------------------------------
def test_constant_chains_fold_into_one_initializer():
    value = helper.make_tensor("v", TensorProto.FLOAT, [4], [1, 2, 3, 4])
    nodes = [
        helper.make_node("Constant", [], ["c"], value=value),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("o", 1, [1], [2])),
        helper.make_node("Mul", ["c", "ones"], ["scale"]),
        helper.make_node("Mul", ["x", "scale"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[3, 4])], [tensor_info("y", shape=[3, 4])],
                       [_init("shape", np.array([3, 4], np.int64))])
    sess = _optimized(model)
    assert _ops(sess) == ["Mul"]
    graph = sess.model.graph
    np.testing.assert_array_equal(graph.initializers["scale"], np.full((3, 4), [2, 4, 6, 8], np.float32))
    assert set(graph.initializers) == {"scale"}  # the inputs of the fold are dead and gone
    assert not graph.initializers["scale"].flags.writeable
    assert sess.applied_passes() == ["optimizer:fold_constants", "optimizer:remove_dead_nodes"]
    _check_value_info(graph)


def test_a_static_shape_chain_folds_away_and_leaves_the_reshape():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [_init("zero", np.array(0, np.int64)), _init("zero1", np.array([0], np.int64)),
             _init("minus_one", np.array([-1], np.int64))]
    model = make_model(nodes, [tensor_info("x", shape=[2, 3, 4])], [tensor_info("y")], inits)
    sess = _optimized(model)
    assert _ops(sess) == ["Reshape"]
    np.testing.assert_array_equal(sess.model.graph.initializers["target"], [2, -1])


def test_shape_of_a_symbolic_dimension_is_not_folded():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=["n", 6])], [tensor_info("y")])
    sess = _optimized(model)
    assert _ops(sess) == ["Shape", "Reshape"]


def test_shape_with_start_and_end_and_size_fold_from_static_shapes():
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], start=-2, end=10),
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "sf"], ["xs"]),
        helper.make_node("Add", ["xs", "nf"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[3, 4, 2])], [tensor_info("y", shape=[3, 4, 2])])
    sess = _optimized(model)
    assert _ops(sess) == ["Mul", "Add"]
    np.testing.assert_array_equal(sess.model.graph.initializers["sf"], [4, 2])
    np.testing.assert_array_equal(sess.model.graph.initializers["nf"], 24)


def test_random_operators_and_graph_outputs_are_not_folded():
    nodes = [
        helper.make_node("RandomNormal", [], ["noise"], shape=[2], seed=1.0),
        helper.make_node("Mul", ["noise", "zero"], ["zeroed"]),
        helper.make_node("Add", ["x", "zeroed"], ["y"]),
        helper.make_node("Add", ["a", "a"], ["twice"]),  # constant, but a graph output
    ]
    model = make_model(nodes, [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2]), tensor_info("twice")],
                       [_init("zero", np.zeros(2, np.float32)), _init("a", np.ones(2, np.float32))])
    sess = _session(model)
    assert _ops(sess) == ["RandomNormal", "Mul", "Add", "Add"]
    y, twice = sess.run(None, {"x": np.ones(2, np.float32)})
    twice += 1  # a fresh array per run, not a shared read-only constant
    np.testing.assert_array_equal(sess.run(None, {"x": np.ones(2, np.float32)})[1], [2, 2])


def test_constant_of_shape_folds_without_a_provider_round_trip(monkeypatch):
    from onnx_runtime.optimizer.context import PassContext

    evaluated = []
    real = PassContext.evaluate
    monkeypatch.setattr(PassContext, "evaluate", lambda self, node, *a: evaluated.append(node.op_type) or real(
        self, node, *a))
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["sevens"], value=helper.make_tensor("v", TensorProto.INT32,
                                                                                            [1], [7])),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),  # float32 zero without a value
        helper.make_node("Cast", ["sevens"], ["cast"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "cast"], ["xs"]),
        helper.make_node("Add", ["xs", "zeros"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[2, 3])], [tensor_info("y", shape=[2, 3])],
                       [_init("shape", np.array([2, 3], np.int64))])
    sess = _optimized(model, level=LEVEL.ORT_ENABLE_BASIC)
    assert _ops(sess) == ["Add", "Add"]
    assert evaluated == ["Cast"]  # the fills were made here, the Cast by the provider's kernel
    np.testing.assert_array_equal(sess.model.graph.initializers["zeros"], np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(sess.model.graph.initializers["cast"], np.full((2, 3), 7, np.float32))


def test_constant_of_shape_with_a_negative_dim_is_left_to_the_run():
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["filled"]),
             helper.make_node("Add", ["x", "filled"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[3])], [tensor_info("y", shape=None)],
                       [_init("shape", np.array([-3], np.int64))])
    sess = _session(model, LEVEL.ORT_ENABLE_ALL)
    assert "ConstantOfShape" in _ops(sess)
    with pytest.raises(Exception, match="negative|-3"):
        sess.run(None, {"x": np.ones(3, np.float32)})


def test_large_results_fold_only_when_generated_or_replacing_their_inputs():
    big = [2048, 4096]  # 32 MiB of float32, over the 16 MiB limit
    row = _init("row", np.ones((1, 4096), np.float32))  # 16 KiB: not tiny
    nodes = [
        helper.make_node("ConstantOfShape", ["big_shape"], ["filled"], value=helper.make_tensor("v", 1, [1], [0.5])),
        helper.make_node("Tile", ["row", "reps"], ["tiled"]),  # 32 MiB from a row another node reads too
        helper.make_node("Add", ["filled", "tiled"], ["sum"]),
        helper.make_node("Add", ["x", "row"], ["xr"]),
        helper.make_node("Mul", ["sum", "xr"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[1, 4096])], [tensor_info("y", shape=big)],
                       [row, _init("big_shape", np.array(big, np.int64)), _init("reps", np.array([2048, 1], np.int64))])
    sess = _optimized(model)
    assert _ops(sess) == ["Tile", "Add", "Add", "Mul"]
    assert sess.model.graph.initializers["filled"].shape == tuple(big)


@pytest.mark.parametrize("op, inputs, attrs", [
    ("ConstantOfShape", [np.array([1 << 16, 1 << 16], np.int64)], {}),            # 16 GiB of float32 zeros
    ("Tile", [np.ones((1, 4), np.float32), np.array([1 << 31, 1 << 20], np.int64)], {}),
    ("Expand", [np.ones((1, 1), np.float32), np.array([1 << 20, 1 << 16], np.int64)], {}),
    ("Range", [np.int64(0), np.int64(1 << 40), np.int64(1)], {}),                  # 1-D: data propagation too
    ("ConstantOfShape", [np.array([1 << 40], np.int64)], {}),
    ("Tile", [np.ones(4, np.int64), np.array([1 << 40], np.int64)], {}),
    ("Expand", [np.ones(1, np.int64), np.array([1 << 40], np.int64)], {}),
    ("OneHot", [np.arange(4, dtype=np.int64), np.int64(1 << 30), np.array([0, 1], np.float32)], {}),
])
def test_folding_never_generates_a_huge_constant_at_creation(monkeypatch, op, inputs, attrs):
    """Generated from tiny constants, these would be gigabytes: session creation leaves them to the run
    (creation used to materialize a ConstantOfShape of any size), neither filling nor evaluating them."""
    from onnx_runtime.optimizer.context import PassContext

    evaluated = []
    real = PassContext.evaluate
    monkeypatch.setattr(PassContext, "evaluate", lambda self, node, *a: evaluated.append(node.op_type) or real(
        self, node, *a))
    names = [f"in{i}" for i in range(len(inputs))]
    model = make_model([helper.make_node(op, names, ["big"], **attrs), helper.make_node("Size", ["big"], ["n"]),
                        helper.make_node("Add", ["x", "n"], ["y"])],
                       [tensor_info("x", TensorProto.INT64, shape=[1])],
                       [tensor_info("y", TensorProto.INT64, shape=[1])],
                       [_init(name, value) for name, value in zip(names, inputs)])
    sess = _session(model)  # the Size may fold from the static shape, which leaves the generator dead
    assert op not in evaluated
    assert all(array.nbytes < (1 << 20) for array in sess.model.graph.initializers.values())


def _filled(name, shape_name, value):
    return helper.make_node("ConstantOfShape", [shape_name], [name],
                            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [value]))


def test_large_generated_weights_every_run_reads_fold_once_within_the_session_budget(monkeypatch):
    """Past MAX_GENERATED_BYTES a generated constant is made at creation only when the main graph's live nodes
    read it (every run would make it again), and only while the session's LARGE_GENERATED_BUDGET lasts."""
    from onnx_runtime.optimizer import constant_folding

    monkeypatch.setattr(constant_folding, "MAX_GENERATED_BYTES", 64 << 10)
    monkeypatch.setattr(constant_folding, "LARGE_GENERATED_BUDGET", 256 << 10)
    filled, real = [], constant_folding.filled_value

    def spy(node, *args):
        value = real(node, *args)
        if value is not None:
            filled.append(node.outputs[0])
        return value

    monkeypatch.setattr(constant_folding, "filled_value", spy)
    nodes = [
        _filled("w1", "shape1", 0.02),                                    # 128 KiB: within the budget
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Expand", ["half", "shape2"], ["w2"]),           # 200 KiB: past what is left of it
        helper.make_node("MatMul", ["h", "w2"], ["y"]),
        _filled("unread", "shape3", 1.0),                                 # 100 KiB whose size alone is read
        helper.make_node("Size", ["unread"], ["n"]),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["y", "nf"], ["z"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[2, 128])], [tensor_info("z", shape=[2, 200])],
                       [_init("shape1", np.array([128, 256], np.int64)),
                        _init("shape2", np.array([256, 200], np.int64)),
                        _init("half", np.full((1, 1), 0.5, np.float32)),
                        _init("shape3", np.array([100, 256], np.int64))])
    sess = _optimized(model, rtol=1e-5, atol=1e-4)
    assert "unread" not in filled  # the Size folded first, from the static shape, and nothing else reads it
    initializers = sess.model.graph.initializers
    np.testing.assert_array_equal(initializers["w1"], np.full((128, 256), 0.02, np.float32))
    assert "w2" not in initializers and "Expand" in _ops(sess)
    assert all(array.shape != (100, 256) for array in initializers.values())
    x = RNG.standard_normal((2, 128))
    want = x.astype(np.float32).astype(np.float64) @ np.full((128, 256), np.float32(0.02), np.float64) \
        @ np.full((256, 200), 0.5) + 100 * 256
    np.testing.assert_allclose(sess.run(None, {"x": x.astype(np.float32)})[0], want, rtol=1e-5)


def test_large_generated_constants_in_a_branch_are_left_to_the_run(monkeypatch):
    """A branch may not run: what it generates past MAX_GENERATED_BYTES is not made at creation."""
    from onnx_runtime.optimizer import constant_folding

    monkeypatch.setattr(constant_folding, "MAX_GENERATED_BYTES", 64 << 10)
    monkeypatch.setattr(constant_folding, "LARGE_GENERATED_BUDGET", 1 << 20)

    def branch(name, value):
        body = [_filled(f"{name}_w", "shape", value), helper.make_node("MatMul", ["x", f"{name}_w"], [f"{name}_y"])]
        return helper.make_graph(body, name, [], [tensor_info(f"{name}_y", shape=[2, 256])])

    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=branch("then", 1.0),
                              else_branch=branch("else", 2.0))]
    model = make_model(nodes, [tensor_info("x", shape=[2, 128]), tensor_info("flag", TensorProto.BOOL, shape=[])],
                       [tensor_info("y", shape=[2, 256])], [_init("shape", np.array([128, 256], np.int64))])
    sess = _session(model)
    for node in sess.model.graph.nodes:
        for sub in node.subgraphs():
            assert all(array.nbytes < (64 << 10) for array in sub.initializers.values())
    x = RNG.standard_normal((2, 128)).astype(np.float32)
    for flag, value in ((True, 1.0), (False, 2.0)):
        got = sess.run(None, {"x": x, "flag": np.array(flag)})[0]
        np.testing.assert_allclose(got, np.repeat(x.astype(np.float64).sum(1, keepdims=True) * value, 256, 1),
                                   rtol=1e-5)


# -- dead nodes and identities ----------------------------------------------------------------------------
def test_dead_nodes_and_unread_initializers_are_removed():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Add", ["x", "unused_weight"], ["dead1"]),
        helper.make_node("Exp", ["dead1"], ["dead2"]),
        helper.make_node("Neg", ["r"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[3])], [tensor_info("y", shape=[3])],
                       [_init("unused_weight", np.ones(3, np.float32))])
    sess = _optimized(model, LEVEL.ORT_ENABLE_BASIC)
    assert _ops(sess) == ["Relu", "Neg"]
    assert sess.model.graph.initializers == {}
    assert sess.applied_passes() == ["optimizer:remove_dead_nodes"]
    _check_value_info(sess.model.graph)


def test_identities_are_bypassed_and_graph_outputs_keep_their_names():
    nodes = [
        helper.make_node("Identity", ["x"], ["i1"]),
        helper.make_node("Relu", ["i1"], ["r"]),
        helper.make_node("Identity", ["r"], ["i2"]),
        helper.make_node("Neg", ["i2"], ["n"]),
        helper.make_node("Identity", ["n"], ["y"]),  # a graph output: Neg takes over its name
        helper.make_node("Identity", ["x"], ["x_copy"]),  # graph input to graph output: must stay
        helper.make_node("Identity", ["y"], ["y_copy"]),  # graph output to graph output: must stay
    ]
    names = ["y", "x_copy", "y_copy"]
    model = make_model(nodes, [tensor_info("x", shape=[4])], [tensor_info(n, shape=[4]) for n in names])
    sess = _optimized(model, LEVEL.ORT_ENABLE_BASIC)
    graph = sess.model.graph
    assert [(n.op_type, n.inputs, n.outputs) for n in graph.nodes] == [
        ("Relu", ["x"], ["r"]), ("Neg", ["r"], ["y"]), ("Identity", ["x"], ["x_copy"]), ("Identity", ["y"], ["y_copy"]),
    ]
    assert [o.name for o in sess.get_outputs()] == names
    _check_value_info(graph)


def test_inference_dropout_is_removed_but_training_dropout_and_read_masks_stay():
    nodes = [
        helper.make_node("Dropout", ["x", "ratio"], ["d1"]),
        helper.make_node("Dropout", ["d1", "ratio", "off"], ["d2", "unread_mask"]),
        helper.make_node("Dropout", ["d2", "ratio", "on"], ["d3"], seed=3),
        helper.make_node("Dropout", ["d3"], ["y", "mask"]),
    ]
    inits = [_init("ratio", np.array(0.5, np.float32)), _init("off", np.array(False)), _init("on", np.array(True))]
    model = make_model(nodes, [tensor_info("x", shape=[8])],
                       [tensor_info("y", shape=[8]), tensor_info("mask", TensorProto.BOOL, [8])], inits)
    sess = _session(model)
    assert [(n.inputs[0], n.outputs) for n in sess.model.graph.nodes] == [("x", ["d3"]), ("d3", ["y", "mask"])]


def test_dropout_before_opset_12_is_removed():
    nodes = [helper.make_node("Dropout", ["x"], ["d"], ratio=0.3), helper.make_node("Relu", ["d"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[5])], [tensor_info("y", shape=[5])], opset=9)
    assert _ops(_optimized(model)) == ["Relu"]


# -- subgraphs --------------------------------------------------------------------------------------------
def test_subgraphs_are_optimized_and_keep_their_outer_reads():
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])

    def branch(name, op):
        body = [
            helper.make_node("Constant", [], [f"{name}_c"], value=two),
            helper.make_node("Mul", [f"{name}_c", f"{name}_c"], [f"{name}_k"]),
            helper.make_node(op, ["t", f"{name}_k"], [f"{name}_out"]),
        ]
        return helper.make_graph(body, name, [], [tensor_info(f"{name}_out", shape=[3])])

    nodes = [
        helper.make_node("Identity", ["x"], ["t"]),  # read by name inside the branches: must stay
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["y"],
                         then_branch=branch("then", "Add"), else_branch=branch("else", "Sub")),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[3])], [tensor_info("y", shape=[3])],
                       [_init("zero", np.array(0, np.float32))])
    sess = _optimized(model)
    graph = sess.model.graph
    assert _ops(sess) == ["Identity", "ReduceSum", "Greater", "If"]
    for sub in graph.nodes[-1].subgraphs():
        assert [n.op_type for n in sub.nodes] in (["Add"], ["Sub"])
        assert sub.outer_names == ["t"]
        np.testing.assert_array_equal(sub.initializers[f"{sub.name}_k"], 4.0)
    for x in (np.ones(3, np.float32), -np.ones(3, np.float32)):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + 4 if x.sum() > 0 else x - 4)


def _constant_branch(name, value):
    body = [helper.make_node("Constant", [], [f"{name}_v"], value=helper.make_tensor("v", 1, [1], [value]))]
    return helper.make_graph(body, name, [], [tensor_info(f"{name}_v", shape=[1])])


@pytest.mark.parametrize("flag", [True, False])
def test_an_if_with_a_constant_condition_becomes_the_branch_it_takes(flag):
    nodes = [helper.make_node("If", ["flag"], ["k"], then_branch=_constant_branch("then", 1.0),
                              else_branch=_constant_branch("else", 2.0)),
             helper.make_node("Add", ["x", "k"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])],
                       [_init("flag", np.array(flag))])
    sess = _optimized(model)
    assert _ops(sess) == ["Add"]
    x = np.array([1.0, -1.0], np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + (1.0 if flag else 2.0))
    _check_value_info(sess.model.graph)


def test_an_if_decided_by_a_static_shape_inside_a_branch_is_inlined_there():
    """Exporters guard squeezes with If(Shape(x)[-1] == 1): in a branch of an If the optimizer cannot decide
    (its condition is a feed), the outer value's static shape still decides the inner one."""
    def squeeze_guard(prefix):
        inner_then = helper.make_graph([helper.make_node("Squeeze", ["x", "last"], [f"{prefix}_sq"])],
                                       f"{prefix}_then", [], [tensor_info(f"{prefix}_sq", shape=None)])
        inner_else = helper.make_graph([helper.make_node("Identity", ["x"], [f"{prefix}_id"])],
                                       f"{prefix}_else", [], [tensor_info(f"{prefix}_id", shape=None)])
        body = [helper.make_node("Shape", ["x"], [f"{prefix}_shape"]),
                helper.make_node("Gather", [f"{prefix}_shape", "last"], [f"{prefix}_dim"]),
                helper.make_node("Equal", [f"{prefix}_dim", "one"], [f"{prefix}_is_one"]),
                helper.make_node("Squeeze", [f"{prefix}_is_one"], [f"{prefix}_cond"]),
                helper.make_node("If", [f"{prefix}_cond"], [f"{prefix}_v"], then_branch=inner_then,
                                 else_branch=inner_else),
                helper.make_node("ReduceSum", [f"{prefix}_v"], [f"{prefix}_out"], keepdims=0)]
        return helper.make_graph(body, prefix, [], [tensor_info(f"{prefix}_out", shape=None)])

    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=squeeze_guard("a"), else_branch=squeeze_guard("b"))]
    model = make_model(nodes, [tensor_info("x", shape=[2, 1]), tensor_info("flag", TensorProto.BOOL, shape=[])],
                       [tensor_info("y", shape=None)],
                       [_init("last", np.array([-1], np.int64)), _init("one", np.array([1], np.int64))])
    sess = _session(model)
    for branch in sess.model.graph.nodes[0].subgraphs():
        assert [n.op_type for n in branch.nodes] == ["Squeeze", "ReduceSum"], branch.nodes
        assert branch.outer_names == ["last", "x"]
        _check_value_info(branch, outer=True)
    x = np.array([[1.5], [2.0]], np.float32)
    for flag in (True, False):
        np.testing.assert_allclose(sess.run(None, {"x": x, "flag": np.array(flag)})[0], 3.5)


def test_a_loop_is_not_folded_even_on_constant_inputs():
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc", "step"], ["acc_out"])],
        "body", [tensor_info("i", TensorProto.INT64, []), tensor_info("cond_in", TensorProto.BOOL, []),
                 tensor_info("acc", shape=[1])],
        [tensor_info("cond_out", TensorProto.BOOL, []), tensor_info("acc_out", shape=[1])])
    nodes = [helper.make_node("Loop", ["trips", "", "start"], ["k"], body=body),
             helper.make_node("Add", ["x", "k"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])],
                       [_init("trips", np.array(3, np.int64)), _init("start", np.zeros(1, np.float32)),
                        _init("step", np.ones(1, np.float32))])
    sess = _optimized(model)
    assert _ops(sess) == ["Loop", "Add"]
    np.testing.assert_array_equal(sess.run(None, {"x": np.zeros(2, np.float32)})[0], [3.0, 3.0])


# -- Conv and BatchNormalization fusions ---------------------------------------------------------------------
def _conv_model(followers, inits=(), conv_bias=True, output_shape=(1, 4, 5, 5), extra_outputs=()):
    inputs = ["x", "w", "b"] if conv_bias else ["x", "w"]
    nodes = [helper.make_node("Conv", inputs, ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])] + followers
    all_inits = [_init("w", RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)),
                 _init("b", RNG.standard_normal(4).astype(np.float32)), *inits]
    outputs = [tensor_info("y", shape=list(output_shape)), *extra_outputs]
    return make_model(nodes, [tensor_info("x", shape=[1, 3, 5, 5])], outputs, all_inits)


def _bn_params(prefix="bn", channels=4):
    return [_init(f"{prefix}_scale", RNG.uniform(0.5, 2, channels).astype(np.float32)),
            _init(f"{prefix}_bias", RNG.standard_normal(channels).astype(np.float32)),
            _init(f"{prefix}_mean", RNG.standard_normal(channels).astype(np.float32)),
            _init(f"{prefix}_var", RNG.uniform(0.5, 2, channels).astype(np.float32))]


def _bn(x, y, prefix="bn", **attrs):
    return helper.make_node("BatchNormalization", [x] + [f"{prefix}_{p}" for p in ("scale", "bias", "mean", "var")],
                            [y], epsilon=1e-3, **attrs)


@pytest.mark.parametrize("conv_bias", [True, False])
def test_conv_batchnorm_folds_into_the_conv(conv_bias):
    sess = _optimized(_conv_model([_bn("c", "y")], _bn_params(), conv_bias=conv_bias))
    graph = sess.model.graph
    assert [(n.op_type, n.outputs) for n in graph.nodes] == [("Conv", ["y"])]
    assert "optimizer:fuse_conv_batchnorm" in sess.applied_passes()
    assert len(graph.initializers) == 2 and "c" not in graph.value_info
    _check_value_info(graph)


def test_conv_per_channel_mul_and_add_fold_into_weights_and_bias():
    followers = [helper.make_node("Mul", ["scale", "c"], ["m"]), helper.make_node("Add", ["m", "shift"], ["y"])]
    inits = [_init("scale", RNG.standard_normal((4, 1, 1)).astype(np.float32)),
             _init("shift", RNG.standard_normal((1, 4, 1, 1)).astype(np.float32))]
    sess = _optimized(_conv_model(followers, inits))
    assert _ops(sess) == ["Conv"]
    assert {"optimizer:fuse_conv_mul", "optimizer:fuse_conv_add"} <= set(sess.applied_passes())


def test_conv_fusions_leave_non_channel_constants_shared_outputs_and_training_batchnorm():
    followers = [
        helper.make_node("Mul", ["c", "spatial"], ["m"]),  # varies over H and W: not a per-channel scale
        helper.make_node("Conv", ["m", "w2"], ["c2"], kernel_shape=[1, 1]),
        helper.make_node("BatchNormalization", ["c2", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
                         ["y", "running_mean", "running_var"], training_mode=1),
        helper.make_node("Conv", ["x", "w"], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c3", "one"], ["a3"]),  # c3 also read below: no fusion
        helper.make_node("Mul", ["c3", "a3"], ["z"]),
    ]
    inits = [_init("spatial", RNG.standard_normal((5, 5)).astype(np.float32)),
             _init("w2", RNG.standard_normal((4, 4, 1, 1)).astype(np.float32)),
             _init("one", np.ones(4, np.float32).reshape(4, 1, 1)), *_bn_params()]
    model = _conv_model(followers, inits, extra_outputs=[tensor_info("z", shape=[1, 4, 5, 5])])
    sess = _session(model)
    assert _ops(sess) == ["Conv", "Mul", "Conv", "BatchNormalization", "Conv", "Add", "Mul"]


def test_batchnorm_absorbs_following_per_channel_mul_and_add():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        _bn("r", "n"),
        helper.make_node("Mul", ["n", "gamma"], ["m"]),
        helper.make_node("Add", ["beta", "m"], ["y"]),
    ]
    inits = [*_bn_params(channels=3), _init("gamma", RNG.standard_normal((3, 1, 1)).astype(np.float32)),
             _init("beta", RNG.standard_normal((3, 1, 1)).astype(np.float32))]
    model = make_model(nodes, [tensor_info("x", shape=[2, 3, 4, 4])], [tensor_info("y", shape=[2, 3, 4, 4])], inits)
    sess = _optimized(model)
    assert [(n.op_type, n.outputs) for n in sess.model.graph.nodes] == [("Relu", ["r"]), ("BatchNormalization", ["y"])]
    _check_value_info(sess.model.graph)


# -- Gemm fusions ----------------------------------------------------------------------------------------
def test_matmul_add_becomes_gemm_for_static_2d_inputs_and_constant_weights():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["bias", "xw"], ["h"]),
        helper.make_node("MatMul", ["h", "v"], ["hv"]), helper.make_node("Add", ["hv", "x2"], ["y"]),  # x2 not constant
    ]
    inits = [_init("w", RNG.standard_normal((4, 5)).astype(np.float32)),
             _init("bias", RNG.standard_normal(5).astype(np.float32)),
             _init("v", RNG.standard_normal((5, 2)).astype(np.float32))]
    model = make_model(nodes, [tensor_info("x", shape=[3, 4]), tensor_info("x2", shape=[3, 2])],
                       [tensor_info("y", shape=[3, 2])], inits)
    sess = _optimized(model)
    graph = sess.model.graph
    assert [(n.op_type, n.inputs, n.outputs) for n in graph.nodes] == [
        ("Gemm", ["x", "w", "bias"], ["h"]), ("MatMul", ["h", "v"], ["hv"]), ("Add", ["hv", "x2"], ["y"]),
    ]
    assert sess.placement()[graph.nodes[0].name].provider == "CPUExecutionProvider"
    _check_value_info(graph)


def test_matmul_with_a_batched_or_dynamic_input_is_not_fused():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "bias"], ["y"])]
    inits = [_init("w", np.ones((4, 5), np.float32)), _init("bias", np.ones(5, np.float32))]
    for shape in ([2, 3, 4], ["n", 4]):
        model = make_model(nodes, [tensor_info("x", shape=shape)], [tensor_info("y")], inits)
        # No Gemm; the CPU provider's own pass may still join them (FusedMatMul takes any rank).
        assert "Gemm" not in _ops(_optimized(model))


def test_gemm_add_of_a_constant_joins_c_with_beta():
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], beta=0.5, transB=1),
             helper.make_node("Add", ["g", "d"], ["y"])]
    inits = [_init("w", RNG.standard_normal((5, 4)).astype(np.float32)),
             _init("c", RNG.standard_normal((1, 5)).astype(np.float32)),
             _init("d", RNG.standard_normal((3, 1)).astype(np.float32))]
    model = make_model(nodes, [tensor_info("x", shape=[3, 4])], [tensor_info("y", shape=[3, 5])], inits)
    sess = _optimized(model)
    (gemm,) = sess.model.graph.nodes
    assert gemm.op_type == "Gemm" and gemm.outputs == ["y"] and gemm.attrs["beta"] == 1.0
    assert sess.model.graph.initializers[gemm.inputs[2]].shape == (3, 5)


# -- levels and reporting -----------------------------------------------------------------------------------
def _level_model():
    nodes = [
        helper.make_node("Identity", ["w"], ["wi"]),
        helper.make_node("Conv", ["x", "wi"], ["c"], kernel_shape=[1, 1]),
        helper.make_node("Mul", ["c", "k"], ["y"]),
    ]
    inits = [_init("w", np.ones((2, 2, 1, 1), np.float32)), _init("k", np.full((2, 1, 1), 3, np.float32))]
    return make_model(nodes, [tensor_info("x", shape=[1, 2, 3, 3])], [tensor_info("y", shape=[1, 2, 3, 3])], inits)


@pytest.mark.parametrize("level, ops", [
    (LEVEL.ORT_DISABLE_ALL, ["Identity", "Conv", "Mul"]),
    (LEVEL.ORT_ENABLE_BASIC, ["Conv", "Mul"]),
    (LEVEL.ORT_ENABLE_EXTENDED, ["Conv"]),
    (LEVEL.ORT_ENABLE_ALL, ["Conv"]),
])
def test_the_optimization_level_selects_the_passes(level, ops):
    sess = _optimized(_level_model(), level)
    assert _ops(sess) == ops
    assert (sess.applied_passes() == []) == (level == LEVEL.ORT_DISABLE_ALL)


def test_disabled_optimizers_are_skipped():
    sess = _optimized(_level_model(), disabled_optimizers=["fuse_conv_mul", "optimizer:fold_constants"])
    assert _ops(sess) == ["Conv", "Mul"]
    assert "optimizer:fuse_conv_mul" not in sess.applied_passes()


# -- real models ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["light_densenet121", "light_inception_v2", "light_shufflenet"])
def test_light_models_match_the_unoptimized_session_on_random_input(name):
    path = os.path.join(LIGHT_DIR, f"{name}.onnx")
    sess = _optimized(path, rtol=1e-4, atol=1e-4)
    plain_nodes = len(_session(path, LEVEL.ORT_DISABLE_ALL).model.graph.nodes)
    assert len(sess.model.graph.nodes) < plain_nodes / 2
    assert not any(n.op_type == "ConstantOfShape" for n in sess.model.graph.nodes)


def _linear_model(trans_b: bool, bias: bool, leading=(2, 3)):
    """Reshape(x, (-1, K)) -> Gemm -> Reshape(., (*leading, N)): PyTorch's Linear as exported."""
    k, n = 8, 5
    w = RNG.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    inits = [_init("w", w), _init("flat", np.array([-1, k])), _init("back", np.array([*leading, n]))]
    gemm_inputs = ["x2", "w"]
    if bias:
        inits.append(_init("b", RNG.standard_normal(n).astype(np.float32)))
        gemm_inputs.append("b")
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"]),
             helper.make_node("Gemm", gemm_inputs, ["y2"], transB=int(trans_b)),
             helper.make_node("Reshape", ["y2", "back"], ["y"])]
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [*leading, k])],
                      [tensor_info("y", TensorProto.FLOAT, None)], inits)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_a_gemm_flattened_between_reshapes_becomes_a_matmul(trans_b, bias):
    sess = _optimized(_linear_model(trans_b, bias), LEVEL.ORT_ENABLE_BASIC)
    assert "Gemm" in _ops(sess)  # the fusions run at the extended level only
    sess = _optimized(_linear_model(trans_b, bias))
    assert "optimizer:unflatten_gemm" in sess.applied_passes()
    assert "Gemm" not in _ops(sess) and "Reshape" not in _ops(sess)


def test_a_gemm_whose_reshapes_change_the_rows_stays():
    model = _linear_model(False, True)
    model.graph.initializer[2].CopyFrom(_init("back", np.array([3, 2, 5])))  # not x's leading dims
    sess = _optimized(model)
    assert "Gemm" in _ops(sess)
