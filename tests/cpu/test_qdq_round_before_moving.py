"""qdq_tables.round_before_moving: a rounding after data movement of an elementwise result (the dynamo LLaMA's
rotary tables: Cos -> Unsqueeze -> rounding) moves before the movement, so the elementwise node and the rounding
become one GridTable lookup, as in the torchscript export (Cos -> rounding -> Unsqueeze). The values are the
unmoved graph's bit for bit, within one code of a float64 evaluation and of onnxruntime's."""
from __future__ import annotations

import contextlib

import numpy as np
import onnx_runtime
import pytest
from model_helpers import ops_and_outputs, oracle_session
from onnx import TensorProto, helper, numpy_helper

F32 = np.float32
X, Y = (0.05, 0), (0.0079, 128)  # (scale, zero point) of the input's and the result's rounding


@contextlib.contextmanager
def _without_the_move():
    from onnx_runtime_ep_cpu import provider

    saved = provider.QDQ_PASSES
    provider.QDQ_PASSES = [p for p in saved if getattr(p, "__name__", "") != "round_before_moving"]
    try:
        yield
    finally:
        provider.QDQ_PASSES = saved


def _model(move: str = "Unsqueeze", op: str = "Cos", extra_reader: bool = False, per_channel: bool = False):
    """x (1, rows, 16) rounded -> op -> move -> rounded -> y."""
    y_scale = np.full(16, Y[0], F32) if per_channel else np.array(Y[0], F32)
    y_zero = np.full(16, Y[1], np.uint8) if per_channel else np.array(Y[1], np.uint8)
    inits = [numpy_helper.from_array(np.array(X[0], F32), "xs"),
             numpy_helper.from_array(np.array(X[1], np.uint8), "xz"),
             numpy_helper.from_array(y_scale, "ys"), numpy_helper.from_array(y_zero, "yz"),
             numpy_helper.from_array(np.array([1], np.int64), "axes"),
             numpy_helper.from_array(np.array([1, -1, 4, 4], np.int64), "shape")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xr"]),
             helper.make_node(op, ["xr"], ["f"])]
    nodes.append(helper.make_node("Unsqueeze", ["f", "axes"], ["m"]) if move == "Unsqueeze"
                 else helper.make_node("Reshape", ["f", "shape"], ["m"]))
    axis = {"axis": -1} if per_channel else {}
    nodes += [helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["mq"], **axis),
              helper.make_node("DequantizeLinear", ["mq", "ys", "yz"], ["y"], **axis)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("f", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "moved", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "rows", 16])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(rows=5, seed=0):
    x = (np.random.default_rng(seed).standard_normal((1, rows, 16)) * 3).astype(F32)
    x.reshape(-1)[:2] = [1e3, -1e3]  # saturation
    return {"x": x}


def _want(x, op):
    def grid(v, scale, zero):
        s = np.float64(F32(scale))
        return (np.clip(np.rint(v / s) + zero, 0, 255) - zero) * s

    return grid(getattr(np, op.lower())(grid(np.asarray(x, np.float64), *X)), *Y)


@pytest.mark.parametrize("move", ["Unsqueeze", "Reshape"])
@pytest.mark.parametrize("op", ["Cos", "Sin"])
def test_rounding_moves_before_the_movement_and_makes_a_table(move, op):
    model, feeds = _model(move, op), _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with _without_the_move():
        plain_ops, want = ops_and_outputs(model, feeds)
    assert "GridTable" in ops and op not in ops, ops
    assert op in plain_ops and "GridTable" not in plain_ops, plain_ops
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))
    reference = _want(feeds["x"], op).reshape(got[0].shape)
    assert np.abs(got[0] - reference).max() <= F32(Y[0]) * 1.001  # (float32's cos vs float64's near a half-code)
    assert np.mean(got[0] == reference.astype(F32)) >= 0.95


def test_against_onnxruntime():
    model = _model()
    theirs = oracle_session(model)
    for rows in (1, 7):
        feeds = _feeds(rows, seed=rows)
        ops, (got,) = ops_and_outputs(model, feeds)
        assert "GridTable" in ops
        (want,) = theirs.run(None, feeds)
        assert np.abs(got - want).max() <= F32(Y[0]) * 1.001
        assert np.mean(got == want) >= 0.95


@pytest.mark.parametrize("change", ["extra_reader", "per_channel"])
def test_what_stays(change):
    model, feeds = _model(extra_reader=change == "extra_reader", per_channel=change == "per_channel"), _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with _without_the_move():
        _, want = ops_and_outputs(model, feeds)
    assert "Cos" in ops, ops
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have, expected)


def test_zoo_llama_dynamo_rotary_tables(qdq_decoders):
    """The dynamo LLaMA's Cos and Sin (each then Unsqueeze, then rounded) become table lookups in prefill and decode,
    outputs bit for bit those of the unmoved graph."""
    built, entries, zoo_feeds = qdq_decoders
    calls = entries["llama.dynamo.fp32"]["calls"]
    feeds = [zoo_feeds.make_feeds(calls["prefill"]), zoo_feeds.make_feeds(calls["decode"])]
    ours = onnx_runtime.InferenceSession(str(built["llama.dynamo"]), providers=["cpu"])
    with _without_the_move():
        plain = onnx_runtime.InferenceSession(str(built["llama.dynamo"]), providers=["cpu"])
        want = [plain.run(None, f) for f in feeds]
    for feed, expected in zip(feeds, want):
        got = ours.run(None, feed)
        ops = [n.op_type for n in ours.graph_for(feed).nodes]
        assert "Cos" not in ops and "Sin" not in ops, ops
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
