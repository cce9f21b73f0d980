"""The sibling MatMul fusion: MatMuls reading one input with constant weights become one MatMul over the
weights side by side and a Split, with results equal to the unoptimized session's."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.optimizer import sibling_matmul_fusion

LEVEL = ort.GraphOptimizationLevel
RNG = np.random.default_rng(0)


@pytest.fixture
def any_size(monkeypatch):
    """Merge siblings of any size, so that the structural tests can use small weights."""
    monkeypatch.setattr(sibling_matmul_fusion, "_MIN_MERGED_SIZE", 0)


def _session(model, level=LEVEL.ORT_ENABLE_ALL, **kwargs):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"], **kwargs)


def _checked(model, feeds, **kwargs):
    """The optimized session, after checking its outputs against the unoptimized session's."""
    sess = _session(model, **kwargs)
    plain = _session(model, LEVEL.ORT_DISABLE_ALL)
    for got, want in zip(sess.run(None, feeds), plain.run(None, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return sess


def _init(name, shape, dtype=np.float32):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(dtype), name)


def _qkv_model(opset=17, outputs=("q", "k", "v")):
    """q/k/v projections of x ([2, 3, 8]) with widths 8, 4 and 4, each followed by a Relu."""
    nodes = [helper.make_node("MatMul", ["x", w], [f"{w}_out"]) for w in ("wq", "wk", "wv")]
    nodes += [helper.make_node("Relu", [f"{w}_out"], [name]) for w, name in zip(("wq", "wk", "wv"), outputs)]
    inits = [_init("wq", (8, 8)), _init("wk", (8, 4)), _init("wv", (8, 4))]
    return make_model(nodes, [tensor_info("x", shape=[2, 3, 8])], [tensor_info(name) for name in outputs], inits,
                      opset=opset)


def _x():
    return {"x": RNG.standard_normal((2, 3, 8)).astype(np.float32)}


@pytest.mark.parametrize("opset", [11, 17])
def test_siblings_become_one_matmul_and_a_split_of_the_last_axis(opset, any_size):
    sess = _checked(_qkv_model(opset), _x())
    graph = sess.model.graph
    matmul, split = graph.nodes[:2]
    assert [n.op_type for n in graph.nodes] == ["MatMul", "Split", "Relu", "Relu", "Relu"]
    assert split.outputs == ["wq_out", "wk_out", "wv_out"] and split.attr("axis") == -1
    assert matmul.inputs[0] == "x" and graph.initializers[matmul.inputs[1]].shape == (8, 16)
    sizes = split.attr("split") if opset < 13 else graph.initializers[split.inputs[1]].tolist()
    assert list(sizes) == [8, 4, 4]
    assert not {"wq", "wk", "wv"} & set(graph.initializers)  # the separate weights are gone
    assert graph.type_of(matmul.outputs[0]).shape == (2, 3, 16)
    assert "optimizer:fuse_sibling_matmuls" in sess.applied_passes()
    assert sess.placement()[split.name].provider == "CPUExecutionProvider"


def test_a_sibling_output_that_is_a_graph_output_keeps_its_name(any_size):
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"]), helper.make_node("MatMul", ["x", "wb"], ["b"])]
    model = make_model(nodes, [tensor_info("x", shape=[3, 8])], [tensor_info("a"), tensor_info("b")],
                       [_init("wa", (8, 5)), _init("wb", (8, 2))])
    sess = _checked(model, {"x": RNG.standard_normal((3, 8)).astype(np.float32)})
    assert [n.op_type for n in sess.model.graph.nodes] == ["MatMul", "Split"]
    assert [o.name for o in sess.get_outputs()] == ["a", "b"]


def test_computed_batched_or_differently_fed_weights_are_not_merged(any_size):
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"]),
        helper.make_node("MatMul", ["x", "y"], ["b"]),  # computed weight
        helper.make_node("MatMul", ["x", "w3"], ["c"]),  # batched (3-D) weight
        helper.make_node("MatMul", ["x2", "w2"], ["d"]),  # another input
    ]
    inits = [_init("w", (4, 5)), _init("w3", (3, 4, 2)), _init("w2", (4, 6))]
    model = make_model(nodes, [tensor_info("x", shape=[3, 4]), tensor_info("y", shape=[4, 2]),
                               tensor_info("x2", shape=[3, 4])],
                       [tensor_info(name) for name in "abcd"], inits)
    feeds = {"x": RNG.standard_normal((3, 4)).astype(np.float32), "y": RNG.standard_normal((4, 2)).astype(np.float32),
             "x2": RNG.standard_normal((3, 4)).astype(np.float32)}
    assert [n.op_type for n in _checked(model, feeds).model.graph.nodes] == ["MatMul"] * 4


def test_a_weight_read_elsewhere_stays_and_the_pass_can_be_disabled(any_size):
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"]), helper.make_node("MatMul", ["x", "wb"], ["b"]),
             helper.make_node("Transpose", ["wa"], ["t"])]
    model = make_model(nodes, [tensor_info("x", shape=[3, 8])], [tensor_info(n) for n in "abt"],
                       [_init("wa", (8, 8)), _init("wb", (8, 2))])
    feeds = {"x": RNG.standard_normal((3, 8)).astype(np.float32)}
    graph = _checked(model, feeds, disabled_optimizers=["fold_constants"]).model.graph
    assert [n.op_type for n in graph.nodes] == ["MatMul", "Split", "Transpose"] and "wa" in graph.initializers
    sess = _checked(model, feeds, disabled_optimizers=["fold_constants", "fuse_sibling_matmuls"])
    assert [n.op_type for n in sess.model.graph.nodes] == ["MatMul", "MatMul", "Transpose"]


def test_only_products_big_enough_to_split_across_threads_are_merged():
    def model(width):
        nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"]), helper.make_node("MatMul", ["x", "wb"], ["b"])]
        return make_model(nodes, [tensor_info("x", shape=[1, 64])], [tensor_info("a"), tensor_info("b")],
                          [_init("wa", (64, width)), _init("wb", (64, width))])

    feeds = {"x": RNG.standard_normal((1, 64)).astype(np.float32)}
    assert 64 * 2 * 504 < sibling_matmul_fusion._MIN_MERGED_SIZE <= 64 * 2 * 512
    assert [n.op_type for n in _checked(model(504), feeds).model.graph.nodes] == ["MatMul", "MatMul"]
    assert [n.op_type for n in _checked(model(512), feeds).model.graph.nodes] == ["MatMul", "Split"]
