"""qdq_epilogues.fold_rounding_epilogues: a rounding (QuantizeDequantize) whose input only it reads becomes its
producer's epilogue (AddRounded, ConcatRounded, LayerNormalizationRounded, ...; ops/rounded_output.py); the values
stay those of the two kernels, and a producer whose output has another float reader keeps its rounding apart."""
from __future__ import annotations

import contextlib

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import provider
from onnx_runtime_ep_cpu.ops import rounded_output
from onnx_runtime_ep_cpu.ops.quantization import quantize_dequantize
from onnx_runtime_ep_cpu.registry import lookup

F32 = np.float32
# (scale, zero point) of each rounding in _model, uint8 codes
GRIDS = {"sum": (0.021, 120), "product": (0.017, 131), "joined": (0.019, 125), "normed": (0.013, 128)}


def _model(second_reader: bool = False) -> onnx.ModelProto:
    """x (1, 4, 1, 16), past (1, 4, 5, 16): Add of a row -> rounding -> Mul by past's last step (broadcast over
    heads) -> rounding -> Concat after past on axis 2 -> rounding -> LayerNormalization -> rounding, as
    quantize_static writes a decoder's activations; ``second_reader``: the Add's sum is a graph output too."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal(16).astype(F32) * 0.5, "row"),
             numpy_helper.from_array(rng.standard_normal((1, 1, 1, 16)).astype(F32), "factor"),
             numpy_helper.from_array(np.ones(16, F32) * 1.1, "gamma"),
             numpy_helper.from_array(np.full(16, 0.05, F32), "beta")]
    nodes = [helper.make_node("Add", ["x", "row"], ["sum"])]
    for name, (scale, zero) in GRIDS.items():
        inits += [numpy_helper.from_array(np.array(scale, F32), f"{name}_s"),
                  numpy_helper.from_array(np.array(zero, np.uint8), f"{name}_z")]
    nodes += [helper.make_node("QuantizeLinear", ["sum", "sum_s", "sum_z"], ["sum_q"]),
              helper.make_node("DequantizeLinear", ["sum_q", "sum_s", "sum_z"], ["sum_r"]),
              helper.make_node("Mul", ["sum_r", "factor"], ["product"]),
              helper.make_node("QuantizeLinear", ["product", "product_s", "product_z"], ["product_q"]),
              helper.make_node("DequantizeLinear", ["product_q", "product_s", "product_z"], ["product_r"]),
              helper.make_node("Concat", ["past", "product_r"], ["joined"], axis=2),
              helper.make_node("QuantizeLinear", ["joined", "joined_s", "joined_z"], ["joined_q"]),
              helper.make_node("DequantizeLinear", ["joined_q", "joined_s", "joined_z"], ["joined_r"]),
              helper.make_node("LayerNormalization", ["joined_r", "gamma", "beta"], ["normed"], axis=-1),
              helper.make_node("QuantizeLinear", ["normed", "normed_s", "normed_z"], ["normed_q"]),
              helper.make_node("DequantizeLinear", ["normed_q", "normed_s", "normed_z"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("joined_r", TensorProto.FLOAT, None)]
    if second_reader:
        outputs.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "rounded_chain", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 16]),
        helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 4, 5, 16])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _feeds() -> dict:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 4, 1, 16)) * 2).astype(F32)
    x.reshape(-1)[:3] = [1e3, -1e3, 0.5 * GRIDS["sum"][0]]  # saturation both ways, a tie
    return {"x": x, "past": rng.standard_normal((1, 4, 5, 16)).astype(F32)}


@contextlib.contextmanager
def _without_epilogues():
    saved = provider.QDQ_EPILOGUE_PASSES
    provider.QDQ_EPILOGUE_PASSES = []
    try:
        yield
    finally:
        provider.QDQ_EPILOGUE_PASSES = saved


def _run(model: onnx.ModelProto, feeds: dict) -> tuple[list[str], list[np.ndarray]]:
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    outputs = session.run(None, feeds)
    return [n.op_type for n in session.graph_for(feeds).nodes], outputs


def _rounded(v, name):
    scale, zero = GRIDS[name]
    return (np.clip(np.rint(v / scale) + zero, 0, 255) - zero) * scale


def _float64(feeds: dict, model: onnx.ModelProto) -> np.ndarray:
    """The QDQ graph's math in float64, rounded at the same points."""
    init = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    product = _rounded(_rounded(feeds["x"] + init["row"], "sum") * init["factor"], "product")
    joined = _rounded(np.concatenate([feeds["past"].astype(np.float64), product], axis=2), "joined")
    mean = joined.mean(-1, keepdims=True)
    normed = (joined - mean) / np.sqrt(((joined - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    return _rounded(normed * init["gamma"] + init["beta"], "normed")


def test_roundings_fold_into_their_producers_and_the_values_stay():
    model, feeds = _model(), _feeds()
    ops, got = _run(model, feeds)
    assert "QuantizeDequantize" not in ops, ops
    assert {"AddRounded", "MulRounded", "ConcatRounded", "LayerNormalizationRounded"} <= set(ops), ops
    with _without_epilogues():
        kept_ops, kept = _run(model, feeds)
    assert kept_ops.count("QuantizeDequantize") == 4 and len(ops) == len(kept_ops) - 4, kept_ops
    for a, b in zip(got, kept):
        np.testing.assert_array_equal(a, b)  # the same kernels' values: bit for bit
    step = GRIDS["normed"][0]
    assert float(np.abs(got[0] - _float64(feeds, model)).max()) <= step * (1 + 1e-5)  # one code: float32 vs 64
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    want = oracle.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert float(np.abs(got[0] - want[0]).max()) <= step * (1 + 1e-5)
    assert float(np.abs(got[1] - want[1]).max()) <= GRIDS["joined"][0] * (1 + 1e-5)


def test_a_producer_with_another_float_reader_keeps_its_rounding():
    model, feeds = _model(second_reader=True), _feeds()
    ops, got = _run(model, feeds)
    assert "Add" in ops and "AddRounded" not in ops and ops.count("QuantizeDequantize") == 1, ops
    init = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    np.testing.assert_array_equal(got[2], feeds["x"] + init["row"])  # the unrounded sum, as the graph says
    assert float(np.abs(got[0] - _float64(feeds, model)).max()) <= GRIDS["normed"][0] * (1 + 1e-5)


def _pair(op: str):
    """(the fused kernel, the operator's kernel, the rounding's kernel) for a binary ``op``."""
    node = Node(op + "Rounded", ["a", "b", "s", "z"], ["y"], attrs={"inner_opset": 14, "rounding_axis": 1,
                                                                     "rounding_opset": 19}, opset=1)
    fused = rounded_output.rounded_output(node, [None] * 4, 1)
    inner = lookup(op, "", 14)(Node(op, ["a", "b"], ["y"], opset=14), [None, None], 14)
    rounding = quantize_dequantize(Node("QuantizeDequantize", ["y", "s", "z"], ["q"], attrs={"axis": 1, "opset": 19}),
                                   [None] * 3, 1)
    return fused, inner, rounding


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("a_shape, b_shape", [
    ((1, 4, 1, 16), (1, 4, 1, 16)),  # the same shape
    ((1, 4, 3, 16), (16,)),  # a trailing row, lower rank
    ((1, 1, 3, 16), (1, 4, 3, 16)),  # the left operand repeats (order matters for Sub and Div)
    ((2, 5), (1,)), ((1,), (2, 5)),  # one value either side
    ((1, 4, 1), (1, 1, 6)),  # an outer product: neither repeats, the operator's kernel runs
    ((3, 1), (3, 8)),  # a column: not a trailing block
])
@pytest.mark.parametrize("signed", [False, True])
def test_the_compiled_epilogue_is_the_operator_then_the_rounding(op, a_shape, b_shape, signed):
    rng = np.random.default_rng(hash((op, a_shape, b_shape)) % 1000)
    a = (rng.standard_normal(a_shape) * 3).astype(F32)
    b = (rng.standard_normal(b_shape) * 3 + (4 if op == "Div" else 0)).astype(F32)
    (a if a.size > 1 else b).reshape(-1)[0] = np.nan  # (in the larger operand: one value would be NaN only)
    scale = np.array(0.043, F32)
    zero = np.array(-7, np.int8) if signed else np.array(121, np.uint8)
    scale.flags.writeable = zero.flags.writeable = False
    fused, inner, rounding = _pair(op)
    (got,) = fused(a, b, scale, zero)
    (want,) = rounding(inner(a, b)[0], scale, zero)
    assert got.shape == want.shape and got.dtype == F32
    np.testing.assert_array_equal(got, want)
    low, high = (-128, 127) if signed else (0, 255)
    exact = getattr(np, {"Add": "add", "Sub": "subtract", "Mul": "multiply", "Div": "divide"}[op])(
        a.astype(np.float64), b.astype(np.float64))
    reference = (np.clip(np.rint(exact / 0.043) + int(zero), low, high) - int(zero)) * 0.043
    finite = ~np.isnan(exact)
    assert float(np.abs(got[finite] - reference[finite]).max()) <= 0.043 * (1 + 1e-5)  # float32 vs float64: a code


def test_a_transposed_operand_takes_the_compiled_epilogue_with_the_same_values():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((1, 3, 4, 16)).astype(F32).transpose(0, 2, 1, 3)  # a head split's view
    b = rng.standard_normal((1, 1, 3, 16)).astype(F32)
    scale, zero = np.array(0.02, F32), np.array(128, np.uint8)
    fused, inner, rounding = _pair("Mul")
    np.testing.assert_array_equal(fused(a, b, scale, zero)[0], rounding(inner(a, b)[0], scale, zero)[0])


@pytest.mark.parametrize("name", ["gpt2.torchscript", "gpt2.dynamo", "llama.torchscript", "llama.dynamo",
                                  "t5_decoder.torchscript", "t5_decoder.dynamo"])
@pytest.mark.parametrize("call", ["prefill", "decode"])
def test_decoder_roundings_fold_and_the_outputs_stay(qdq_decoders, name, call):
    built, entries, zoo_feeds = qdq_decoders
    feeds = zoo_feeds.make_feeds(entries[name + ".fp32"]["calls"][call])
    folded = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
    got = folded.run(None, feeds)
    with _without_epilogues():
        plain = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
        kept = plain.run(None, feeds)
        plain_ops = [n.op_type for n in plain.graph_for(feeds).nodes]
    ops = [n.op_type for n in folded.graph_for(feeds).nodes]
    assert sum(op.endswith("Rounded") for op in ops) >= 6, ops
    assert ops.count("QuantizeDequantize") <= plain_ops.count("QuantizeDequantize") - 6, (ops, plain_ops)
    assert len(ops) < len(plain_ops) - 6
    for a, b in zip(got, kept):
        np.testing.assert_array_equal(a, b)
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    want = oracle.InferenceSession(str(built[name]), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(got, want):  # a few codes of each output's grid: onnxruntime's integer kernels round apart
        assert float(np.abs(a - b).max()) <= 0.08 * max(1.0, float(np.abs(b).max()))
