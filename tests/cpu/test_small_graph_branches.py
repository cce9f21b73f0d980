"""If branches get the provider's fusions: a branch taken by a data-dependent condition is fused where it is
(the enclosing graph's weights lent to its passes), and an If whose condition follows from the input shapes is
inlined into the specialized plan. Outputs against a float64 reference."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

CPU = ["CPUExecutionProvider"]
RNG = np.random.default_rng(7)
W = RNG.standard_normal((4, 3, 3)).astype(np.float32)
B = RNG.standard_normal(4).astype(np.float32)


def _conv_relu_branch(name: str, x: str, out: str, scale: float) -> object:
    """A branch reading the outer ``x`` and the outer weights: Relu(Conv1d(x)) * scale."""
    nodes = [helper.make_node("Conv", [x, "w", "b"], [f"{name}_conv"], pads=[1, 1]),
             helper.make_node("Relu", [f"{name}_conv"], [f"{name}_relu"]),
             helper.make_node("Mul", [f"{name}_relu", f"{name}_scale"], [out])]
    scale_init = numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale")
    return helper.make_graph(nodes, name, [], [tensor_info(out)], [scale_init])


def _reference(x: np.ndarray, scale: float) -> np.ndarray:
    x64, w64 = x.astype(np.float64), W.astype(np.float64)
    padded = np.pad(x64, ((0, 0), (0, 0), (1, 1)))
    out = np.zeros((x.shape[0], 4, x.shape[2]))
    for k in range(3):
        out += np.einsum("oc,ncl->nol", w64[:, :, k], padded[:, :, k:k + x.shape[2]])
    return np.maximum(out + B[None, :, None], 0.0) * scale


def _weights():
    return [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")]


def _ops(graph) -> list[str]:
    return [node.op_type for node in graph.nodes]


def _branches(graph) -> list:
    return [sub for node in graph.nodes if node.op_type == "If" for sub in node.subgraphs()]


def _then(graph):
    (node,) = [node for node in graph.nodes if node.op_type == "If"]
    return node.attrs["then_branch"]


def _data_if_model():
    then_branch = _conv_relu_branch("then", "x", "then_out", 2.0)
    else_branch = _conv_relu_branch("else", "x", "else_out", -1.0)
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)
    return make_model([node], [tensor_info("x", shape=[1, 3, 8]), tensor_info("cond", TensorProto.BOOL, [])],
                      [tensor_info("y")], _weights())


def test_a_data_dependent_branch_is_fused_where_it_is():
    session = ort.InferenceSession(_data_if_model().SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 3, 8)).astype(np.float32)
    for cond, scale in ((True, 2.0), (False, -1.0)):
        (y,) = session.run(None, {"x": x, "cond": np.array(cond)})
        np.testing.assert_allclose(y, _reference(x, scale), rtol=1e-5, atol=1e-5)
    graph = session.graph_for({"x": x, "cond": np.array(True)})
    assert "If" in _ops(graph)  # the condition is data: the If stays
    for branch in _branches(graph):
        assert "Relu" not in _ops(branch), _ops(branch)  # the activation folded into the convolution
        # the lent weights went back: the branch still reads them from the enclosing graph
        assert "w" not in branch.initializers and "w" in branch.outer_names
    assert any(name.endswith("fuse_conv_activations") for name in session.applied_passes())


def test_a_nested_branch_and_a_branch_returning_an_outer_value():
    inner = helper.make_node("If", ["inner_cond"], ["inner_y"],
                             then_branch=_conv_relu_branch("inner_then", "x", "inner_then_out", 0.5),
                             else_branch=helper.make_graph([], "inner_else", [], [tensor_info("x")]))
    outer_then = helper.make_graph([inner], "outer_then", [], [tensor_info("inner_y")])
    outer_else = helper.make_graph([helper.make_node("Identity", ["x"], ["passed"])], "outer_else", [],
                                   [tensor_info("passed")])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=outer_then, else_branch=outer_else)
    model = make_model([node], [tensor_info("x", shape=[1, 3, 8]), tensor_info("cond", TensorProto.BOOL, []),
                                tensor_info("inner_cond", TensorProto.BOOL, [])], [tensor_info("y")], _weights())
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 3, 8)).astype(np.float32)
    feeds = {"x": x, "cond": np.array(True), "inner_cond": np.array(True)}
    np.testing.assert_allclose(session.run(None, feeds)[0], _reference(x, 0.5), rtol=1e-5, atol=1e-5)
    for cond, inner_cond in ((True, False), (False, True)):
        (y,) = session.run(None, {**feeds, "cond": np.array(cond), "inner_cond": np.array(inner_cond)})
        np.testing.assert_array_equal(y, x)
    outer_then_graph = _then(session.graph_for(feeds))
    inner_then_graph = _then(outer_then_graph)
    assert "Relu" not in _ops(inner_then_graph), _ops(inner_then_graph)
    assert "w" in outer_then_graph.outer_names  # read through both scopes, as exported


@pytest.mark.parametrize("length, scale", [(8, 2.0), (5, -1.0)])
def test_a_condition_from_the_input_shape_is_inlined_into_the_plan(length, scale):
    """cond = (x.shape[2] == 8): constant per signature, so the specialized plan holds the taken branch, fused."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "two"], ["length"], axis=0),
             helper.make_node("Equal", ["length", "eight"], ["cond"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=_conv_relu_branch("then", "x", "then_out", 2.0),
                              else_branch=_conv_relu_branch("else", "x", "else_out", -1.0))]
    constants = [numpy_helper.from_array(np.array(2, np.int64), "two"),
                 numpy_helper.from_array(np.array(8, np.int64), "eight")]
    model = make_model(nodes, [tensor_info("x", shape=[1, 3, "L"])], [tensor_info("y")], _weights() + constants)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 3, length)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_allclose(y, _reference(x, scale), rtol=1e-5, atol=1e-5)
    ops = _ops(session.graph_for({"x": x}))
    assert "If" not in ops and "Shape" not in ops and "Relu" not in ops, ops


