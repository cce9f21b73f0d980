"""A QDQ Concat on one grid beside convolution groups runs on the codes (qdq_fusions.pass_codes_through): two large
convolution groups' outputs, dequantized, concatenated and quantized again with the same scale and zero point, are
their codes concatenated, the groups keep their codes, and the result is the float graph's within one code; a
Concat whose inputs are on different grids keeps its roundings."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime_ep_cpu.compiled import qgemm_quads

pytestmark = pytest.mark.skipif(not qgemm_quads.AVAILABLE, reason="large convolution groups run on VNNI's bytes")


def _fire(act, second_scale):
    """x -> Q -> DQ -> two 3x3 convolutions (16 -> 32 channels at 64 x 64, large groups) -> Q -> DQ each ->
    Concat -> Q -> DQ -> y, the second branch's grid ``second_scale`` (the Concat's own is 0.05)."""
    rng = np.random.default_rng(6)
    zero = np.array(3 if act == np.uint8 else -3, act)
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.03, np.float32), "xs"), (zero, "z"), (np.array(0.002, np.float32), "ws"),
        (np.array(0, np.int8), "wz"),
        (rng.integers(-63, 64, (32, 16, 3, 3)).astype(np.int8), "w1"),
        (rng.integers(-63, 64, (32, 16, 3, 3)).astype(np.int8), "w2"),
        (np.array(0.05, np.float32), "s1"), (np.array(second_scale, np.float32), "s2"))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "z"], ["xd"])]
    for branch, scale in ((1, "s1"), (2, "s2")):
        nodes += [helper.make_node("DequantizeLinear", [f"w{branch}", "ws", "wz"], [f"wd{branch}"]),
                  helper.make_node("Conv", ["xd", f"wd{branch}"], [f"c{branch}"], pads=[1, 1, 1, 1]),
                  helper.make_node("QuantizeLinear", [f"c{branch}", scale, "z"], [f"q{branch}"]),
                  helper.make_node("DequantizeLinear", [f"q{branch}", scale, "z"], [f"d{branch}"])]
    nodes += [helper.make_node("Concat", ["d1", "d2"], ["cat"], axis=1),
              helper.make_node("QuantizeLinear", ["cat", "s1", "z"], ["yq"]),
              helper.make_node("DequantizeLinear", ["yq", "s1", "z"], ["y"])]
    graph = helper.make_graph(nodes, "fire", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_a_concat_on_one_grid_runs_on_codes_within_one_code_of_onnx(act):
    model = _fire(act, 0.05)
    sess = ort.InferenceSession(model, providers=["cpu"])
    ops = [n.op_type for n in sess.placement()]
    assert ops.count("QuantizedConv") == 2 and "Concat" in ops and "ConcatRounded" not in ops
    assert not {"QuantizeLinear", "QuantizeDequantize"} & set(ops) and ops.count("DequantizeLinear") == 1  # (y's)
    x = (np.random.default_rng(4).standard_normal((1, 16, 64, 64)) * 2).astype(np.float32)
    want = np.rint(ReferenceEvaluator(model).run(None, {"x": x})[0].astype(np.float64) / 0.05)
    got = np.rint(sess.run(None, {"x": x})[0].astype(np.float64) / 0.05)
    assert np.abs(got - want).max() <= 1 and np.mean(got == want) >= 0.99


def test_a_concat_across_grids_keeps_its_roundings():
    sess = ort.InferenceSession(_fire(np.uint8, 0.04), providers=["cpu"])
    ops = [n.op_type for n in sess.placement()]
    assert "Concat" not in ops and ops.count("QuantizedConv") == 2
