"""Code tables (code_tables.fuse_code_tables, ops/code_table.py): a QOperator graph's elementwise chain of one 8-bit
tensor and constant scalars as one 256-entry table. The erf GELU as onnxruntime's quantizer writes a TorchScript
export (DequantizeLinear -> Div -> Erf -> QuantizeLinear -> QLinearAdd(one) -> QLinearMul(x) -> QLinearMul(half))
and as it writes dynamo's (DequantizeLinear -> Gelu -> QuantizeLinear), over every code, zero points at the
type's extremes and grids that saturate: equal to the unfused nodes' codes, within one code of onnxruntime and of
a float64 reference. Chains that must stay (a QDQ model's, a result the graph returns, a non-scalar constant) are
left as they are, and the kernel refuses float input with a typed error."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError

_SQRT2 = np.float32(math.sqrt(2.0))


def _code(dtype):
    return TensorProto.INT8 if dtype == np.int8 else TensorProto.UINT8


def _gelu_model(dtype, zero, scales, form="torchscript", half_shape=(), reader="QLinearSigmoid") -> bytes:
    """x codes -> QLinearAdd(a constant) = h (a QOperator node's codes) -> the GELU chain -> ``reader`` -> y."""
    s_h, s1, s2, s3, s4 = scales
    inits = {
        "xs": np.float32(0.05), "xz": np.array(zero, dtype), "c": np.array(zero + 3, dtype), "cs": np.float32(0.04),
        "cz": np.array(zero, dtype), "hs": np.float32(s_h), "hz": np.array(zero, dtype), "sqrt2": _SQRT2,
        "s1": np.float32(s1), "z1": np.array(zero, dtype), "one": np.array(zero + 100, dtype),
        "ones": np.float32(0.01), "onez": np.array(zero, dtype), "s2": np.float32(s2), "z2": np.array(zero, dtype),
        "s3": np.float32(s3), "z3": np.array(zero, dtype),
        "half": np.full(half_shape, zero + 50, dtype), "halfs": np.float32(0.01), "halfz": np.array(zero, dtype),
        "s4": np.float32(s4), "z4": np.array(zero, dtype),
        "ys": np.float32(1 / 256), "yz": np.array(np.iinfo(dtype).min, dtype)}
    ms = "com.microsoft"
    nodes = [helper.make_node("QLinearAdd", ["x", "xs", "xz", "c", "cs", "cz", "hs", "hz"], ["h"], domain=ms),
             helper.make_node("DequantizeLinear", ["h", "hs", "hz"], ["hf"])]
    if form == "torchscript":
        nodes += [helper.make_node("Div", ["hf", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("QuantizeLinear", ["e", "s1", "z1"], ["c1"]),
                  helper.make_node("QLinearAdd", ["c1", "s1", "z1", "one", "ones", "onez", "s2", "z2"], ["c2"],
                                   domain=ms),
                  helper.make_node("QLinearMul", ["h", "hs", "hz", "c2", "s2", "z2", "s3", "z3"], ["c3"], domain=ms),
                  helper.make_node("QLinearMul", ["c3", "s3", "z3", "half", "halfs", "halfz", "s4", "z4"], ["c4"],
                                   domain=ms)]
    else:
        nodes += [helper.make_node("Gelu", ["hf"], ["g"]),
                  helper.make_node("QuantizeLinear", ["g", "s4", "z4"], ["c4"])]
    if reader == "QLinearSigmoid":
        nodes.append(helper.make_node("QLinearSigmoid", ["c4", "s4", "z4", "ys", "yz"], ["y"], domain=ms))
    else:  # the chain's result read by a float node: not a QOperator reader
        nodes.append(helper.make_node("DequantizeLinear", ["c4", "s4", "z4"], ["y"]))
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", _code(dtype), [2, 256])],
                              [helper.make_tensor_value_info("y", _code(dtype) if reader == "QLinearSigmoid"
                                                             else TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(ms, 1)])
    model.ir_version = 9
    return model.SerializeToString()


def _session(model, tables=True, monkeypatch=None):
    from onnx_runtime_ep_cpu import provider

    options = ort.SessionOptions()
    options.enable_profiling = True
    passes = provider.PRECISION_PASSES
    if not tables:
        monkeypatch.setattr(provider, "PRECISION_PASSES", [p for p in passes if p.__name__ != "fuse_code_tables"])
    return ort.InferenceSession(model, options, providers=["cpu"])


def _ops(sess) -> dict:
    return {op: calls for op, (_seconds, calls) in sess.profile_summary().items()}


def _inputs(dtype):
    every = np.arange(256, dtype=np.uint8).view(dtype)
    return {"x": np.stack([every, np.random.default_rng(7).permutation(every)])}


def _reference(x, dtype, zero, scales):
    """The torchscript chain in float64, each QuantizeLinear rounding half to even and saturating."""
    s_h, s1, s2, s3, s4 = (float(np.float32(s)) for s in scales)
    info = np.iinfo(dtype)

    def q(v, s):
        return np.clip(np.rint(v / s) + zero, info.min, info.max) - zero

    h = q((x.astype(np.float64) - zero) * float(np.float32(0.05)) + 3 * float(np.float32(0.04)), s_h) * s_h
    c1 = q(np.vectorize(math.erf)(h / math.sqrt(2.0)), s1) * s1
    c2 = q(c1 + 100 * float(np.float32(0.01)), s2) * s2
    c3 = q(h * c2, s3) * s3
    c4 = q(c3 * 50 * float(np.float32(0.01)), s4) * s4
    return np.clip(np.rint(256 / (1 + np.exp(-c4))) + info.min, info.min, info.max)


_GRIDS = [
    (0.03, 0.008, 0.009, 0.02, 0.01),  # fine grids: the GELU's negative dip, both ends saturate
    (0.0973, 0.0211, 0.0517, 0.287, 0.31),  # coarse grids
]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("zero", ["low", "middle", "high"])
@pytest.mark.parametrize("scales", _GRIDS)
@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_gelu_chain_as_one_table(dtype, zero, scales, form, monkeypatch):
    info = np.iinfo(dtype)
    # the zero points at the type's extremes leave room for the constants' codes above them
    zero = {"low": int(info.min), "middle": (int(info.min) + int(info.max)) // 2, "high": int(info.max) - 100}[zero]
    model = _gelu_model(dtype, zero, scales, form)
    fused = _session(model)
    feeds = _inputs(dtype)
    got = [fused.run(None, feeds)[0] for _ in range(3)]  # the table is made on the first call
    ops = _ops(fused)
    assert ops.get("CodeTable") == 3 and "Erf" not in ops and "Gelu" not in ops and "QLinearMul" not in ops
    with monkeypatch.context() as patch:
        plain = _session(model, tables=False, monkeypatch=patch)
        unfused = plain.run(None, feeds)[0]
        assert "CodeTable" not in _ops(plain)
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    for y in got:
        assert y.dtype == dtype and y.shape == (2, 256)
        np.testing.assert_array_equal(y, unfused)  # the nodes' own kernels made the table
    if form == "torchscript":
        assert np.abs(got[0].astype(np.int64) - _reference(feeds["x"], dtype, zero, scales)).max() <= 1
    assert np.abs(got[0].astype(np.int64) - oracle.astype(np.int64)).max() <= 1
    assert len(np.unique(got[0])) > 8  # the grids give the chain more than a few distinct results


def test_constant_of_higher_rank_broadcasts_the_result(monkeypatch):
    model = _gelu_model(np.uint8, 0, _GRIDS[0], half_shape=(1, 1, 1))
    feeds = _inputs(np.uint8)
    got = _session(model).run(None, feeds)[0]
    with monkeypatch.context() as patch:
        want = _session(model, tables=False, monkeypatch=patch).run(None, feeds)[0]
    assert got.shape == want.shape == (1, 2, 256)
    np.testing.assert_array_equal(got, want)


def test_chains_that_stay():
    feeds = _inputs(np.uint8)
    # the result read by a float node (a QDQ-style reader): the chain's nodes run as they are
    sess = _session(_gelu_model(np.uint8, 0, _GRIDS[0], reader="DequantizeLinear"))
    sess.run(None, feeds)
    assert "CodeTable" not in _ops(sess) and _ops(sess).get("Erf") == 1
    # a non-scalar constant (a per-column operand) is not one function of the code
    sess = _session(_gelu_model(np.uint8, 0, _GRIDS[0], half_shape=(256,)))
    sess.run(None, feeds)
    ops = _ops(sess)
    assert ops.get("CodeTable") == 1 and ops.get("QLinearMul") == 1  # the table ends before the last product


def test_kernel_refuses_float_codes():
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.code_table import code_table

    # the chain in table_chains.py's plain attributes: one Relu of opset 20 from "x" to "y"
    node = Node("CodeTable", ["x"], ["y"], name="table", domain="ai.onnx_runtime.cpu",
                attrs={"chain": [":Relu:20"], "wiring": ["x|y"], "names": ["x"], "result": "y"}, opset=1)
    kernel = code_table(node, [(4,)], 1)
    with pytest.raises(InvalidArgumentError, match="'x' is float32; expected uint8 or int8"):
        kernel(np.zeros(4, np.float32))
    np.testing.assert_array_equal(kernel(np.array([0, 3, 200, 255], np.uint8))[0], [0, 3, 200, 255])
    # int8 codes through Relu's table: contiguous, odd-sized, strided and transposed inputs
    codes = np.random.default_rng(3).integers(-128, 128, (4, 255)).astype(np.int8)
    for x in (codes, codes[:, :254], codes[:, ::2], codes[:, 1:].T):
        got = kernel(x)[0]
        assert got.dtype == np.int8 and got.shape == x.shape
        np.testing.assert_array_equal(got, np.maximum(x, 0))
