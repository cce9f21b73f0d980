"""DynamicQuantizeLinear read only by MatMulIntegerToFloat nodes becomes one DynamicQuantizeMatMul per reader
(qdq_fusions.fuse_dynamic_quantize_matmul): the same float32 outputs, bit for bit, as the unfused nodes, and
onnxruntime's within its float32 rescaling."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(11)
MS = "com.microsoft"


def model(readers: int, per_column: bool, expose_codes: bool, with_bias: bool) -> bytes:
    k, n = 32, 12
    rng = np.random.default_rng(5)  # the same weights in every variant of the model
    inits, nodes = [], [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])]
    outputs = []
    for i in range(readers):
        # int8 weights in [-64, 63]: onnxruntime's u8 x s8 AVX2 kernels saturate pairwise sums past that.
        inits += [numpy_helper.from_array(rng.integers(-64, 64, (k, n)).astype(np.int8), f"w{i}"),
                  numpy_helper.from_array(np.float32(rng.uniform(0.01, 0.03, n) if per_column else 0.02), f"ws{i}"),
                  numpy_helper.from_array(np.zeros(n, np.int8) if per_column else np.int8(0), f"wz{i}"),
                  numpy_helper.from_array(np.float32(rng.standard_normal(n)), f"b{i}")]
        inputs = ["q", f"w{i}", "s", f"ws{i}", "z", f"wz{i}"] + ([f"b{i}"] if with_bias and i % 2 == 0 else [])
        nodes.append(helper.make_node("MatMulIntegerToFloat", inputs, [f"y{i}"], domain=MS))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    if expose_codes:
        outputs.append(helper.make_tensor_value_info("q", TensorProto.UINT8, None))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              outputs, initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m.SerializeToString()


def ops(session) -> list[str]:
    return [n.op_type for n in session.placement()]


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_equals_the_two_nodes(readers, per_column, with_bias):
    fused = onnx_runtime.InferenceSession(model(readers, per_column, False, with_bias), providers=["cpu"])
    # (readers of one shape, all with a bias or none, then run as one DynamicQuantizeMatMulGroup)
    grouped = 0 if readers == 1 else readers if not with_bias else 2  # (the test's even readers have a bias)
    assert ops(fused).count("DynamicQuantizeMatMul") == readers - grouped
    assert ops(fused).count("DynamicQuantizeMatMulGroup") == (grouped > 0) and "DynamicQuantizeLinear" not in ops(fused)
    data = model(readers, per_column, True, with_bias)  # the codes as a graph output keep the nodes apart
    apart = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert "DynamicQuantizeLinear" in ops(apart)
    oracle = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for rows in (5, 1, 7):
        feeds = {"x": np.float32(RNG.standard_normal((rows, 32)) * 3)}
        ours = fused.run(None, feeds)
        reference = apart.run(None, feeds)
        theirs = oracle.run(None, feeds)
        for y, r, t in zip(ours, reference, theirs):
            np.testing.assert_array_equal(y, r)
            np.testing.assert_allclose(y, t, rtol=1e-5, atol=1e-5)


def test_another_reader_keeps_the_quantizer():
    # A reader of the codes that is no MatMulIntegerToFloat: nothing is fused.
    data = model(1, False, False, False)
    from onnx import load_from_string

    m = load_from_string(data)
    m.graph.node.append(helper.make_node("Cast", ["q"], ["qc"], to=TensorProto.INT32))
    m.graph.output.append(helper.make_tensor_value_info("qc", TensorProto.INT32, None))
    session = onnx_runtime.InferenceSession(m.SerializeToString(), providers=["cpu"])
    assert "DynamicQuantizeLinear" in ops(session) and "DynamicQuantizeMatMul" not in ops(session)
