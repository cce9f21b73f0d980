"""Half-precision models as deployment pipelines make them, computed in float32 (precision_fusions.py):
onnxruntime's optimizer output converted to float16 (its convert_float_to_float16 after optimize_model), against
onnxruntime at float16 tolerance."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest


def _oracle(proto, feeds):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _ran_as(session) -> set[tuple[str, str]]:
    return {(record.domain, record.op_type) for record in session.placement()}


@pytest.mark.parametrize("block", ["bert, BiasGelu, mask lengths", "bert, FastGelu", "t5"])
def test_optimizer_output_converted_to_float16_runs_fused(block):
    """Blocks as onnxruntime's transformer optimizer writes them (com.microsoft Attention, SkipLayerNormalization,
    BiasGelu/FastGelu; SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization), converted by its float16
    tool with float32 inputs and outputs: computed in float32, lowered to the standard operators the fusions
    take, within float16 error of onnxruntime."""
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from test_contrib_speed_lowering import bert_block, hidden_states, t5_block

    feeds = {"x": hidden_states()}
    if block.startswith("bert, BiasGelu"):
        proto, feeds["mask"] = bert_block([2]), np.array([6, 4], np.int32)
    else:
        proto = bert_block(gelu="FastGelu") if block.startswith("bert") else t5_block()
    proto = convert_float_to_float16(proto, keep_io_types=True)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)[0]
    expected = _oracle(proto, feeds)
    assert got.dtype == expected.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2 * float(np.abs(expected).max()))
    ran = _ran_as(session)
    assert not any(domain == "com.microsoft" or op == "SimplifiedLayerNormalization" for domain, op in ran), ran
    assert ("ai.onnx_runtime.cpu", "FusedMatMul") in ran or ("ai.onnx_runtime.cpu", "SkipRMSNormalization") in ran


def _loop_model(body_reads_outer: bool):
    """x (float16) -> MatMul(w1) -> Loop (3 trips; its body doubles a carried float16 value, plus an outer
    value when ``body_reads_outer``) -> MatMul(w2) -> y (float16)."""
    from onnx import TensorProto, helper, numpy_helper

    half = TensorProto.FLOAT16
    rng = np.random.default_rng(3)
    body_nodes = [helper.make_node("Add", ["v", "v"], ["doubled"]),
                  helper.make_node("Identity", ["cond"], ["cond_out"])]
    if body_reads_outer:
        body_nodes[0] = helper.make_node("Add", ["v", "h"], ["doubled"])
    body = helper.make_graph(body_nodes, "body", [
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        helper.make_tensor_value_info("v", half, [2, 8])], [
        helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("doubled", half, [2, 8])])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Loop", ["trips", "", "h"], ["looped"], body=body),
             helper.make_node("MatMul", ["looped", "w2"], ["y"])]
    inits = [numpy_helper.from_array((rng.standard_normal((4, 8)) * 0.5).astype(np.float16), "w1"),
             numpy_helper.from_array((rng.standard_normal((8, 3)) * 0.5).astype(np.float16), "w2"),
             numpy_helper.from_array(np.array(3, np.int64), "trips")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", half, [2, 4])],
                              [helper.make_tensor_value_info("y", half, [2, 3])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    return proto


@pytest.mark.parametrize("body_reads_outer", [False, True])
def test_control_flow_computing_in_half_precision_keeps_its_types_beside_a_float32_region(body_reads_outer):
    """A Loop whose body computes in float16 keeps its types; the products around it compute in float32, with
    one conversion each way at the Loop (the region pass). A body reading an outer float16 value by name leaves
    the whole graph as written."""
    proto = _loop_model(body_reads_outer)
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 4)).astype(np.float16)}
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)[0]
    expected = _oracle(proto, feeds)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=4e-3, atol=4e-3)
    ran = [(record.domain, record.op_type) for record in session.placement()]
    converted = ("ai.onnx_runtime.cpu", "FloatToHalf") in ran and ("ai.onnx_runtime.cpu", "HalfToFloat") in ran
    assert converted != body_reads_outer, ran
    assert ("", "Loop") in ran
