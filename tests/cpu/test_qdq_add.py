"""QDQ residual additions on the codes (qdq_fusions.fuse_quantized_add, ops/qdq_add.py): QuantizedAdd's codes are
those of the nodes it replaces, DequantizeLinear(a) + DequantizeLinear(b) (Add, or a two-input Sum) [-> Relu] ->
QuantizeLinear, bit for bit (both 8-bit types, with and without Relu, saturation both ways, a broadcast shortcut);
the fusion takes a residual addition of 4-D maps beside a large convolution group, which then keeps its codes, and
leaves small float chains and 3-D streams (a transformer's residuals) to their nodes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import qgemm_quads
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import qdq_add


def _model(act, op, relu, a_shape, b_shape, y_zero):
    t = TensorProto.UINT8 if act == np.uint8 else TensorProto.INT8
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.031, np.float32), "as"), (np.array(5 if act == np.uint8 else -3, act), "az"),
        (np.array(0.017, np.float32), "bs"), (np.array(200 if act == np.uint8 else 40, act), "bz"),
        (np.array(0.02, np.float32), "ys"), (np.array(y_zero, act), "yz"))]
    nodes = [helper.make_node("DequantizeLinear", ["a", "as", "az"], ["ad"]),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bd"]),
             helper.make_node(op, ["ad", "bd"], ["s"])]
    if relu:
        nodes.append(helper.make_node("Relu", ["s"], ["r"]))
    nodes.append(helper.make_node("QuantizeLinear", ["r" if relu else "s", "ys", "yz"], ["y"]))
    graph = helper.make_graph(nodes, "add", [helper.make_tensor_value_info("a", t, a_shape),
                                             helper.make_tensor_value_info("b", t, b_shape)],
                              [helper.make_tensor_value_info("y", t, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


def _unfused(model, feeds):
    return ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds)[0]  # onnx's nodes, one by one


@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("op", ["Add", "Sum"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("b_shape", [(2, 6, 9, 11), (1, 6, 1, 11)], ids=["same", "broadcast"])
def test_codes_are_the_unfused_nodes(act, op, relu, b_shape):
    info = np.iinfo(act)
    y_zero = 0 if act == np.uint8 and relu else (7 if act == np.uint8 else -9)
    model = _model(act, op, relu, (2, 6, 9, 11), b_shape, y_zero)
    rng = np.random.default_rng(1)
    feeds = {"a": rng.integers(info.min, info.max + 1, (2, 6, 9, 11)).astype(act),
             "b": rng.integers(info.min, info.max + 1, b_shape).astype(act)}
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load_from_string(model).graph.initializer}
    node = Node("QuantizedAdd", [f"i{k}" for k in range(8)], ["y"], domain=FUSED_DOMAIN, opset=1,
                attrs={"relu": int(relu)})
    got = qdq_add.quantized_add(node, [], 1)(feeds["a"], inits["as"], inits["az"], feeds["b"], inits["bs"],
                                            inits["bz"], inits["ys"], inits["yz"])[0]
    want = _unfused(model, feeds)
    assert got.dtype == want.dtype == act
    np.testing.assert_array_equal(got, want)
    assert got.min() == info.min or relu  # the sums reach both ends of the codes: saturation is exercised
    assert got.max() == info.max


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_threads_give_the_same_codes(monkeypatch, act):
    from onnx_runtime_ep_cpu import tuning
    from onnx_runtime_ep_cpu.compiled import deferred, jobs, workers

    monkeypatch.setattr(deferred.state, "deferring", False)
    info = np.iinfo(act)
    rng = np.random.default_rng(8)
    a, b = (rng.integers(info.min, info.max + 1, (1, 16, 31, 33)).astype(act) for _ in range(2))
    f, z = np.array(0.02, np.float32), np.array(1, act)
    node = Node("QuantizedAdd", [f"i{k}" for k in range(8)], ["y"], domain=FUSED_DOMAIN, opset=1, attrs={"relu": 1})
    runs = []
    real = workers.run
    monkeypatch.setattr(workers, "run", lambda kind, parts, *rest: runs.append((kind, len(parts))) or real(
        kind, parts, *rest))
    outputs = []
    for threads in (1, 3):
        with tuning.override(split_elements=1, threads=threads):
            outputs.append(qdq_add.quantized_add(node, [], 1)(a, f, z, b, f * 2, z, f * 3, z)[0])
    assert runs == [(jobs.DEQUANTIZED_SUM, 3)]
    np.testing.assert_array_equal(outputs[0], outputs[1])


def _residual_block(act):
    """x -> Q -> DQ -> Conv 3x3 (32 -> 32 at 48 x 48, a large group) -> Q -> DQ -> Add(DQ(Q(x))) -> Relu -> Q ->
    DQ -> y: a ResNet block's shape."""
    rng = np.random.default_rng(2)
    t_zero = np.array(3 if act == np.uint8 else -3, act)
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.03, np.float32), "xs"), (t_zero, "xz"), (rng.integers(-63, 64, (32, 32, 3, 3)).astype(np.int8),
                                                             "w"),
        (np.array(0.002, np.float32), "ws"), (np.array(0, np.int8), "wz"), (np.array(0.05, np.float32), "cs"),
        (t_zero, "cz"), (np.array(0.05, np.float32), "ys"), (t_zero, "yz"))]  # (one code of c: one of y)
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd2"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "cs", "cz"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "cs", "cz"], ["cd"]),
             helper.make_node("Add", ["cd", "xd2"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 48, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


@pytest.mark.skipif(not qgemm_quads.AVAILABLE, reason="large convolution groups run on VNNI's byte products")
@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_a_residual_beside_a_large_group_runs_on_codes_within_one_code_of_onnx(act):
    model = _residual_block(act)
    sess = ort.InferenceSession(model, providers=["cpu"])
    ops = [n.op_type for n in sess.placement()]
    assert "QuantizedAdd" in ops and "Add" not in ops and "Relu" not in ops
    x = (np.random.default_rng(4).standard_normal((1, 32, 48, 48)) * 2).astype(np.float32)
    want = np.rint(_unfused(model, {"x": x}).astype(np.float64) / 0.05)
    for _ in range(2):
        got = np.rint(sess.run(None, {"x": x})[0].astype(np.float64) / 0.05)
        assert np.abs(got - want).max() <= 1 and np.mean(got == want) >= 0.99


def test_small_float_chains_keep_their_nodes():
    model = _model(np.uint8, "Add", True, (2, 6, 9, 11), (2, 6, 9, 11), 0)
    sess = ort.InferenceSession(model, providers=["cpu"])
    assert "QuantizedAdd" not in [n.op_type for n in sess.placement()]


def test_transformer_streams_keep_their_nodes():
    model = _model(np.uint8, "Add", False, (2, 9, 16), (2, 9, 16), 7)
    sess = ort.InferenceSession(model, providers=["cpu"])
    assert "QuantizedAdd" not in [n.op_type for n in sess.placement()]


def test_mismatched_codes_are_a_typed_error():
    node = Node("QuantizedAdd", [f"i{k}" for k in range(8)], ["y"], domain=FUSED_DOMAIN, opset=1, attrs={})
    kernel = qdq_add.quantized_add(node, [], 1)
    f, u = np.array(0.1, np.float32), np.array(3, np.uint8)
    with pytest.raises(Exception, match="'a' .*int8.* and 'b' .*uint8.* must have one type"):
        kernel(np.zeros((1, 2, 2, 2), np.int8), f, u, np.zeros((1, 2, 2, 2), np.uint8), f, u, f, u)
    with pytest.raises(Exception, match="'a_scale' has shape \\(2,\\); expected a scalar"):
        kernel(np.zeros((1, 2, 2, 2), np.uint8), np.array([0.1, 0.2], np.float32), u,
               np.zeros((1, 2, 2, 2), np.uint8), f, u, f, u)
