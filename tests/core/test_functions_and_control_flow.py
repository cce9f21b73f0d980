"""Function expansion (schema and model-local functions), control flow over subgraphs reading outer
scopes, and sequences/optionals flowing through a session."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu import CPUExecutionProvider


class _CpuWithoutSoftmax(CPUExecutionProvider):
    """The CPU provider, minus Softmax: placement must fall back to Softmax's function body."""

    @ort.hookimpl
    def name(self):
        return "NoSoftmaxExecutionProvider"

    @ort.hookimpl
    def short_name(self):
        return "nosoftmax"

    @ort.hookimpl
    def supports_op(self, node, opset):
        if node.op_type == "Softmax":
            return ort.KernelMatch.unsupported("Softmax is left to its function body")
        return super().supports_op(node, opset)


@pytest.fixture
def no_softmax():
    ort.register_provider(_CpuWithoutSoftmax)
    yield "NoSoftmaxExecutionProvider"
    ort.unregister_provider("NoSoftmaxExecutionProvider")


def test_a_schema_function_is_expanded_when_no_provider_implements_it(no_softmax):
    model = make_model(
        [helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)],
        [tensor_info("x", shape=[2, 5])],
        [tensor_info("y", shape=[2, 5])],
        opset=18,
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=[no_softmax])
    placement = sess.placement()
    assert "sm" in placement.expanded and len(placement.expanded["sm"]) > 1
    assert {n.op_type for n in placement} >= {"Exp", "ReduceSum"} and "Softmax" not in {n.op_type for n in placement}
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], e / e.sum(-1, keepdims=True), rtol=1e-5)


def test_a_model_local_function_is_inlined():
    # custom.ScaledAdd(a, b) = (a + b) * alpha, with alpha an attribute reference
    body = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Constant", [], ["k"]),
        helper.make_node("Mul", ["s", "k"], ["out"]),
    ]
    body[1].attribute.append(helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT))
    body[1].attribute[0].ref_attr_name = "alpha"
    function = helper.make_function(
        "custom", "ScaledAdd", ["a", "b"], ["out"], body, [helper.make_opsetid("", 18)], attributes=["alpha"]
    )
    node = helper.make_node("ScaledAdd", ["x", "y"], ["z"], name="scaled", domain="custom", alpha=3.0)
    graph = helper.make_graph(
        [node], "g", [tensor_info("x", shape=[3]), tensor_info("y", shape=[3])], [tensor_info("z", shape=[3])]
    )
    model = helper.make_model(
        graph, functions=[function], opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("custom", 1)]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "scaled" in sess.placement().expanded
    out = sess.run(None, {"x": np.array([1, 2, 3], np.float32), "y": np.array([1, 1, 1], np.float32)})[0]
    np.testing.assert_allclose(out, [6, 9, 12])


def test_if_branches_read_outer_scope_values():
    then_g = helper.make_graph([helper.make_node("Add", ["x", "bias"], ["r"])], "then", [], [tensor_info("r")])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "bias"], ["r"])], "else", [], [tensor_info("r")])
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["bias"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    model = make_model(
        nodes, [tensor_info("c", TensorProto.BOOL, []), tensor_info("x", shape=[2])], [tensor_info("y", shape=[2])]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    x = np.array([2, 3], np.float32)
    np.testing.assert_allclose(sess.run(None, {"c": np.array(True), "x": x})[0], x + x * x)
    np.testing.assert_allclose(sess.run(None, {"c": np.array(False), "x": x})[0], x - x * x)


def test_loop_carries_values_and_stacks_scan_outputs():
    # for i in range(n): acc = acc + step; emit acc  (step read from the outer scope)
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["acc_in", "step"], ["acc_out"]),
            helper.make_node("Identity", ["acc_out"], ["emit"]),
        ],
        "body",
        [
            tensor_info("i", TensorProto.INT64, []),
            tensor_info("cond_in", TensorProto.BOOL, []),
            tensor_info("acc_in", shape=[2]),
        ],
        [
            tensor_info("cond_out", TensorProto.BOOL, []),
            tensor_info("acc_out", shape=[2]),
            tensor_info("emit", shape=[2]),
        ],
    )
    loop = helper.make_node("Loop", ["n", "", "acc0"], ["acc", "history"], body=body)
    model = make_model(
        [loop],
        [tensor_info("n", TensorProto.INT64, []), tensor_info("acc0", shape=[2]), tensor_info("step", shape=[2])],
        [tensor_info("acc", shape=[2]), tensor_info("history", shape=[None, 2])],
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = {"n": np.array(3, np.int64), "acc0": np.zeros(2, np.float32), "step": np.array([1, 2], np.float32)}
    acc, history = sess.run(None, feeds)
    np.testing.assert_allclose(acc, [3, 6])
    np.testing.assert_allclose(history, [[1, 2], [2, 4], [3, 6]])
    acc, history = sess.run(None, {**feeds, "n": np.array(0, np.int64)})
    np.testing.assert_allclose(acc, [0, 0])
    assert history.shape == (0, 2)


def test_sequences_and_optionals_flow_in_and_out_of_a_session():
    seq_type = helper.make_tensor_sequence_value_info
    nodes = [
        helper.make_node("SequenceInsert", ["seq", "t"], ["seq2"]),
        helper.make_node("SequenceLength", ["seq2"], ["n"]),
        helper.make_node("ConcatFromSequence", ["seq2"], ["cat"], axis=0),
        helper.make_node("Optional", ["t"], ["opt"]),
        helper.make_node("OptionalHasElement", ["opt"], ["has"]),
    ]
    model = make_model(
        nodes,
        [seq_type("seq", TensorProto.FLOAT, None), tensor_info("t", shape=[2])],
        [
            seq_type("seq2", TensorProto.FLOAT, None),
            tensor_info("n", TensorProto.INT64, []),
            tensor_info("cat"),
            tensor_info("has", TensorProto.BOOL, []),
        ],
        opset=18,
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert sess.get_inputs()[0].type == "sequence(tensor(float))"
    seq2, n, cat, has = sess.run(None, {"seq": [np.ones(2, np.float32)], "t": np.array([5, 6], np.float32)})
    assert isinstance(seq2, list) and len(seq2) == 2 and n == 2 and bool(has)
    np.testing.assert_allclose(cat, [1, 1, 5, 6])
