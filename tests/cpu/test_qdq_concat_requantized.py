"""A QDQ Concat across grids between convolution groups runs on the codes (qdq_fusions.pass_codes_through): each
group writes its codes, com.microsoft's QLinearConcat requantizes them to the Concat's grid (a 256-code table per
input, compiled/code_lookup.py) into their place of the output, and the reading group takes those codes. The values
are the unfused graph's bit for bit (Concat only moves the dequantized values), and within one code of onnx's
reference evaluator; a Concat that a float node reads, or whose input a float node makes, keeps its roundings. The
table's loops (a code at a time, and 64 at a time where AVX-512 VBMI is) against numpy's indexing."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime_ep_cpu import provider
from onnx_runtime_ep_cpu.compiled import code_lookup, generic_int8, qgemm_quads


def _fire(act, rank: int, read_by_relu: bool = False):
    """x -> Q -> DQ -> two convolutions (16 -> 24 channels; 1-D at length 96, or 2-D 3x3 at 48 x 48: large groups)
    -> Q -> DQ each on its own grid -> Concat -> Q -> DQ on a third -> a convolution reading it (48 -> 8) -> Q ->
    DQ -> y; with ``read_by_relu`` the Concat's dequantized output is a Relu's input instead."""
    rng = np.random.default_rng(7)
    zero = np.array(3 if act == np.uint8 else -3, act)
    kernel = (3,) if rank == 1 else (3, 3)
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.03, np.float32), "xs"), (zero, "z"), (np.array(0.002, np.float32), "ws"),
        (np.array(0, np.int8), "wz"),
        (rng.integers(-63, 64, (24, 16, *kernel)).astype(np.int8), "w1"),
        (rng.integers(-63, 64, (24, 16, *kernel)).astype(np.int8), "w2"),
        (rng.integers(-63, 64, (8, 48, *kernel)).astype(np.int8), "w3"),
        (np.array(0.05, np.float32), "s1"), (np.array(0.037, np.float32), "s2"), (np.array(0.061, np.float32), "sc"),
        (np.array(0.09, np.float32), "sy"))]
    pads = [1, 1] * rank
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "z"], ["xd"])]
    for branch, scale in ((1, "s1"), (2, "s2")):
        nodes += [helper.make_node("DequantizeLinear", [f"w{branch}", "ws", "wz"], [f"wd{branch}"]),
                  helper.make_node("Conv", ["xd", f"wd{branch}"], [f"c{branch}"], pads=pads),
                  helper.make_node("QuantizeLinear", [f"c{branch}", scale, "z"], [f"q{branch}"]),
                  helper.make_node("DequantizeLinear", [f"q{branch}", scale, "z"], [f"d{branch}"])]
    nodes += [helper.make_node("Concat", ["d1", "d2"], ["cat"], axis=1),
              helper.make_node("QuantizeLinear", ["cat", "sc", "z"], ["catq"]),
              helper.make_node("DequantizeLinear", ["catq", "sc", "z"], ["catd"])]
    if read_by_relu:
        nodes += [helper.make_node("Relu", ["catd"], ["y"])]
    else:
        nodes += [helper.make_node("DequantizeLinear", ["w3", "ws", "wz"], ["wd3"]),
                  helper.make_node("Conv", ["catd", "wd3"], ["c3"], pads=pads),
                  helper.make_node("QuantizeLinear", ["c3", "sy", "z"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "sy", "z"], ["y"])]
    shape = [2, 16, 96] if rank == 1 else [2, 16, 48, 48]
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString(), \
        shape


def _without_codes_through(monkeypatch):
    passes = [p for p in provider.QDQ_PASSES if getattr(p, "__name__", "") != "pass_codes_through"]
    assert len(passes) == len(provider.QDQ_PASSES) - 1
    monkeypatch.setattr(provider, "QDQ_PASSES", passes)


def _ranks():
    return [1, pytest.param(2, marks=pytest.mark.skipif(not qgemm_quads.AVAILABLE,
                                                        reason="2-D convolution groups run on VNNI's bytes"))]


@pytest.mark.parametrize("rank", _ranks())
@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_a_concat_across_grids_between_groups_runs_on_codes(monkeypatch, act, rank):
    model, shape = _fire(act, rank)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.plan_cache", "0")
    sess = ort.InferenceSession(model, options, providers=["cpu"])
    placed = sess.placement()
    ops = [n.op_type for n in placed]
    assert ops.count("QuantizedConv") == 3 and ops.count("QLinearConcat") == 1 and "Concat" not in ops
    assert not {"QuantizeLinear", "QuantizeDequantize", "ConcatRounded"} & set(ops)
    x = (np.random.default_rng(4).standard_normal(shape) * 2).astype(np.float32)
    got = sess.run(None, {"x": x})[0]
    assert np.array_equal(sess.run(None, {"x": x})[0], got)  # (the kept plan's second call)
    _without_codes_through(monkeypatch)
    plain = ort.InferenceSession(model, options, providers=["cpu"])
    assert "QLinearConcat" not in [n.op_type for n in plain.placement()]
    np.testing.assert_array_equal(got, plain.run(None, {"x": x})[0])
    want = np.rint(ReferenceEvaluator(model).run(None, {"x": x})[0].astype(np.float64) / 0.09)
    codes = np.rint(got.astype(np.float64) / 0.09)
    assert np.abs(codes - want).max() <= 1 and np.mean(codes == want) >= 0.98


def test_a_concat_a_float_node_reads_keeps_its_roundings():
    model, shape = _fire(np.uint8, 1, read_by_relu=True)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.plan_cache", "0")
    ops = [n.op_type for n in ort.InferenceSession(model, options, providers=["cpu"]).placement()]
    assert "QLinearConcat" not in ops and ops.count("QuantizedConv") == 2


@pytest.mark.parametrize("rows,width,total,at", [(1, 5000, 9000, 4000), (3, 70, 200, 5), (2, 64, 130, 0),
                                                 (4, 1, 9, 8), (1, 0, 10, 3), (2, 127, 127, 0)])
def test_code_lookup_loops_match_numpy(rows, width, total, at):
    rng = np.random.default_rng(width)
    table = rng.integers(0, 256, 256).astype(np.uint8)
    codes = rng.integers(0, 256, (rows, width)).astype(np.uint8)
    codes[:, :2] = [0, 255][: min(2, width)]  # both halves of the table's ends
    start = rng.integers(0, 256, (rows, total)).astype(np.uint8)
    want = start.copy()
    generic_int8.code_lookup_rows(table, codes, want, at)
    assert np.array_equal(want[:, at:at + width], table[codes])
    assert np.array_equal(np.delete(want, np.s_[at:at + width], axis=1), np.delete(start, np.s_[at:at + width], axis=1))
    loops = [code_lookup.code_lookup_rows] + ([code_lookup.code_lookup_lanes] if code_lookup.VBMI else [])
    for loop in loops:
        out = start.copy()
        loop(table, codes, out, at)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("table_dtype", [np.uint8, np.int8, np.float32])
def test_apply_table_is_numpys_indexing_for_every_table(table_dtype):
    """algorithms.quantize.apply_table (QLinearConcat's parts, the QLinear activations, CodeTable): a byte table by
    the compiled loops, any other by numpy's indexing, the same values in the input's shape, a strided input too."""
    from onnx_runtime_ep_cpu.algorithms.quantize import apply_table

    rng = np.random.default_rng(11)
    table = (rng.integers(0, 256, 256) if table_dtype != np.float32 else rng.standard_normal(256)).astype(table_dtype)
    codes = rng.integers(-128, 128, (3, 7, 130)).astype(np.int8)
    for q in (codes, codes[:, ::2, 1:], codes[:0], np.int8(-5)):
        got = apply_table(table, q)
        want = table[np.asarray(q).view(np.uint8)]
        assert got.dtype == table.dtype and got.shape == np.shape(q)
        np.testing.assert_array_equal(got, want)
