"""qdq_fusions.fuse_rounded_gelu: torch's erf GELU in a QDQ model (Div -> Erf -> Q/DQ -> Add -> Q/DQ -> Mul -> Q/DQ
-> Mul) runs as one RoundedGelu pass. Checked against the same graph with the pass off, a float64 evaluation of the
graph (math.erf, the same roundings) and onnxruntime: most outputs equal, and where a rounding lands on the other
side of a half-code (erf's float32 error), the output moves by at most the codes that flip propagates to."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime as ort
import onnx_runtime_ep_cpu.provider as provider
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime_ep_cpu import qdq_fusions

S1, S2, S3 = 2 / 255, 2 / 255, 0.05  # erf's grid, 1 + erf's, x * (1 + erf)'s
SQRT2 = math.sqrt(2)


def _model(act, rng, shape=(3, 17, 40), divisor=SQRT2, scale3=S3):
    low = int(np.iinfo(act).min)
    zeros = {"z1": 128 + low, "z2": low, "z3": 100 + low}
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (
        ("d", divisor), ("one", 1.0), ("half", 0.5), ("s1", S1), ("s2", S2), ("s3", scale3))]
    inits += [numpy_helper.from_array(np.array(v, act), n) for n, v in zeros.items()]

    def rounding(i, source, target):
        return [helper.make_node("QuantizeLinear", [source, f"s{i}", f"z{i}"], [f"{target}_q"]),
                helper.make_node("DequantizeLinear", [f"{target}_q", f"s{i}", f"z{i}"], [target])]

    nodes = [helper.make_node("Div", ["x", "d"], ["t"]), helper.make_node("Erf", ["t"], ["e"]),
             *rounding(1, "e", "er"), helper.make_node("Add", ["er", "one"], ["u"]), *rounding(2, "u", "ur"),
             helper.make_node("Mul", ["x", "ur"], ["v"]), *rounding(3, "v", "vr"),
             helper.make_node("Mul", ["vr", "half"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=list(shape))], [tensor_info("y", shape=list(shape))], inits,
                       opset=19)
    high = int(np.iinfo(act).max)

    def reference(x):
        def rounded(v, scale, zero):
            s = np.float64(np.float32(scale))
            return (np.clip(np.rint(v / s) + zero, low, high) - zero) * s
        erf = np.vectorize(math.erf)(x.astype(np.float64) / np.float64(np.float32(divisor)))
        u = rounded(rounded(erf, S1, zeros["z1"]) + 1.0, S2, zeros["z2"])
        return rounded(x * u, scale3, zeros["z3"]) * 0.5

    return model, reference


def _session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def _close(y, expected, x, fraction=0.95):
    """Most outputs equal (to float32 rounding), every one within the codes a flipped rounding reaches."""
    equal = np.abs(y - expected) <= 1e-6 * np.maximum(1, np.abs(expected))
    assert equal.mean() >= fraction
    bound = 0.5 * (np.float32(S3) + np.abs(x) * np.float32(S2)) * 1.001 + 1e-6
    assert np.all(np.abs(y - expected) <= bound)


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_rounded_gelu_is_one_node_and_matches(monkeypatch, act):
    rng = np.random.default_rng(5)
    model, reference = _model(act, rng)
    x = (rng.standard_normal((3, 17, 40)) * 2).astype(np.float32)
    x.reshape(-1)[:4] = [1e4, -1e4, 0.0, np.nan]  # saturation, zero and NaN
    fused = _session(model)
    assert [n.op_type for n in fused.placement()] == ["RoundedGelu"]
    y = fused.run(None, {"x": x})[0]
    assert y.dtype == np.float32 and y.shape == x.shape
    monkeypatch.setattr(provider, "QDQ_PASSES", [p for p in qdq_fusions.QDQ_PASSES
                                                 if p.__name__ != "fuse_rounded_gelu"])
    apart = _session(model)
    assert "RoundedGelu" not in [n.op_type for n in apart.placement()]
    separate = apart.run(None, {"x": x})[0]
    # a NaN rounds to the zero point's value, so x * that is NaN again and rounds likewise: equal outputs
    assert not np.isnan(y).any() and y.reshape(-1)[3] == separate.reshape(-1)[3]
    finite = ~np.isnan(x)
    _close(y[finite], separate[finite], x[finite])
    _close(y[finite], reference(x)[finite], x[finite])
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    _close(y[finite], oracle[finite], x[finite])


def test_rounded_gelu_other_divisor_and_empty_input():
    """The constants are read, not assumed (x / 2 rather than x / sqrt(2)); an empty tensor gives an empty one."""
    rng = np.random.default_rng(6)
    model, reference = _model(np.uint8, rng, shape=(0, 8), divisor=2.0)
    assert _session(model).run(None, {"x": np.zeros((0, 8), np.float32)})[0].shape == (0, 8)
    model, reference = _model(np.uint8, rng, shape=(5, 8), divisor=2.0)
    x = (rng.standard_normal((5, 8)) * 3).astype(np.float32)
    session = _session(model)
    assert [n.op_type for n in session.placement()] == ["RoundedGelu"]
    _close(session.run(None, {"x": x})[0], reference(x), x)


def test_rounded_gelu_left_apart_when_a_value_is_read_twice():
    """An intermediate value that a graph output also reads keeps the nodes apart (and the results right)."""
    rng = np.random.default_rng(7)
    model, reference = _model(np.uint8, rng, shape=(4, 8))
    model.graph.output.append(tensor_info("ur", shape=[4, 8]))
    session = _session(model)
    assert "RoundedGelu" not in [n.op_type for n in session.placement()]
    x = rng.standard_normal((4, 8)).astype(np.float32)
    _close(session.run(None, {"x": x})[0], reference(x), x)


def test_rounded_gelu_rejects_a_non_scalar_constant():
    from onnx_runtime.errors import InvalidArgumentError
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.qdq_gelu import rounded_gelu

    node = Node("RoundedGelu", [f"i{i}" for i in range(10)], ["y"], name="g", domain="ai.onnx_runtime.cpu", opset=1)
    kernel = rounded_gelu(node, None, 1)
    f32, u8 = np.float32, np.uint8
    constants = [np.full(2, 1.4, f32), np.array(S1, f32), np.array(128, u8), np.array(1, f32), np.array(S2, f32),
                 np.array(0, u8), np.array(S3, f32), np.array(100, u8), np.array(0.5, f32)]
    with pytest.raises(InvalidArgumentError, match="divisor.*scalar"):
        kernel(np.zeros(4, f32), *constants)
    constants[0] = np.array(1.4, f32)
    with pytest.raises(InvalidArgumentError, match="'x' is float16"):
        kernel(np.zeros(4, np.float16), *constants)
