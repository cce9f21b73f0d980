"""QLinearMatMul -> QLinearAdd of a constant bias (onnxruntime's QOperator format) fused into one QLinearMatMulAdd
(qdq_fusions.fuse_qlinear_matmul_bias, ops/qdq_linear.py): the same codes as the two nodes, bit for bit, and as
onnxruntime's within its requantization's rounding."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from contrib_reference import MS, RNG
from onnx import helper, numpy_helper

U8, I8 = np.uint8, np.int8


def chain_model(dtype, w_dtype, per_column, bias_shape, bias_first, a_rank=3):
    """x (codes) -> QLinearMatMul(W) -> QLinearAdd(bias codes): (model bytes, the same model with the product also
    a graph output, feeds)."""
    k, n = 24, 10
    info = np.iinfo(dtype)
    x = RNG.integers(info.min, info.max + 1, size=(2, 5, k)[3 - a_rank:], dtype=np.int64).astype(dtype)
    # int8 weights in [-64, 63]: onnxruntime's AVX2 u8 x s8 kernels saturate pairwise sums past that range.
    low, high = (-64, 64) if w_dtype == I8 else (0, 256)
    w = RNG.integers(low, high, size=(k, n), dtype=np.int64).astype(w_dtype)
    consts = {
        "a_scale": np.float32(0.031), "a_zero": dtype(7 if dtype == U8 else -5),
        "w": w, "w_scale": np.float32(RNG.uniform(0.005, 0.02, n)) if per_column else np.float32(0.011),
        "w_zero": np.zeros(n, w_dtype) if per_column else w_dtype(3 if w_dtype == U8 else 0),
        "y_scale": np.float32(0.37), "y_zero": dtype(120 if dtype == U8 else 2),
        "bias": RNG.integers(info.min, info.max + 1, size=bias_shape, dtype=np.int64).astype(dtype),
        "bias_scale": np.float32(0.013), "bias_zero": dtype(131 if dtype == U8 else -9),
        "x_scale": np.float32(0.37), "x_zero": dtype(120 if dtype == U8 else 2),
        "c_scale": np.float32(0.29), "c_zero": dtype(110 if dtype == U8 else -3),
    }
    initializers = [numpy_helper.from_array(np.asarray(v), name) for name, v in consts.items()]
    matmul = helper.make_node("QLinearMatMul", ["x", "a_scale", "a_zero", "w", "w_scale", "w_zero", "y_scale",
                                                "y_zero"], ["product"], name="mm")
    pair = [["bias", "bias_scale", "bias_zero"], ["product", "x_scale", "x_zero"]]
    add = helper.make_node("QLinearAdd", sum(pair[::-1 if not bias_first else 1], []) + ["c_scale", "c_zero"],
                           ["y"], name="add", domain=MS)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    models = []
    for outputs in (["y"], ["y", "product"]):
        graph = helper.make_graph([matmul, add], "g", [helper.make_tensor_value_info("x", elem, x.shape)],
                                  [helper.make_tensor_value_info(o, elem, None) for o in outputs],
                                  initializer=initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
        model.ir_version = 10
        models.append(model.SerializeToString())
    return models[0], models[1], {"x": x}


def assert_two_roundings(ours, theirs):
    """Codes within 1 of onnxruntime's, in at most 5% of places: each of the two requantizations may round a value
    within float32 rounding of a tie the other way (onnxruntime forms them in float32, this runtime in float64)."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    diff = np.abs(ours.astype(np.int64) - theirs.astype(np.int64))
    assert diff.max(initial=0) <= 1 and np.count_nonzero(diff) <= 0.05 * diff.size, (diff.max(), np.count_nonzero(diff))


def fused_ops(session) -> set[str]:
    return {node.op_type for node in session.placement()}


@pytest.mark.parametrize("dtype,w_dtype", [(U8, I8), (U8, U8), (I8, I8)])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("bias_shape,bias_first", [((10,), True), ((10,), False), ((1, 1, 10), True), ((), False)])
def test_fused_chain_matches_the_two_nodes_and_onnxruntime(dtype, w_dtype, per_column, bias_shape, bias_first):
    data, apart_data, feeds = chain_model(dtype, w_dtype, per_column, bias_shape, bias_first)
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert "QLinearMatMulAdd" in fused_ops(session)
    (fused,) = session.run(None, feeds)
    # The product as a graph output keeps the two nodes apart: the reference for the fused pass.
    apart_session = onnx_runtime.InferenceSession(apart_data, providers=["cpu"])
    assert "QLinearMatMulAdd" not in fused_ops(apart_session)
    apart = apart_session.run(None, feeds)[0]
    np.testing.assert_array_equal(fused, apart)
    (theirs,) = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_two_roundings(fused, theirs)


def test_a_full_bias_runs_the_two_kernels():
    # A bias of the output's full shape is no row: the fused node runs the two kernels in turn.
    data, apart_data, feeds = chain_model(U8, I8, True, (2, 5, 10), False)
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert "QLinearMatMulAdd" in fused_ops(session)
    (ours,) = session.run(None, feeds)
    apart = onnx_runtime.InferenceSession(apart_data, providers=["cpu"]).run(None, feeds)[0]
    np.testing.assert_array_equal(ours, apart)
    (theirs,) = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert_two_roundings(ours, theirs)


def test_a_wrongly_typed_input_names_the_node():
    data, _, feeds = chain_model(U8, I8, False, (10,), True)
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    with pytest.raises(onnx_runtime.errors.OnnxRuntimeError):
        session.run(None, {"x": feeds["x"].astype(np.int8)})


