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
