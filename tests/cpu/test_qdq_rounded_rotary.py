"""qdq_rotary.fuse_rounded_rotary: a QDQ decoder's rotate-half rotary embedding (x * cos + concat(-x[..., half:],
x[..., :half]) * sin, each activation rounded to its grid, as quantize_static writes it for both torch exporters)
runs as one RoundedRotary node (ops/qdq_rotary.py, compiled/rounded_rotary.py) whose values are the unfused
nodes', bit for bit, within one code of a float64 evaluation of the same roundings and of onnxruntime's."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import ops_and_outputs, oracle_session, qdq_epilogues_without, qdq_zoo_sessions
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import generic_int8
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops.qdq_rotary import rounded_rotary

F32 = np.float32
DEPTH, HALF = 16, 8
# (scale, zero point) of each rounding, uint8 codes; int8 ones (zero - 128) where ``signed``
GRIDS = {"x": (0.031, 128), "cos": (0.0079, 128), "sin": (0.0078, 127), "direct": (0.023, 130),
         "neg": (0.031, 126), "cat": (0.033, 128), "turned": (0.021, 125), "sum": (0.037, 129)}
ROUNDINGS = ("direct", "neg", "cat", "turned", "sum")


def _grid(name: str, signed: bool) -> tuple:
    scale, zero = GRIDS[name]
    return np.array(scale, F32), np.array(zero - 128, np.int8) if signed else np.array(zero, np.uint8)


def _constants(signed: bool, rounded_sum: bool) -> list:
    out = []
    for name in ROUNDINGS[:5 if rounded_sum else 4]:
        for value in _grid(name, signed):
            value.flags.writeable = False  # as initializers are
            out.append(value)
    return out


def _want(x, cos, sin, signed: bool, rounded_sum: bool, half=HALF):
    """float64 of the quantized math: each product, negation and concatenation rounded to its grid."""
    low, high = (-128, 127) if signed else (0, 255)

    def grid(v, name):  # (NaN: code 0, as QuantizeLinear's saturating cast gives it)
        scale, zero = (np.float64(a) for a in _grid(name, signed))
        codes = np.clip(np.rint(v / scale) + zero, low, high)
        return (np.where(np.isnan(codes), 0, codes) - zero) * scale

    x, cos, sin = (np.asarray(a, np.float64) for a in (x, cos, sin))
    turned = np.concatenate((grid(-x[..., half:], "neg"), x[..., :half]), axis=-1)
    y = grid(x * cos, "direct") + grid(grid(turned, "cat") * sin, "turned")
    return grid(y, "sum") if rounded_sum else y


def _kernel(rounded_sum: bool, half=HALF, end=DEPTH):
    names = ["x", "cos", "sin"] + [f"{r}_{p}" for r in ROUNDINGS[:5 if rounded_sum else 4] for p in "sz"]
    node = Node("RoundedRotary", names, ["y"], name="rotary", domain=FUSED_DOMAIN,
                attrs={"half": half, "end": end}, opset=1)
    return rounded_rotary(node, [None] * len(names), 1)


def _on_grid(rng, shape, name="x"):
    """Values on x's grid (a product's dequantized output), a few at its saturation ends."""
    scale, zero = GRIDS[name]
    codes = rng.integers(0, 256, shape).astype(F32)
    codes.reshape(-1)[:2] = [0, 255]
    return ((codes - F32(zero)) * F32(scale)).astype(F32)


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("rounded_sum", [False, True])
@pytest.mark.parametrize("x_shape,table_shape,half", [((1, 4, 1, 16), (1, 1, 1, 16), 8),
                                                      ((2, 4, 5, 16), (1, 1, 5, 16), 8),
                                                      ((2, 3, 5, 16), (2, 1, 5, 16), 8),
                                                      ((1, 2, 3, 10), (1, 1, 3, 10), 4)])
def test_kernel_within_one_code_of_float64_and_equal_to_its_twin(signed, rounded_sum, x_shape, table_shape, half):
    rng = np.random.default_rng(sum(x_shape) + half)
    kernel = _kernel(rounded_sum, half, x_shape[-1])
    constants = _constants(signed, rounded_sum)
    x = _on_grid(rng, x_shape)
    x.reshape(-1)[2] = np.float32(1e4)  # saturation of every rounding it reaches
    angles = rng.uniform(-3, 3, table_shape)
    cos, sin = np.cos(angles).astype(F32), np.sin(angles).astype(F32)
    for _ in range(3):  # the first call, then the bound entry point's
        (got,) = kernel(x, cos, sin, *constants)
    want = _want(x, cos, sin, signed, rounded_sum, half)
    code = F32(GRIDS["sum"][0]) if rounded_sum else F32(GRIDS["direct"][0]) + F32(GRIDS["turned"][0])
    assert got.shape == x_shape and got.dtype == F32
    assert np.abs(got - want).max() <= code * 1.001
    # (an unrounded sum is float32's addition of the two rounded products)
    assert np.mean(np.isclose(got, want, rtol=1e-6, atol=0)) >= 0.95
    # the numpy twin (which serves while numba loads) gives the same float32 values
    params = np.zeros(20, F32)
    for k, name in enumerate(ROUNDINGS):
        scale, zero = _grid(name, signed)
        params[4 * k:4 * k + 4] = (scale, zero, *((-128, 127) if signed else (0, 255)))
    rows = x_shape[0] * x_shape[1] * x_shape[2]
    table = np.broadcast_to(np.arange(table_shape[0] * table_shape[2]).reshape(table_shape[0], 1, table_shape[2]),
                            x_shape[:3]).reshape(-1)
    twin = np.empty((rows, x_shape[-1]), F32)
    generic_int8.rounded_rotary(x.reshape(rows, -1), cos.reshape(-1, x_shape[-1]), sin.reshape(-1, x_shape[-1]),
                                table, half, params, rounded_sum, twin)
    np.testing.assert_array_equal(got.reshape(rows, -1), twin)


def test_nan_and_empty_inputs():
    kernel, constants = _kernel(True), _constants(False, True)
    x = np.full((1, 2, 1, DEPTH), np.nan, F32)
    ones = np.ones((1, 1, 1, DEPTH), F32)
    (got,) = kernel(x, ones, ones, *constants)
    want = _want(x, ones, ones, False, True)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= F32(GRIDS["sum"][0]) * 1.001
    (empty,) = kernel(np.zeros((1, 2, 0, DEPTH), F32), np.zeros((1, 1, 0, DEPTH), F32),
                      np.zeros((1, 1, 0, DEPTH), F32), *constants)
    assert empty.shape == (1, 2, 0, DEPTH) and empty.dtype == F32


def test_bad_inputs_are_typed_errors():
    kernel, constants = _kernel(False), _constants(False, False)
    x, table = np.zeros((1, 2, 3, DEPTH), F32), np.zeros((1, 1, 3, DEPTH), F32)
    with pytest.raises(OnnxRuntimeError, match="'cos'"):
        kernel(x, np.zeros((1, 1, 4, DEPTH), F32), np.zeros((1, 1, 4, DEPTH), F32), *constants)
    with pytest.raises(OnnxRuntimeError, match="'cos'"):
        kernel(np.zeros((1, 2, 3, 12), F32), table[..., :12], table[..., :12], *constants)  # not its last axis
    with pytest.raises(OnnxRuntimeError, match="'x' is float64"):
        kernel(x.astype(np.float64), table, table, *constants)
    bad = list(constants)
    bad[2] = np.array(0.1, np.float64)
    with pytest.raises(OnnxRuntimeError, match="negation grid"):
        kernel(x, table, table, *bad)
    with pytest.raises(OnnxRuntimeError, match="grid inputs"):
        kernel(x, table, table, *constants[:6])


def _model(form: str, signed: bool = False, rounded_sum: bool = True, extra_reader: bool = False) -> onnx.ModelProto:
    """x rounded -> the rotation in ``form``: "torchscript" (opset 17, Slice over axis -1 to INT64_MAX, Mul(x, cos))
    or "dynamo" (opset 18, Slice over axis 3 to the size, Mul(cos, x)); the sum rounded or a graph output as it is.
    ``extra_reader``: the rounded concatenation is a graph output too."""
    axis, end = (-1, 2**63 - 1) if form == "torchscript" else (3, DEPTH)
    inits = [numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("zero", 0), ("half", HALF), ("end", end), ("axis", axis))]
    nodes: list = []

    def rounded(name, value):
        scale, zero = _grid(name, signed)
        inits.extend([numpy_helper.from_array(scale, f"{name}_s"), numpy_helper.from_array(zero, f"{name}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [value, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                      helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_r"])])
        return f"{name}_r"

    x, cos, sin = rounded("x", "x"), rounded("cos", "cos"), rounded("sin", "sin")
    nodes.append(helper.make_node("Mul", [x, cos] if form == "torchscript" else [cos, x], ["direct"]))
    nodes.append(helper.make_node("Slice", [x, "zero", "half", "axis"], ["low"]))
    nodes.append(helper.make_node("Slice", [x, "half", "end", "axis"], ["high"]))
    nodes.append(helper.make_node("Neg", ["high"], ["neg"]))
    nodes.append(helper.make_node("Concat", [rounded("neg", "neg"), "low"], ["cat"], axis=-1))
    cat = rounded("cat", "cat")
    nodes.append(helper.make_node("Mul", [cat, sin], ["turned"]))
    nodes.append(helper.make_node("Add", [rounded("direct", "direct"), rounded("turned", "turned")], ["sum"]))
    out = rounded("sum", "sum") if rounded_sum else "sum"
    nodes.append(helper.make_node("Identity", [out], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info(cat, TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "steps", DEPTH]),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, [1, 1, "steps", DEPTH]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, [1, 1, "steps", DEPTH])]
    graph = helper.make_graph(nodes, "rotary", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17 if form == "torchscript" else 18)])


def _feeds(steps=3, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, 4, steps, DEPTH)) * 2).astype(F32)
    x.reshape(-1)[:3] = [1e3, -1e3, 0.5 * GRIDS["x"][0]]  # saturation both ways, a tie
    angles = rng.uniform(-3, 3, (1, 1, steps, DEPTH))
    return {"x": x, "cos": np.cos(angles).astype(F32), "sin": np.sin(angles).astype(F32)}


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
@pytest.mark.parametrize("signed,rounded_sum", [(False, True), (True, True), (False, False), (True, False)])
def test_rotation_is_one_node_with_the_unfused_values(form, signed, rounded_sum):
    model, feeds = _model(form, signed, rounded_sum), _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rotary"):
        plain_ops, want = ops_and_outputs(model, feeds)
    assert ops.count("RoundedRotary") == 1 and "Slice" not in ops and "ConcatRounded" not in ops, ops
    assert "RoundedRotary" not in plain_ops and "ConcatRounded" in plain_ops
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have.view(np.uint32), expected.view(np.uint32))  # bit for bit
    assert len(np.unique(got[0])) > 20  # the roundings leave many distinct values


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_rotation_against_onnxruntime(form):
    model = _model(form)
    theirs = oracle_session(model)
    for steps in (1, 5):
        feeds = _feeds(steps, seed=steps)
        ops, (got,) = ops_and_outputs(model, feeds)
        (want,) = theirs.run(None, feeds)
        assert ops.count("RoundedRotary") == 1
        # the same float32 operations: a value within rounding of a half-code may land one code over
        assert np.abs(got - want).max() <= F32(GRIDS["sum"][0]) * 1.001
        assert np.mean(got == want) >= 0.98


def test_a_read_intermediate_keeps_the_nodes():
    model, feeds = _model("dynamo", extra_reader=True), _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rotary"):
        _, want = ops_and_outputs(model, feeds)
    assert "RoundedRotary" not in ops
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have, expected)


@pytest.mark.parametrize("name", ["llama.torchscript", "llama.dynamo"])
def test_zoo_llama_decode_rotations(qdq_decoders, name):
    """Both exporters' QDQ LLaMA: the four rotations (q and k of two layers) fold in prefill and decode; outputs bit
    for bit those of the unfused nodes, within a few codes of onnxruntime's."""
    zoo_feeds = qdq_decoders[2]
    calls, theirs, ours, plain = qdq_zoo_sessions(qdq_decoders, name, "fuse_rounded_rotary")
    with qdq_epilogues_without("fuse_rounded_rotary"):
        for call in ("prefill", "decode"):
            plain.run(None, zoo_feeds.make_feeds(calls[call]))
    for call in ("prefill", "decode"):
        feeds = zoo_feeds.make_feeds(calls[call])
        got = [ours.run(None, feeds) for _ in range(2)][-1]
        ops = [n.op_type for n in ours.graph_for(feeds).nodes]
        assert ops.count("RoundedRotary") == 4 and "Slice" not in ops, ops
        for a, b in zip(got, plain.run(None, feeds)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(got, theirs.run(None, feeds)):
            assert float(np.abs(a - b).max()) <= 0.08 * max(1.0, float(np.abs(b).max()))
