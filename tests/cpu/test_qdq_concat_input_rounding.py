"""qdq_concat_inputs.fold_concat_input_roundings: a past key/value's rounding read only by the present Concat that
rounds to the same grid (as quantize_static leaves a QDQ decoder's KV cache, both torch exporters) is dropped; the
outputs are the unfolded graph's, bit for bit, and onnxruntime's."""
from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from model_helpers import qdq_epilogues_without
from onnx import TensorProto, helper, numpy_helper

F32 = np.float32


def _model(opset: int, signed: bool = False, present_scale: float = 0.0273, past_output: bool = False):
    """past (1, 2, P, 8) rounded, new (1, 2, 1, 8) rounded, Concat on axis 2, rounded -> present."""
    zero = np.array(15 if signed else 143, np.int8 if signed else np.uint8)
    inits = [numpy_helper.from_array(np.array(0.0273, F32), "past_s"), numpy_helper.from_array(zero, "past_z"),
             numpy_helper.from_array(np.array(present_scale, F32), "present_s"),
             numpy_helper.from_array(zero.copy(), "present_z"),
             numpy_helper.from_array(np.array(0.019, F32), "new_s"), numpy_helper.from_array(zero.copy(), "new_z")]
    nodes = []
    for name, grid in (("past", "past"), ("new", "new")):
        nodes += [helper.make_node("QuantizeLinear", [name, f"{grid}_s", f"{grid}_z"], [f"{name}_q"]),
                  helper.make_node("DequantizeLinear", [f"{name}_q", f"{grid}_s", f"{grid}_z"], [f"{name}_r"])]
    nodes += [helper.make_node("Concat", ["past_r", "new_r"], ["joined"], axis=2),
              helper.make_node("QuantizeLinear", ["joined", "present_s", "present_z"], ["joined_q"]),
              helper.make_node("DequantizeLinear", ["joined_q", "present_s", "present_z"], ["present"])]
    outputs = [helper.make_tensor_value_info("present", TensorProto.FLOAT, None)]
    if past_output:
        outputs.append(helper.make_tensor_value_info("past_r", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "kv_concat",
                              [helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 2, "past_len", 8]),
                               helper.make_tensor_value_info("new", TensorProto.FLOAT, [1, 2, 1, 8])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _feeds(past=5, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    p = (rng.standard_normal((1, 2, past, 8)) * 2).astype(F32)
    p.reshape(-1)[:5] = [1e4, -1e4, np.inf, np.nan, 0.5 * 0.0273]  # saturation both ways, infinity, NaN, a tie
    return {"past": p, "new": (rng.standard_normal((1, 2, 1, 8)) * 2).astype(F32)}


def _run(model, feeds):
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    session.run(None, feeds)
    outputs = session.run(None, feeds)
    return [n.op_type for n in session.graph_for(feeds).nodes], outputs


def _bitwise(got, want):
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("opset", [17, 18])  # (torchscript's and dynamo's)
@pytest.mark.parametrize("signed", [False, True])
def test_past_rounding_folds_into_the_concat(opset, signed):
    model, feeds = _model(opset, signed), _feeds()
    ops, got = _run(model, feeds)
    with qdq_epilogues_without("fold_concat_input_roundings"):
        plain_ops, want = _run(model, feeds)
    assert plain_ops.count("QuantizeDequantize") == 2 and ops.count("QuantizeDequantize") == 1
    assert ops.count("ConcatRounded") == 1
    _bitwise(got, want)
    assert len(np.unique(got[0])) > 20


@pytest.mark.parametrize("opset", [17, 18])
def test_folded_concat_against_onnxruntime(opset):
    onnxruntime = pytest.importorskip("onnxruntime")
    model, feeds = _model(opset), _feeds(past=9, seed=2)
    ops, got = _run(model, feeds)
    assert ops.count("QuantizeDequantize") == 1
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    theirs = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    finite = {k: np.nan_to_num(v, nan=0.0, posinf=1e4, neginf=-1e4) for k, v in feeds.items()}
    _, got = _run(model, finite)
    np.testing.assert_array_equal(got[0], theirs.run(None, finite)[0])  # elementwise float32 steps: equal


@pytest.mark.parametrize("change", ["other_grid", "rounded_past_is_an_output"])
def test_what_the_fold_leaves_alone(change):
    model = _model(18, present_scale=0.031 if change == "other_grid" else 0.0273,
                   past_output=change == "rounded_past_is_an_output")
    feeds = _feeds()
    ops, got = _run(model, feeds)
    with qdq_epilogues_without("fold_concat_input_roundings"):
        _, want = _run(model, feeds)
    assert ops.count("QuantizeDequantize") == 2
    _bitwise(got, want)


def test_a_grid_whose_codes_do_not_round_back_is_not_idempotent():
    from onnx_runtime_ep_cpu.qdq_concat_inputs import _idempotent

    assert _idempotent(np.array(0.0273, F32), np.array(143, np.uint8))
    assert not _idempotent(np.array(1e37, F32), np.array(0, np.uint8))  # the high codes' values overflow
    assert not _idempotent(np.array(0.0, F32), np.array(0, np.uint8))
