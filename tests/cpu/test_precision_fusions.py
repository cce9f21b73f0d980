"""Half-precision models computed in float32 (precision_fusions.py): a float16 model (float16 weights and
values, float32 or float16 at its edges, as onnxruntime's convert_float_to_float16 writes it) runs the float32
kernels and fusions, and its results are the float32 results of the same float16-rounded weights and inputs:
checked against a float64 reference of those at float32's error scale (a per-operator float16 computation
would miss it by float16's), and within float16's 1e-2 class of onnxruntime. Single operators on float16
feeds (the ONNX backend's cases) keep their float16 semantics."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from reference64 import run_float64

F16 = TensorProto.FLOAT16


def _numpy(elem_type: int) -> np.dtype:
    return np.dtype(np.float16 if elem_type == F16 else ml_dtypes.bfloat16)


def _half_tensor(tensor: onnx.TensorProto, half: int) -> None:
    if tensor.data_type == TensorProto.FLOAT:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(_numpy(half)), tensor.name))


def _cast_edges(graph: onnx.GraphProto, half: int) -> None:
    """float32 inputs and outputs kept, a Cast to float16 after each input and from float16 before each output."""
    heads, tails = [], []
    for info in graph.input:
        for node in graph.node:
            node.input[:] = [f"{i}/half" if i == info.name else i for i in node.input]
        heads.append(helper.make_node("Cast", [info.name], [f"{info.name}/half"], to=half))
    for info in graph.output:
        for node in graph.node:
            node.output[:] = [f"{o}/half" if o == info.name else o for o in node.output]
            node.input[:] = [f"{i}/half" if i == info.name else i for i in node.input]
        tails.append(helper.make_node("Cast", [f"{info.name}/half"], [info.name], to=TensorProto.FLOAT))
    nodes = heads + list(graph.node) + tails
    del graph.node[:]
    graph.node.extend(nodes)


def to_float16(model: onnx.ModelProto, keep_io_types: bool = True, half: int = F16) -> onnx.ModelProto:
    """``model`` (float32 throughout) converted as onnxruntime's convert_float_to_float16 does: float16
    weights, values and constant attributes; with ``keep_io_types``, float32 inputs and outputs and a Cast at
    each edge. ``half``: the type converted to (float16, or bfloat16 the same way)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    for tensor in graph.initializer:
        _half_tensor(tensor, half)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                _half_tensor(attr.t, half)
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = half
    for info in [*graph.value_info, *([] if keep_io_types else [*graph.input, *graph.output])]:
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = half
    if keep_io_types:
        _cast_edges(graph, half)
    onnx.checker.check_model(model)
    return model


