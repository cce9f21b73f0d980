"""The edges of a half-precision model computed in float32 (precision_fusions.py, ops/precision.py): the
conversions between float32 and float16/bfloat16 (compiled passes, bit for bit numpy's and ml_dtypes'), the
model's half-precision inputs widened and outputs narrowed in one node each, the roundings of its float32
inputs in one node, and the specializer's shapes reaching the values those conversions make."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import precision
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops.precision import float_to_half, half_to_float, round_to_half

F16, BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)


def _ops(sess) -> list[str]:
    return [n.op_type for n in sess.placement()]


def _float32_patterns(rng) -> list[np.ndarray]:
    """Random bit patterns (every exponent, NaN and infinities among them), float16's subnormal range, the
    thresholds (overflow, smallest normal, ties), and a strided view."""
    patterns = rng.integers(0, 2 ** 32, size=100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    tiny = rng.uniform(-2.0 ** -13, 2.0 ** -13, 20_000).astype(np.float32)
    edges = np.tile(np.array([0.0, -0.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14,
                              2.0 ** -14 * (1 - 2.0 ** -12), 65504, 65519.99, 65520, -65520, 3.4e38, -3.4e38,
                              np.inf, -np.inf, np.nan, 1e-45, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8],
                             np.float32), 256)
    strided = rng.standard_normal((64, 80)).astype(np.float32)[:, ::2]
    return [patterns, tiny, edges, strided, edges[:20]]  # the last below the compiled loops' sizes


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (payloads are not kept the same way)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    wide_got, wide_want = got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(wide_got), np.isnan(wide_want))
    finite = ~np.isnan(wide_want)
    bits = np.uint16 if got.itemsize == 2 else np.uint32
    np.testing.assert_array_equal(got.view(bits)[finite], want.view(bits)[finite])


@pytest.mark.parametrize("half", [F16, BF16], ids=["float16", "bfloat16"])
def test_narrow_and_widen_equal_numpys_conversions(half):
    rng = np.random.default_rng(11)
    for x in _float32_patterns(rng):
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(half)
        _same_bits(precision.narrow(x, half), want)
        _same_bits(precision.round_to(x, half), want.astype(np.float32))
    every = np.tile(np.arange(2 ** 16, dtype=np.uint16).view(half), 2)  # every half-precision value
    _same_bits(precision.widen(every), every.astype(np.float32))
    _same_bits(precision.widen(every.reshape(32, -1)[:, ::3]), every.reshape(32, -1)[:, ::3].astype(np.float32))


def test_conversions_while_numba_loads_are_numpys(monkeypatch):
    """While the compiled loops load in the background (deferred.py), the conversions are numpy's own."""
    monkeypatch.setattr(precision, "numpy_first", lambda: True)
    x = np.random.default_rng(12).standard_normal(10_000).astype(np.float32) * 1e5
    with np.errstate(over="ignore"):
        want = x.astype(F16)
    _same_bits(precision.narrow(x, F16), want)
    _same_bits(precision.round_to(x, F16), want.astype(np.float32))
    _same_bits(precision.widen(want), want.astype(np.float32))


def _float16_model(keep_io_types: bool):
    """A decoder-like step converted by onnxruntime's float16 tool: the past (batch, 2, past, 4) and the new
    entries (batch, 2, seq, 4) concatenated into the present (an output), multiplied by a weight, and that
    product reshaped to the past's own shape read by Shape (as exporters compute reshape targets)."""
    converter = pytest.importorskip("onnxruntime.transformers.float16")
    rng = np.random.default_rng(13)
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
             helper.make_node("MatMul", ["present", "w"], ["h"]),
             helper.make_node("Shape", ["past"], ["past_shape"]),
             helper.make_node("Slice", ["h", "zero", "past_length", "two"], ["head"]),
             helper.make_node("Reshape", ["head", "past_shape"], ["y"])]
    inits = [numpy_helper.from_array((rng.standard_normal((4, 4)) * 0.5).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2], np.int64), "two")]
    nodes.insert(3, helper.make_node("Gather", ["past_shape", "two_scalar"], ["past_length_scalar"]))
    nodes.insert(4, helper.make_node("Unsqueeze", ["past_length_scalar", "zero"], ["past_length"]))
    inits.append(numpy_helper.from_array(np.array(2, np.int64), "two_scalar"))
    model = make_model(nodes, [tensor_info("past", shape=["batch", 2, "past", 4]),
                               tensor_info("new", shape=["batch", 2, "seq", 4])],
                       [tensor_info("present", shape=["batch", 2, "total", 4]),
                        tensor_info("y", shape=["batch", 2, "past", 4])], inits)
    half = converter.convert_float_to_float16(model, keep_io_types=keep_io_types)
    past = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    new = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    w16 = numpy_helper.to_array(inits[0]).astype(F16).astype(np.float64)
    return half, past, new, w16


