"""The CPU provider's fusions: exact patterns become one kernel with the same results, and nodes a
provider listed first would run are never fused away from it."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
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
