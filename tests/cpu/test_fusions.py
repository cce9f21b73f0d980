"""The CPU provider's fusions: exact patterns become one kernel with the same results, and nodes a
provider listed first would run are never fused away from it."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper


def _const(name, value):
    return numpy_helper.from_array(
        np.asarray(value, dtype=np.float32 if np.asarray(value).dtype.kind == "f" else np.int64), name
    )


def _ops(sess):
    return [n.op_type for n in sess.placement()]


def test_rms_norm_pattern_becomes_one_node():
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["one", "rms"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["xn", "w"], ["y"]),
    ]
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    inits = [_const("two", 2.0), _const("eps", 1e-6), _const("one", 1.0), numpy_helper.from_array(w, "w")]
    model = make_model(nodes, [tensor_info("x", shape=[2, 3, 8])], [tensor_info("y", shape=[2, 3, 8])], inits)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert _ops(sess) == ["RMSNormalization"]
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_rotate_half_pattern_becomes_one_node():
    nodes = [
        helper.make_node("Mul", ["q", "cos"], ["qc"]),
        helper.make_node("Slice", ["q", "zero", "half", "last"], ["q1"]),
        helper.make_node("Slice", ["q", "half", "full", "last"], ["q2"]),
        helper.make_node("Neg", ["q2"], ["nq2"]),
        helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["qc", "rs"], ["y"]),
    ]
    inits = [_const("zero", [0]), _const("half", [4]), _const("full", [8]), _const("last", [-1])]
    shape = [1, 2, 3, 8]
    model = make_model(
        nodes, [tensor_info(n, shape=shape) for n in ("q", "cos", "sin")], [tensor_info("y", shape=shape)], inits
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert _ops(sess) == ["RotateHalfEmbedding"]
    rng = np.random.default_rng(1)
    q, cos, sin = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    want = q * cos + np.concatenate((-q[..., 4:], q[..., :4]), -1) * sin
    np.testing.assert_allclose(sess.run(None, {"q": q, "cos": cos, "sin": sin})[0], want, rtol=1e-6)


def _silu_model():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    return make_model(nodes, [tensor_info("x", shape=[5])], [tensor_info("y", shape=[5])]).SerializeToString()


def test_silu_becomes_swish_and_a_reader_of_the_intermediate_blocks_it():
    sess = ort.InferenceSession(_silu_model(), providers=["cpu"])
    assert _ops(sess) == ["Swish"]
    x = np.linspace(-3, 3, 5).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], x / (1 + np.exp(-x)), rtol=1e-6)
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    shared = make_model(
        nodes, [tensor_info("x", shape=[5])], [tensor_info("y", shape=[5]), tensor_info("s", shape=[5])]
    )
    assert _ops(ort.InferenceSession(shared.SerializeToString(), providers=["cpu"])) == ["Sigmoid", "Mul"]


class _SigmoidMul:
    """A host provider listed before the CPU that runs Sigmoid and Mul itself."""

    @ort.hookimpl
    def name(self):
        return "SigmoidMulExecutionProvider"

    @ort.hookimpl
    def supports_op(self, node):
        ok = node.op_type in ("Sigmoid", "Mul")
        return ort.KernelMatch.supported() if ok else ort.KernelMatch.unsupported("Sigmoid and Mul only")

    @ort.hookimpl
    def get_kernel(self, node):
        if node.op_type == "Sigmoid":
            return lambda x: (1 / (1 + np.exp(-x)),)
        return lambda a, b: (a * b,)


def test_fusions_never_take_nodes_from_a_provider_listed_first():
    ort.register_provider(_SigmoidMul)
    try:
        sess = ort.InferenceSession(_silu_model(), providers=["SigmoidMulExecutionProvider", "cpu"])
        assert sess.placement().as_dict() == {
            "Sigmoid_0": "SigmoidMulExecutionProvider",
            "Mul_1": "SigmoidMulExecutionProvider",
        }
        assert not any("fuse_silu" in p for p in sess.applied_passes())
    finally:
        ort.unregister_provider("SigmoidMulExecutionProvider")


# -- GELU ------------------------------------------------------------------------------------------

SQRT2 = np.float32(np.sqrt(2))


def _gelu_nodes(order, divide=True, swap=False):
    """x * 0.5 * (1 + erf(x / sqrt(2))) as exporters spell it; ``swap`` flips every commutative input pair."""
    def mul(a, b, out):
        return helper.make_node("Mul", [b, a] if swap else [a, b], [out])

    scale = helper.make_node("Div", ["x", "sqrt2"], ["s"]) if divide else mul("x", "inv_sqrt2", "s")
    nodes = [scale, helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", ["one", "e"] if swap else ["e", "one"], ["p"])]
    if order == "x_first":  # (x * (1 + erf)) * 0.5, as torch exports F.gelu
        return nodes + [mul("x", "p", "xp"), mul("xp", "half", "y")]
    if order == "half_first":  # ((1 + erf) * 0.5) * x
        return nodes + [mul("p", "half", "ph"), mul("ph", "x", "y")]
    return nodes + [mul("x", "half", "hx"), mul("hx", "p", "y")]  # (x * 0.5) * (1 + erf), as in BERT


def _gelu_model(nodes, consts=None, shape=(2, 3, 8), extra_outputs=()):
    values = {"sqrt2": SQRT2, "inv_sqrt2": np.float32(1 / np.sqrt(2)), "one": 1.0, "half": 0.5, **(consts or {})}
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in values.items()]
    outputs = [tensor_info(n) for n in ("y", *extra_outputs)]
    return make_model(nodes, [tensor_info("x", shape=list(shape))], outputs, inits).SerializeToString()


@pytest.mark.parametrize("order", ["x_first", "half_first", "half_x_first"])
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("swap", [False, True])
def test_gelu_pattern_becomes_gelu_with_the_unfused_results(order, divide, swap):
    nodes = _gelu_nodes(order, divide, swap)
    sess = ort.InferenceSession(_gelu_model(nodes), providers=["cpu"])
    assert _ops(sess) == ["Gelu"]
    # Reading the Erf output as well keeps the node-by-node graph: the oracle.
    unfused = ort.InferenceSession(_gelu_model(nodes, extra_outputs=["e"]), providers=["cpu"])
    assert "Gelu" not in _ops(unfused)
    x = np.random.default_rng(2).standard_normal((2, 3, 8)).astype(np.float32) * 4
    want = 0.5 * x.astype(np.float64) * (1 + np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2)))
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, unfused.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("consts,shape", [
    ({"half": 0.4999}, (2, 3, 8)),  # not GELU
    ({"one": 2.0}, (2, 3, 8)),
    ({"sqrt2": 1.41}, (2, 3, 8)),  # an approximate sqrt(2) is not this formula
    ({"half": [[[0.5]]]}, (8,)),  # a size-1 constant of higher rank broadcasts the output up
])
def test_gelu_lookalikes_stay_unfused(consts, shape):
    sess = ort.InferenceSession(_gelu_model(_gelu_nodes("x_first"), consts, shape), providers=["cpu"])
    assert "Gelu" not in _ops(sess) and "Erf" in _ops(sess)


def test_gelu_is_not_fused_when_an_intermediate_is_shared():
    nodes = _gelu_nodes("half_x_first") + [helper.make_node("Neg", ["hx"], ["n"])]
    assert "Gelu" not in _ops(ort.InferenceSession(_gelu_model(nodes, extra_outputs=["n"]), providers=["cpu"]))


def _gelu_tanh_nodes(cube, order, swap=False):
    """x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), x^3 as ``cube`` ("pow", "mul_mul")."""
    def mul(a, b, out):
        return helper.make_node("Mul", [b, a] if swap else [a, b], [out])

    if cube == "pow":
        nodes = [helper.make_node("Pow", ["x", "three"], ["x3"])]
    else:
        nodes = [mul("x", "x", "x2"), mul("x2", "x", "x3")]
    nodes += [mul("x3", "c", "cx3"), helper.make_node("Add", ["x", "cx3"], ["inner"]), mul("inner", "k", "arg"),
              helper.make_node("Tanh", ["arg"], ["t"]), helper.make_node("Add", ["t", "one"], ["p"])]
    if order == "x_first":
        return nodes + [mul("x", "p", "xp"), mul("xp", "half", "y")]
    return nodes + [mul("x", "half", "hx"), mul("hx", "p", "y")]  # GPT-2's NewGELU


@pytest.mark.parametrize("cube", ["pow", "mul_mul"])
@pytest.mark.parametrize("order", ["x_first", "half_x_first"])
@pytest.mark.parametrize("swap", [False, True])
def test_gelu_tanh_pattern_becomes_gelu_with_the_unfused_results(cube, order, swap):
    nodes = _gelu_tanh_nodes(cube, order, swap)
    consts = {"three": 3.0, "c": 0.044715, "k": math.sqrt(2 / math.pi)}
    sess = ort.InferenceSession(_gelu_model(nodes, consts), providers=["cpu"])
    assert _ops(sess) == ["Gelu"] and sess.model.graph.nodes[0].attrs["approximate"] == "tanh"
    unfused = ort.InferenceSession(_gelu_model(nodes, consts, extra_outputs=["t"]), providers=["cpu"])
    assert "Gelu" not in _ops(unfused)
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32) * 4
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(unfused.run(None, {"x": x})[0], want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("consts", [{"c": 0.0447}, {"k": 0.8}, {"three": 2.0}])
def test_gelu_tanh_lookalikes_stay_unfused(consts):
    values = {"three": 3.0, "c": 0.044715, "k": math.sqrt(2 / math.pi), **consts}
    sess = ort.InferenceSession(_gelu_model(_gelu_tanh_nodes("pow", "half_x_first"), values), providers=["cpu"])
    assert "Gelu" not in _ops(sess) and "Tanh" in _ops(sess)


def test_conv_passes_return_at_once_on_a_graph_without_convolutions(monkeypatch):
    # No Conv, FusedConv or BatchNormalization: no pattern can match, so no pass builds its use maps.
    from onnx_runtime.ir import Graph, Node
    from onnx_runtime_ep_cpu import conv_fusions

    def fail(graph):
        raise AssertionError("a conv pass scanned a graph without convolutions")

    monkeypatch.setattr(conv_fusions, "_Matcher", fail)
    nodes = [Node("Relu", ["x"], ["r"], name="r"), Node("Add", ["r", "x"], ["y"], name="a")]
    graph = Graph(name="g", nodes=nodes, inputs=[], outputs=[], initializers={}, value_info={}, opsets={"": 17})
    assert not any(graph_pass(graph) for graph_pass in conv_fusions.CONV_PASSES)
    assert [node.op_type for node in graph.nodes] == ["Relu", "Add"]
