"""GeluMul: a GeGLU block's gated unit, Mul(Gelu(a), b) (Gemma's Mul(Gelu(A Wg), A Wu)), as one fused node and one
compiled pass, for ONNX's Gelu (erf and tanh forms), contrib's Gelu and FastGelu. The kernel against a float64
reference (column views of a merged product included), the fusion on both the prefill's rows and a decode step's
one row (the gate and up products then one ProjectionGroup), and the near misses that keep their nodes."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import holdout_planned_ops, make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.registry import lookup

RNG = np.random.default_rng(11)


def _gelu64(x: np.ndarray, approximate: str) -> np.ndarray:
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _bound(a: np.ndarray, b: np.ndarray, approximate: str) -> np.ndarray:
    """float32's bound on Gelu(a) * b: a few roundings of each factor (the erf form's series is within float32 of
    erf), relative to the magnitudes."""
    return 8 * np.finfo(np.float32).eps * (np.abs(_gelu64(a, approximate)) + np.abs(a)) * np.abs(b) + 1e-30


def _kernel(approximate: str):
    node = Node("GeluMul", ["a", "b"], ["y"], name="gelu_mul", domain=FUSED_DOMAIN,
                attrs={"approximate": approximate}, opset=1)
    return lookup("GeluMul", FUSED_DOMAIN, 1)(node, [None, None], 1)


def _views(shape, dtype=np.float32):
    """a and b as the column views a ProjectionGroup returns: halves of one (..., 2 * last) product."""
    merged = (RNG.standard_normal(shape[:-1] + (2 * shape[-1],)) * 3).astype(dtype)
    return merged[..., :shape[-1]], merged[..., shape[-1]:]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(1, 1, 128), (1, 16, 128), (2, 5, 33), (1,)])
def test_the_kernel_is_within_float32_of_a_float64_reference(approximate, shape):
    a, b = _views(shape)
    a[..., :1] = -30.0  # the far negative tail: 0 times the gate, no NaN
    (got,) = _kernel(approximate)(a, b)
    want = _gelu64(a, approximate) * b
    assert got.dtype == np.float32 and got.shape == shape
    assert np.all(np.abs(got - want) <= _bound(a, b, approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_other_dtypes_and_a_broadcast_gate_compute_gelu_then_mul(approximate):
    kernel = _kernel(approximate)
    a64, b64 = _views((3, 8), np.float64)
    (got,) = kernel(a64, b64)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, _gelu64(a64, approximate) * b64, rtol=1e-12, atol=1e-12)
    a16, b16 = (RNG.standard_normal((3, 8)) * 2).astype(np.float16), RNG.standard_normal((3, 8)).astype(np.float16)
    (got16,) = kernel(a16, b16)
    assert got16.dtype == np.float16
    np.testing.assert_allclose(got16.astype(np.float64), _gelu64(a16, approximate) * b16, rtol=4e-3, atol=4e-3)
    a, gate = _views((4, 16))
    row = gate[:1]
    (got,) = kernel(a, row)
    assert np.all(np.abs(got - _gelu64(a, approximate) * row) <= _bound(a, np.broadcast_to(row, a.shape), approximate))


def test_other_approximations_are_refused_naming_the_attribute():
    with pytest.raises(Exception, match="approximate"):
        _kernel("sigmoid")


HIDDEN, INNER = 64, 128


def _geglu_model(gelu: str, extra_reader: bool = False) -> tuple:
    """y = Mul(Gelu(x Wg), x Wu) Wd over x (batch, seq, HIDDEN), the Gelu spelled ``gelu`` ("none"/"tanh" for
    ONNX's, "contrib" for com.microsoft's Gelu, "fast" for FastGelu); ``extra_reader``: the Gelu's output is also a
    graph output."""
    weights = {name: (RNG.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)
               for name, shape in (("wg", (HIDDEN, INNER)), ("wu", (HIDDEN, INNER)), ("wd", (INNER, HIDDEN)))}
    if gelu in ("none", "tanh"):
        activation, approximate = helper.make_node("Gelu", ["g"], ["act"], approximate=gelu), gelu
    else:
        op_type = "Gelu" if gelu == "contrib" else "FastGelu"
        activation = helper.make_node(op_type, ["g"], ["act"], domain="com.microsoft")
        approximate = "none" if gelu == "contrib" else "tanh"
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("MatMul", ["x", "wu"], ["u"]),
             activation, helper.make_node("Mul", ["act", "u"], ["h"]), helper.make_node("MatMul", ["h", "wd"], ["y"])]
    outputs = [tensor_info("y")] + ([tensor_info("act")] if extra_reader else [])
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])], outputs,
                       [numpy_helper.from_array(w, n) for n, w in weights.items()], opset=20)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, weights, approximate


def _reference(x, weights, approximate):
    x64 = x.astype(np.float64)
    g, u = x64 @ weights["wg"], x64 @ weights["wu"]
    return (_gelu64(g, approximate) * u) @ weights["wd"]


@pytest.mark.parametrize("gelu", ["none", "tanh", "contrib", "fast"])
@pytest.mark.parametrize("seq", [16, 1])
def test_a_geglu_block_is_one_gelu_mul_after_one_projection_group(gelu, seq):
    model, weights, approximate = _geglu_model(gelu)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((1, seq, HIDDEN)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    want = _reference(x, weights, approximate)
    # float32 products of depth 64 and 128 around the unit: a few hundred roundings of magnitude-sized terms
    assert np.max(np.abs(y - want)) <= 1e-5 * (1 + np.max(np.abs(want)))
    ops = [(node.op_type, node.domain) for node in session.graph_for({"x": x}).nodes]
    assert ("GeluMul", FUSED_DOMAIN) in ops and not any(op in ("Gelu", "FastGelu", "Mul") for op, _ in ops), ops
    assert ("ProjectionGroup", FUSED_DOMAIN) in ops, ops


def test_a_gelu_read_elsewhere_keeps_its_nodes():
    model, weights, approximate = _geglu_model("tanh", extra_reader=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((1, 4, HIDDEN)).astype(np.float32)
    y, act = session.run(None, {"x": x})
    assert np.max(np.abs(y - _reference(x, weights, approximate))) <= 1e-5 * (1 + np.max(np.abs(y)))
    assert np.max(np.abs(act - _gelu64(x.astype(np.float64) @ weights["wg"], approximate))) <= 1e-5
    ops = [node.op_type for node in session.graph_for({"x": x}).nodes]
    assert "GeluMul" not in ops and "Gelu" in ops and "Mul" in ops, ops


GEMMAS = [f"gemma.{exporter}.{variant}" for exporter in ("torchscript", "dynamo") for variant in ("fp32", "fp16")]


@pytest.mark.parametrize("name", GEMMAS)
def test_holdout_gemma_runs_each_gated_unit_as_one_gelu_mul(name):
    """Prefill and decode graphs of both exporters, float32 and float16: two GeluMuls (one per layer), no Gelu."""
    for call, ops in holdout_planned_ops(name).items():
        assert ops.count("GeluMul") == 2 and "Gelu" not in ops, (call, ops)