def test_half_inputs_and_outputs_convert_in_one_node_each():
    """float16 inputs widen in one HalfToFloat node, float16 outputs narrow in one FloatToHalf node; the
    present is the exact concatenation, the product the float32 one of the float16 values rounded once."""
    model, past, new, w16 = _float16_model(keep_io_types=False)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = _ops(sess)
    assert ops.count("HalfToFloat") == 1 and ops.count("FloatToHalf") == 1 and "Cast" not in ops, ops
    feeds = {"past": past.astype(F16), "new": new.astype(F16)}
    present, y = sess.run(None, feeds)
    assert present.dtype == F16 and y.dtype == F16
    np.testing.assert_array_equal(present, np.concatenate([feeds["past"], feeds["new"]], axis=2))
    exact = (present.astype(np.float64) @ w16)[:, :, :5]
    np.testing.assert_allclose(y.astype(np.float64), exact, rtol=2.0 ** -11, atol=2.0 ** -11 * np.abs(exact).max())
    oracle = pytest.importorskip("onnxruntime")
    want = oracle.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(present, want[0])
    np.testing.assert_allclose(y.astype(np.float64), want[1].astype(np.float64), rtol=1e-2, atol=1e-2)


def test_float32_inputs_are_rounded_in_one_node():
    """With float32 edges the model's Casts of its inputs to float16 become one RoundToHalf node."""
    model, past, new, w16 = _float16_model(keep_io_types=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert _ops(sess).count("RoundToHalf") == 1, _ops(sess)
    present, y = sess.run(None, {"past": past, "new": new})
    want = np.concatenate([past, new], axis=2).astype(F16).astype(np.float32)
    np.testing.assert_array_equal(present, want)
    exact = (want.astype(np.float64) @ w16)[:, :, :5]
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()


def test_specialized_graph_folds_the_shape_of_a_half_input():
    """For a signature the specializer folds the Shape of a float16 input (the conversion's float32 copy would
    have kept its symbolic dimensions), so the reshape target is a constant."""
    model, past, new, _ = _float16_model(keep_io_types=False)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = {"past": past.astype(F16), "new": new.astype(F16)}
    graph = sess.graph_for(feeds)
    assert "Shape" not in [node.op_type for node in graph.nodes], [node.op_type for node in graph.nodes]
    values = {vi.name: vi for vi in graph.value_info.values()}
    assert values["past/float32"].type.shape == (1, 2, 5, 4)
    np.testing.assert_array_equal(sess.run(None, feeds)[0], np.concatenate([feeds["past"], feeds["new"]], axis=2))


def _node(op_type: str, inputs: int, **attrs) -> Node:
    return Node(op_type, [f"x{i}" for i in range(inputs)], [f"y{i}" for i in range(inputs)], name="edge",
                domain=FUSED_DOMAIN, attrs=attrs, opset=1)


def test_conversion_nodes_refuse_wrong_types():
    with pytest.raises(InvalidGraphError, match=r"'to' is 1; expected float16 \(10\) or bfloat16 \(16\)"):
        float_to_half(_node("FloatToHalf", 1, to=1), [], 1)
    with pytest.raises(InvalidArgumentError, match=r"input 1 \('x1'\) is int64; expected a float tensor"):
        round_to_half(_node("RoundToHalf", 2, to=10), [], 1)(np.zeros(3, np.float32), np.zeros(3, np.int64))
    with pytest.raises(InvalidArgumentError, match=r"input 0 \('x0'\) is float32; expected a float16 or bfloat16"):
        half_to_float(_node("HalfToFloat", 1), [], 1)(np.zeros(3, np.float32))
    with pytest.raises(InvalidArgumentError, match=r"input 0 \('x0'\) is float16; expected a float32 tensor"):
        float_to_half(_node("FloatToHalf", 1, to=16), [], 1)(np.zeros(3, F16))
    outputs = round_to_half(_node("RoundToHalf", 2, to=16), [], 1)(np.full(3, 1 + 2.0 ** -9, np.float32),
                                                                   np.full(5000, np.pi, np.float32))
    _same_bits(outputs[0], np.full(3, 1.0, np.float32))
    _same_bits(outputs[1], np.full(5000, np.pi, np.float32).astype(BF16).astype(np.float32))


def test_nodes_the_pass_rewrites_drop_their_written_form():
    """A node the pass renames or retypes no longer carries the NodeProto it was read from (onnx inference
    of a node reads it: symbolic_dims re-infers through it), so every proto left is the node as it stands;
    here an int64 -> float16 Cast, kept as a rounding pair, reads the pass's new value."""
    converter = pytest.importorskip("onnxruntime.transformers.float16")
    rng = np.random.default_rng(14)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Cast", ["positions"], ["p"], to=1),
             helper.make_node("Add", ["h", "p"], ["y"])]
    w = (rng.standard_normal((4, 3)) * 0.5).astype(np.float32)
    model = make_model(nodes, [tensor_info("x", shape=["n", 4]), tensor_info("positions", 7, shape=["n", 1])],
                       [tensor_info("y", shape=["n", 3])], [numpy_helper.from_array(w, "w")])
    model = converter.convert_float_to_float16(model, keep_io_types=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32), "positions": np.arange(2045, 2050)[:, None]}
    graph = sess.graph_for(feeds)
    for node in graph.nodes:
        if node.proto is not None:
            assert (list(node.proto.input), list(node.proto.output)) == (node.inputs, node.outputs), node.op_type
    exact = feeds["x"].astype(F16).astype(np.float64) @ w.astype(F16).astype(np.float64) \
        + feeds["positions"].astype(F16).astype(np.float64)  # 2045 and 2047 round to 2044 and 2048
    got = sess.run(None, feeds)[0]
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


