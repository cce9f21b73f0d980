"""qdq_fusions.absorb_rounded_add: a QDQ MatMul whose bias Add comes after its output's rounding (x -> Q/DQ ->
MatMul(DQ(W)) -> Q/DQ -> Add(bias) -> Q/DQ, as onnxruntime's quantization tools write a Linear layer) runs as one
integer group that adds the bias and rounds the sum in the same pass. Checked against the same graph with the
pass off (the same float32 operations: equal bits), a float64 evaluation of the graph (within one output code)
and onnxruntime (within one output code)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnx_runtime_ep_cpu.provider as provider
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime_ep_cpu import qdq_fusions

X, M, Y = 0.03, 0.05, 0.07  # the scales of the input, the product and the sum


def _model(act, per_channel: bool, transposed: bool, rng):
    low, high = np.iinfo(act).min, np.iinfo(act).max
    zeros = {n: np.array(z if act == np.int8 else z + 128, act) for n, z in (("xz", 0), ("mz", -3), ("yz", 5))}
    w = rng.integers(-63, 64, (7, 9) if transposed else (9, 7)).astype(np.int8)
    w_scale = (rng.random(7) * 0.01 + 0.002).astype(np.float32) if per_channel else np.array(0.006, np.float32)
    bias = (rng.standard_normal(7) * 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("xs", np.array(X, np.float32)), ("ms", np.array(M, np.float32)), ("ys", np.array(Y, np.float32)),
        ("w", w), ("ws", w_scale), ("wz", np.zeros(w_scale.shape, np.int8)), ("bias", bias), *zeros.items())]
    product = helper.make_node("Gemm", ["xd", "wd"], ["m"], transB=1) if transposed else \
        helper.make_node("MatMul", ["xd", "wd"], ["m"])
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0 if transposed else 1), product,
             helper.make_node("QuantizeLinear", ["m", "ms", "mz"], ["mq"]),
             helper.make_node("DequantizeLinear", ["mq", "ms", "mz"], ["md"]),
             helper.make_node("Add", ["bias", "md"], ["s"]),
             helper.make_node("QuantizeLinear", ["s", "ys", "yz"], ["sq"]),
             helper.make_node("DequantizeLinear", ["sq", "ys", "yz"], ["y"])]
    x_shape = [6, 9] if transposed else [2, 3, 9]
    model = make_model(nodes, [tensor_info("x", shape=x_shape)], [tensor_info("y", shape=x_shape[:-1] + [7])], inits,
                       opset=19)

    def reference(x):
        def rounded(v, scale, zero):
            return (np.clip(np.rint(v / scale) + int(zero), low, high) - int(zero)) * np.float64(scale)
        xr = rounded(x / np.float32(X), 1.0, zeros["xz"])  # float32 division, as QuantizeLinear
        wr = w.astype(np.float64) * (w_scale.astype(np.float64).reshape(-1, 1) if transposed and per_channel
                                     else w_scale.astype(np.float64))
        real = xr * np.float64(np.float32(X)) @ (wr.T if transposed else wr)
        return rounded(rounded(real, np.float64(np.float32(M)), zeros["mz"]) + bias, np.float64(np.float32(Y)),
                       zeros["yz"])

    return model, reference


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_bias_add_and_rounding_join_the_integer_group(monkeypatch, act, per_channel, transposed):
    rng = np.random.default_rng(11)
    model, reference = _model(act, per_channel, transposed, rng)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    x.reshape(-1)[:2] = [1e4, -1e4]  # saturation
    fused = _session(model)
    assert [n.op_type for n in fused.placement()] == ["QuantizedMatMul"]
    y = fused.run(None, {"x": x})[0]
    monkeypatch.setattr(provider, "QDQ_PASSES", [p for p in qdq_fusions.QDQ_PASSES
                                                 if p.__name__ != "absorb_rounded_add"])
    monkeypatch.setattr(provider, "QDQ_EPILOGUE_PASSES", [])  # (which would run the Add and rounding as one)
    apart = _session(model)
    assert sorted(n.op_type for n in apart.placement()) == ["Add", "QuantizeDequantize", "QuantizedMatMul"]
    np.testing.assert_array_equal(y, apart.run(None, {"x": x})[0])
    step = np.float32(Y)
    assert np.abs(y - reference(x)).max() <= step * 1.001
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(y - oracle).max() <= step * 1.001 and np.mean(y == oracle) >= 0.9


def test_an_add_read_elsewhere_stays_apart():
    rng = np.random.default_rng(12)
    model, _ = _model(np.uint8, False, False, rng)
    model.graph.output.append(helper.make_tensor_value_info("s", 1, [2, 3, 7]))  # the sum is an output too
    ops = sorted(n.op_type for n in _session(model).placement())
    assert ops == ["Add", "QuantizeDequantize", "QuantizedMatMul"], ops