def test_shape_decided_ifs_inside_a_data_dependent_branch_are_inlined():
    """silero-vad's form: inside a branch taken by data, Ifs decided by shapes, one reading the shape of another's
    output and their conditions behind bool Casts (which the optimizer drops): all are decided per signature."""
    const = {"zero": np.array([0], np.int64), "two": np.array(2, np.int64), "eight": np.array(8, np.int64),
             "four": np.array(4, np.int64)}

    def branch_pair(prefix: str, source: str, out: str, rank_up: bool):
        grow = [helper.make_node("Unsqueeze", [source, "zero"], [f"{prefix}_up"])] if rank_up else \
            [helper.make_node("Identity", [source], [f"{prefix}_up"])]
        keep = helper.make_graph(grow, f"{prefix}_then", [], [tensor_info(f"{prefix}_up")])
        other = helper.make_graph([helper.make_node("Identity", [source], [f"{prefix}_same"])], f"{prefix}_else",
                                  [], [tensor_info(f"{prefix}_same")])
        return keep, other

    first_then, first_else = branch_pair("first", "x", "first_y", rank_up=True)
    squeeze_then = helper.make_graph([helper.make_node("Squeeze", ["first_y", "zero"], ["squeezed"])], "sq_then",
                                     [], [tensor_info("squeezed")])
    squeeze_else = helper.make_graph([helper.make_node("Identity", ["first_y"], ["kept"])], "sq_else", [],
                                     [tensor_info("kept")])
    inside = [helper.make_node("Shape", ["x"], ["x_shape"]),
              helper.make_node("Gather", ["x_shape", "two"], ["x_length"], axis=0),
              helper.make_node("Equal", ["x_length", "eight"], ["is_eight"]),
              helper.make_node("Cast", ["is_eight"], ["first_cond"], to=TensorProto.BOOL),
              helper.make_node("If", ["first_cond"], ["first_y"], then_branch=first_then, else_branch=first_else),
              helper.make_node("Shape", ["first_y"], ["y_shape"]),
              helper.make_node("Size", ["y_shape"], ["y_rank"]),
              helper.make_node("Equal", ["y_rank", "four"], ["is_four"]),
              helper.make_node("Cast", ["is_four"], ["second_cond"], to=TensorProto.BOOL),
              helper.make_node("If", ["second_cond"], ["restored"], then_branch=squeeze_then,
                               else_branch=squeeze_else),
              helper.make_node("Relu", ["restored"], ["taken_out"])]
    taken = helper.make_graph(inside, "taken", [], [tensor_info("taken_out")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["other_out"])], "other", [],
                              [tensor_info("other_out")])
    model = make_model([helper.make_node("If", ["cond"], ["y"], then_branch=taken, else_branch=other)],
                       [tensor_info("x", shape=[1, 3, "L"]), tensor_info("cond", TensorProto.BOOL, [])],
                       [tensor_info("y")], [numpy_helper.from_array(v, k) for k, v in const.items()])
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 3, 8)).astype(np.float32)
    for cond in (True, False):
        (y,) = session.run(None, {"x": x, "cond": np.array(cond)})
        np.testing.assert_array_equal(y, np.maximum(x, 0) if cond else -x)
    ops = _ops(_then(session.graph_for({"x": x, "cond": np.array(True)})))
    assert "If" not in ops and "Shape" not in ops, ops