def rounded_float32(model: onnx.ModelProto, half: int = F16) -> onnx.ModelProto:
    """``model`` (float32) with its weights rounded to float16 and kept float32: the values the float16 model
    holds, for the float64 reference."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            array = numpy_helper.to_array(tensor).astype(_numpy(half)).astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    return model


def _ops(sess) -> list[str]:
    return [n.op_type for n in sess.placement()]


def _f32(shape, rng, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _check(model32, feeds, fused_ops, absent_ops, keep_io_types=True, float32_scale=1e-5):
    """Run the float16 conversion of ``model32``: its kernels are the float32 fusions (``fused_ops`` present,
    ``absent_ops`` gone), its result the float32 one of the float16-rounded weights and inputs (within
    ``float32_scale`` of the magnitude of a float64 reference), and within 1e-2 of onnxruntime's."""
    model16 = to_float16(model32, keep_io_types)
    sess = ort.InferenceSession(model16.SerializeToString(), providers=["cpu"])
    ops = _ops(sess)
    assert all(op in ops for op in fused_ops), ops
    assert not any(op in ops for op in absent_ops), ops
    run_feeds = feeds if keep_io_types else {k: v.astype(np.float16) for k, v in feeds.items()}
    got = sess.run(None, run_feeds)[0]
    assert got.dtype == (np.float32 if keep_io_types else np.float16)
    rounded = {k: v.astype(np.float16).astype(np.float32) for k, v in feeds.items()}
    exact = run_float64(rounded_float32(model32), rounded)[0]
    magnitude = float(np.abs(exact).max())
    error = float(np.abs(got.astype(np.float64) - exact).max())
    # float16 outputs are rounded once more, at the edge: half a unit in float16's last place.
    edge = 0.0 if keep_io_types else 2.0 ** -11 * magnitude
    assert error <= float32_scale * magnitude + edge, (error, magnitude)
    oracle = pytest.importorskip("onnxruntime")
    options = oracle.SessionOptions()
    options.intra_op_num_threads = 1
    want = oracle.InferenceSession(model16.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"]).run(None, run_feeds)[0]
    assert np.all(np.abs(got.astype(np.float64) - want) <= 1e-2 * magnitude + 1e-2 * np.abs(want.astype(np.float64)))
    return sess


def _gelu_block(rows=(2, 3), k=32, n=48):
    """MatMul by a weight + bias, exact GELU spelled out (x * 0.5 * (1 + erf(x / sqrt(2)))), + a residual."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["hs"]),
        helper.make_node("Erf", ["hs"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["he"]),
        helper.make_node("Mul", ["he", "half"], ["g"]),
        helper.make_node("Add", ["g", "r"], ["y"]),
    ]
    inits = [numpy_helper.from_array(_f32((k, n), rng, 1 / math.sqrt(k)), "w"),
             numpy_helper.from_array(_f32((n,), rng, 0.1), "b"),
             _c("sqrt2", math.sqrt(2)), _c("one", 1.0), _c("half", 0.5)]
    model = make_model(nodes, [tensor_info("x", shape=[*rows, k]), tensor_info("r", shape=[*rows, n])],
                       [tensor_info("y", shape=[*rows, n])], inits)
    feeds = {"x": _f32((*rows, k), rng), "r": _f32((*rows, n), rng)}
    return model, feeds


def test_matmul_bias_gelu_residual_runs_the_float32_fused_kernel():
    model, feeds = _gelu_block()
    sess = _check(model, feeds, ["FusedMatMul"], ["MatMul", "Erf", "Div"])
    assert _ops(sess).count("RoundToHalf") == 1 and "Cast" not in _ops(sess)  # the inputs' roundings, in one node


def test_bfloat16_model_runs_the_float32_fused_kernel():
    """The same for a bfloat16 model (onnxruntime has no bfloat16 MatMul on CPU: the float64 reference only)."""
    model, feeds = _gelu_block()
    sess = ort.InferenceSession(to_float16(model, half=TensorProto.BFLOAT16).SerializeToString(), providers=["cpu"])
    assert "FusedMatMul" in _ops(sess) and "MatMul" not in _ops(sess), _ops(sess)
    got = sess.run(None, feeds)[0]
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rounded = {k: v.astype(bf16).astype(np.float32) for k, v in feeds.items()}
    exact = run_float64(rounded_float32(model, TensorProto.BFLOAT16), rounded)[0]
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


def test_float16_inputs_and_outputs_are_converted_at_the_edges():
    model, feeds = _gelu_block()
    sess = _check(model, feeds, ["FusedMatMul"], ["MatMul", "Erf"], keep_io_types=False)
    assert sess.get_inputs()[0].type == "tensor(float16)" and sess.get_outputs()[0].type == "tensor(float16)"


def test_layer_normalization_computes_in_float32():
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "scale", "bias"], ["y"], axis=-1, epsilon=1e-5)]
    inits = [numpy_helper.from_array(_f32((16, 64), rng, 0.25), "w"),
             numpy_helper.from_array(_f32((64,), rng) + 1, "scale"), numpy_helper.from_array(_f32((64,), rng), "bias")]
    model = make_model(nodes, [tensor_info("x", shape=[2, 5, 16])], [tensor_info("y", shape=[2, 5, 64])], inits)
    _check(model, {"x": _f32((2, 5, 16), rng)}, ["LayerNormalization"], [])


def test_attention_pattern_becomes_the_float32_attention_kernel():
    rng = np.random.default_rng(3)
    batch, heads, seq, dim = 1, 2, 8, 16
    hidden = heads * dim
    shape = np.array([batch, seq, heads, dim], np.int64)
    nodes = [helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}0"]) for p in "qkv"]
    for p in "qkv":
        nodes += [helper.make_node("Reshape", [f"{p}0", "shape"], [f"{p}1"]),
                  helper.make_node("Transpose", [f"{p}1"], [p], perm=[0, 2, 3, 1] if p == "k" else [0, 2, 1, 3])]
    nodes += [helper.make_node("MatMul", ["q", "k"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["ss"]),
              helper.make_node("Add", ["ss", "mask"], ["sm"]),
              helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["y"])]
    mask = np.where(np.arange(seq) < seq - 2, 0.0, -10000.0).astype(np.float32).reshape(1, 1, 1, seq)
    inits = [numpy_helper.from_array(_f32((hidden, hidden), rng, 1 / math.sqrt(hidden)), f"w{p}") for p in "qkv"]
    inits += [numpy_helper.from_array(shape, "shape"), _c("scale", 1 / math.sqrt(dim)),
              numpy_helper.from_array(mask, "mask"), numpy_helper.from_array(np.array([batch, seq, hidden]), "merged")]
    model = make_model(nodes, [tensor_info("x", shape=[batch, seq, hidden])],
                       [tensor_info("y", shape=[batch, seq, hidden])], inits)
    sess = _check(model, {"x": _f32((batch, seq, hidden), rng)}, ["Attention"], ["Softmax"])
    # The pass runs before the generic optimizer (whose attention fusion then sees float32), not after it.
    applied = sess.applied_passes()
    assert applied[0] == "CPUExecutionProvider:compute_half_in_float32" and "optimizer:fuse_attention" in applied


def test_convolution_with_relu_runs_the_float32_fused_convolution():
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    inits = [numpy_helper.from_array(_f32((8, 4, 3, 3), rng, 1 / 6), "w"),
             numpy_helper.from_array(_f32((8,), rng), "b")]
    model = make_model(nodes, [tensor_info("x", shape=[1, 4, 10, 10])], [tensor_info("y", shape=[1, 8, 10, 10])],
                       inits)
    _check(model, {"x": _f32((1, 4, 10, 10), rng)}, ["FusedConv"], ["Relu"])


def test_half_constants_keep_their_float16_values():
    """A ConstantOfShape filling float16 and a Cast to float16 inside the model: both follow into float32, and
    the Cast still rounds (the value 1/3 the graph rounds to float16 stays rounded)."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Shape", ["h"], ["shape"]),
             helper.make_node("ConstantOfShape", ["shape"], ["third"],
                              value=numpy_helper.from_array(np.array([1 / 3], np.float32))),
             helper.make_node("Cast", ["third"], ["third16"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["third16"], ["third32"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["h", "third32"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[3, 8])], [tensor_info("y", shape=[3, 8])],
                       [numpy_helper.from_array(_f32((8, 8), rng, 0.3), "w")])
    model16 = to_float16(model)
    for node in model16.graph.node:  # the converter's double Cast: to float16 (as the model computes) and back
        if node.op_type == "Cast" and node.output[0] == "third16":
            node.attribute[0].i = F16
    sess = ort.InferenceSession(model16.SerializeToString(), providers=["cpu"])
    x = _f32((3, 8), rng)
    got = sess.run(None, {"x": x})[0]
    w = numpy_helper.to_array(model16.graph.initializer[0]).astype(np.float64)
    exact = x.astype(np.float16).astype(np.float64) @ w + float(np.float16(1 / 3))
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


def test_single_float16_operator_keeps_float16_semantics():
    """No weights: the backend's kind of case is left as written, computed as float16 operators do."""
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    model = make_model(nodes, [tensor_info("a", F16, [4]), tensor_info("b", F16, [4])], [tensor_info("y", F16, [4])])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert _ops(sess) == ["Add"]
    a = np.array([1, 2048, 0.1, -3], np.float16)
    b = np.array([2.0 ** -11, 1, 0.2, 1e-4], np.float16)
    got = sess.run(None, {"a": a, "b": b})[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, a + b)


@pytest.mark.parametrize("half", [np.float16, "bfloat16"])
def test_round_to_half_equals_the_two_casts(half):
    """RoundToHalf's compiled passes against numpy's (ml_dtypes') conversions, bit for bit: random bit patterns
    (every exponent, NaN and infinities among them), the subnormal range, the overflow threshold, signed zeros."""
    import ml_dtypes
    from onnx_runtime_ep_cpu.algorithms.precision import round_to

    dtype = np.dtype(ml_dtypes.bfloat16 if half == "bfloat16" else half)
    rng = np.random.default_rng(6)
    patterns = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    tiny = rng.uniform(-2.0 ** -13, 2.0 ** -13, 50_000).astype(np.float32)
    edges = np.array([0.0, -0.0, -1e-9, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 65504, 65519.99, 65520, -65520,
                      3.4e38, -3.4e38, np.inf, -np.inf, np.nan, 1e-45], np.float32)
    for x in (patterns, tiny, edges, rng.standard_normal((3, 5, 7)).astype(np.float32)):
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(dtype).astype(np.float32)
        got = round_to(x, dtype)
        assert got.shape == x.shape and got.dtype == np.float32
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        finite = ~np.isnan(want)
        np.testing.assert_array_equal(got.view(np.uint32)[finite], want.view(np.uint32)[finite])


def test_graph_with_control_flow_is_left_in_float16():
    """A branch reads the outer float16 values with the types it was written for: the pass declines, and the
    model runs as written (float16 operators: within float16's rounding of the reference)."""
    rng = np.random.default_rng(7)
    w = _f32((8, 8), rng, 0.3).astype(np.float16)
    branch = helper.make_graph([helper.make_node("Identity", ["h"], ["out"])], "branch", [],
                               [helper.make_tensor_value_info("out", F16, [3, 8])])
    other = helper.make_graph([helper.make_node("Neg", ["h"], ["out"])], "other", [],
                              [helper.make_tensor_value_info("out", F16, [3, 8])])
    nodes = [helper.make_node("Cast", ["x"], ["xh"], to=F16),
             helper.make_node("MatMul", ["xh", "w"], ["h"]),
             helper.make_node("If", ["flag"], ["yh"], then_branch=branch, else_branch=other),
             helper.make_node("Cast", ["yh"], ["y"], to=TensorProto.FLOAT)]
    model = make_model(nodes, [tensor_info("x", shape=[3, 8]), tensor_info("flag", TensorProto.BOOL, [])],
                       [tensor_info("y", shape=[3, 8])], [numpy_helper.from_array(w, "w")])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "RoundToHalf" not in _ops(sess) and "Cast" in _ops(sess)
    x = _f32((3, 8), rng)
    got = sess.run(None, {"x": x, "flag": np.array(False)})[0]
    exact = -(x.astype(np.float16).astype(np.float64) @ w.astype(np.float64))
    assert np.abs(got - exact).max() <= 2.0 ** -10 * np.abs(exact).max() * 4


def test_graph_with_float32_control_flow_still_computes_in_float32():
    """A branch that neither reads nor makes float16 values (here it picks a float32 shift) leaves the rest of
    the model free to convert."""
    rng = np.random.default_rng(8)
    w = _f32((8, 8), rng, 0.3).astype(np.float16)
    branches = [helper.make_graph([helper.make_node("Constant", [], ["out"], value=numpy_helper.from_array(
        np.array(value, np.float32)))], name, [], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])])
        for name, value in (("then", 1.0), ("else", -1.0))]
    nodes = [helper.make_node("Cast", ["x"], ["xh"], to=F16),
             helper.make_node("MatMul", ["xh", "w"], ["h"]),
             helper.make_node("Cast", ["h"], ["h32"], to=TensorProto.FLOAT),
             helper.make_node("If", ["flag"], ["shift"], then_branch=branches[0], else_branch=branches[1]),
             helper.make_node("Add", ["h32", "shift"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=[3, 8]), tensor_info("flag", TensorProto.BOOL, [])],
                       [tensor_info("y", shape=[3, 8])], [numpy_helper.from_array(w, "w")])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "RoundToHalf" in _ops(sess) and "If" in _ops(sess)
    x = _f32((3, 8), rng)
    got = sess.run(None, {"x": x, "flag": np.array(False)})[0]
    exact = x.astype(np.float16).astype(np.float64) @ w.astype(np.float64) - 1
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