def test_roundings_of_several_inputs_in_one_call_equal_each_rounded_alone():
    """RoundToHalf over several float32 inputs rounds them in one buffer and returns views of it: each equals
    its own rounding, in its own shape (a strided input and an empty one among them)."""
    rng = np.random.default_rng(15)
    inputs = [rng.standard_normal((1, 4, 16, 16)).astype(np.float32) * 1e4,
              rng.standard_normal((6, 10)).astype(np.float32)[:, ::2], np.zeros((1, 4, 0, 16), np.float32),
              np.full((3, 700), 2.0 ** -20, np.float32)]
    outputs = round_to_half(_node("RoundToHalf", len(inputs), to=10), [], 1)(*inputs)
    for got, x in zip(outputs, inputs):
        assert got.shape == x.shape
        _same_bits(got, x.astype(F16).astype(np.float32))


def test_half_input_read_only_for_its_shape_is_not_widened():
    """A float16 input whose only reader is Shape (a reshape target) is not converted at all."""
    rng = np.random.default_rng(16)
    w = (rng.standard_normal((6, 6)) * 0.3).astype(F16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Shape", ["like"], ["target"]),
             helper.make_node("Reshape", ["h", "target"], ["y"])]
    model = make_model(nodes, [tensor_info("x", 10, ["n", 6]), tensor_info("like", 10, ["n", 2, 3])],
                       [tensor_info("y", 10, ["n", 2, 3])], [numpy_helper.from_array(w, "w")])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    widen = [node for node in sess.graph_for({"x": np.zeros((4, 6), F16), "like": np.zeros((4, 2, 3), F16)}).nodes
             if node.op_type == "HalfToFloat"]
    assert [node.inputs for node in widen] == [["x"]]
    x = rng.standard_normal((4, 6)).astype(F16)
    got = sess.run(None, {"x": x, "like": np.zeros((4, 2, 3), F16)})[0]
    exact = (x.astype(np.float64) @ w.astype(np.float64)).reshape(4, 2, 3)
    assert got.dtype == F16
    np.testing.assert_allclose(got.astype(np.float64), exact, rtol=2.0 ** -10, atol=2.0 ** -10)