def test_an_if_after_a_branch_that_reads_an_earlier_ifs_output_is_inlined():
    """silero-vad's opset-15 export: If A (decided by x's shape) and If B (decided by the state's shape) at the top
    level, B's branch reading A's output from the enclosing graph; an If C after B, decided by the shape of B's
    output. A's condition takes a longer chain than B's: ordered by explicit inputs alone, B went ahead of A for
    inference, B's output stayed shapeless and C stayed in the plan."""
    const = {"zero": np.array([0], np.int64), "last": np.array([2], np.int64), "two": np.array(2, np.int64),
             "one": np.array(1, np.int64), "twice": np.array(2.0, np.float32)}

    def squeeze_or_keep(prefix: str, source: str, axes: str):
        keep = helper.make_graph([helper.make_node("Squeeze", [source, axes], [f"{prefix}_sq"])], f"{prefix}_then",
                                 [], [tensor_info(f"{prefix}_sq")])
        other = helper.make_graph([helper.make_node("Identity", [source], [f"{prefix}_id"])], f"{prefix}_else", [],
                                  [tensor_info(f"{prefix}_id")])
        return keep, other

    a_then, a_else = squeeze_or_keep("a", "deep", "last")
    b_then = helper.make_graph([helper.make_node("Mul", ["a_y", "twice"], ["b_mul"]),
                                helper.make_node("Unsqueeze", ["b_mul", "zero"], ["b_up"])], "b_then", [],
                               [tensor_info("b_up")])
    b_else = helper.make_graph([helper.make_node("Neg", ["a_y"], ["b_neg"])], "b_else", [], [tensor_info("b_neg")])
    c_then, c_else = squeeze_or_keep("c", "b_y", "zero")
    nodes = [helper.make_node("Relu", ["x"], ["r1"]), helper.make_node("Abs", ["r1"], ["r2"]),
             helper.make_node("Relu", ["r2"], ["deep"]),
             helper.make_node("Shape", ["deep"], ["deep_shape"]),
             helper.make_node("Gather", ["deep_shape", "two"], ["deep_last"], axis=0),
             helper.make_node("Equal", ["deep_last", "one"], ["a_cond"]),
             helper.make_node("If", ["a_cond"], ["a_y"], then_branch=a_then, else_branch=a_else),
             helper.make_node("Shape", ["state"], ["state_shape"]),
             helper.make_node("Gather", ["state_shape", "zero"], ["state_rows"], axis=0),
             helper.make_node("Squeeze", ["state_rows"], ["state_rows_scalar"]),
             helper.make_node("Equal", ["state_rows_scalar", "one"], ["b_cond"]),
             helper.make_node("If", ["b_cond"], ["b_y"], then_branch=b_then, else_branch=b_else),
             helper.make_node("Shape", ["b_y"], ["b_shape"]),
             helper.make_node("Gather", ["b_shape", "zero"], ["b_first"], axis=0),
             helper.make_node("Equal", ["b_first", "one"], ["c_cond"]),
             helper.make_node("If", ["c_cond"], ["y"], then_branch=c_then, else_branch=c_else)]
    model = make_model(nodes, [tensor_info("x", shape=[1, 3, "L"]), tensor_info("state", shape=["S", 3])],
                       [tensor_info("y")], [numpy_helper.from_array(v, k) for k, v in const.items()])
    for length in (1, 4):  # a session each: a second length would make the axis symbolic
        session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
        x = RNG.standard_normal((1, 3, length)).astype(np.float32)
        state = RNG.standard_normal((1, 3)).astype(np.float32)
        (y,) = session.run(None, {"x": x, "state": state})
        a = np.maximum(x.astype(np.float64), 0.0)
        a = a[:, :, 0] if length == 1 else a
        expected = 2.0 * a  # B's taken branch, then C's Squeeze of the axis B added
        np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-7)
        ops = _ops(session.graph_for({"x": x, "state": state}))
        assert "If" not in ops and "Shape" not in ops, ops


def test_a_branch_reading_outer_constants_is_shaped_per_signature():
    """silero-vad's op18 "ifless" export: the main graph holds the pads and slice bounds its data-decided branches
    read. Inference of a subgraph sees outer constants only through local copies; they were made only once folding
    had found something, so these branches stayed shapeless (every step keyed by shapes per call)."""
    pads = np.array([0, 2, 0, 2], np.int64)
    starts, ends, axes = np.array([1], np.int64), np.array([5], np.int64), np.array([1], np.int64)
    then_branch = helper.make_graph(
        [helper.make_node("Pad", ["x", "pads"], ["padded"], mode="reflect"),
         helper.make_node("Slice", ["padded", "starts", "ends", "axes"], ["then_out"])],
        "then", [], [tensor_info("then_out")])
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["else_out"])], "else", [],
                                    [tensor_info("else_out")])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)
    constants = {"pads": pads, "starts": starts, "ends": ends, "axes": axes}
    model = make_model([node], [tensor_info("x", shape=["N", "L"]), tensor_info("cond", TensorProto.BOOL, [])],
                       [tensor_info("y")], [numpy_helper.from_array(v, k) for k, v in constants.items()])
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 6)).astype(np.float32)
    (y,) = session.run(None, {"x": x, "cond": np.array(True)})
    np.testing.assert_array_equal(y, np.pad(x, ((0, 0), (2, 2)), mode="reflect")[:, 1:5])
    (y,) = session.run(None, {"x": x, "cond": np.array(False)})
    np.testing.assert_array_equal(y, -x)
    branch = _then(session.graph_for({"x": x, "cond": np.array(True)}))
    assert branch.value_info["padded"].type.static_shape == (1, 10)
    assert branch.value_info["then_out"].type.static_shape == (1, 4)
