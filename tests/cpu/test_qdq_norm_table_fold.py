"""qdq_norms.fuse_rounded_rms_norm where a Cast's rounding comes before the Pow (LLaMA's first input norm as
quantize_static leaves it: the embedding's rounded value, Cast to float32, rounded again): the earlier passes make
the Pow a GridTable of the cast's input (its squares by code), and the normalization still runs as one
RoundedRMSNorm whose values are the unfused nodes', bit for bit, in both torch exporters' forms."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import ops_and_outputs, oracle_session, qdq_epilogues_without
from onnx import TensorProto, helper, numpy_helper

F32 = np.float32
GRIDS = {"x": (0.031, 128), "cast": (0.029, 127), "mean": (0.0157, 0), "lifted": (0.0158, 0), "root": (0.0087, 0),
         "inverse": (0.0121, 0), "normed": (0.0143, 128)}


def _model(form: str, depth: int = 64, signed: bool = False, rows=4, cast_reader: bool = False) -> onnx.ModelProto:
    """x (1, rows, depth) rounded -> Cast(float) rounded -> the normalization in ``form`` ("torchscript": opset 17,
    axes attribute, Div(1, root); "dynamo": opset 18, axes input, Reciprocal) -> Mul(weight) -> out, and the
    rounded x as a second output (a residual's read). ``cast_reader``: the cast's rounded value is an output too."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array(2, F32), "two"), numpy_helper.from_array(np.array(1e-6, F32), "eps"),
             numpy_helper.from_array(np.array(1, F32), "one"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, depth).astype(F32), "gamma")]
    nodes: list = []

    def rounded(name, value):
        scale, zero = GRIDS[name]
        inits.extend([numpy_helper.from_array(np.array(scale, F32), f"{name}_s"),
                      numpy_helper.from_array(np.array(zero - 128 if signed else zero,
                                                       np.int8 if signed else np.uint8), f"{name}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [value, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                      helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_r"])])
        return f"{name}_r"

    x = rounded("x", "x")
    nodes.append(helper.make_node("Cast", [x], ["cast"], to=TensorProto.FLOAT))
    cast = rounded("cast", "cast")
    nodes.append(helper.make_node("Pow", [cast, "two"], ["squares"]))
    if form == "torchscript":
        nodes.append(helper.make_node("ReduceMean", ["squares"], ["mean"], axes=[-1], keepdims=1))
    else:
        nodes.append(helper.make_node("ReduceMean", ["squares", "axes"], ["mean"], keepdims=1))
    mean = rounded("mean", "mean")
    nodes.append(helper.make_node("Add", [mean, "eps"], ["lifted"]))
    nodes.append(helper.make_node("Sqrt", [rounded("lifted", "lifted")], ["root"]))
    root = rounded("root", "root")
    nodes.append(helper.make_node("Div", ["one", root], ["inverse"]) if form == "torchscript"
                 else helper.make_node("Reciprocal", [root], ["inverse"]))
    nodes.append(helper.make_node("Mul", [cast, rounded("inverse", "inverse")], ["normed"]))
    nodes.append(helper.make_node("Mul", ["gamma", rounded("normed", "normed")], ["scaled"]))
    nodes += [helper.make_node("Identity", ["scaled"], ["out"]), helper.make_node("Identity", [x], ["residual"])]
    names = ["out", "residual"] + (["cast_r"] if cast_reader else [])
    graph = helper.make_graph(nodes, "rms_norm_after_cast",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, depth])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17 if form == "torchscript" else 18)])


def _feeds(rows=4, depth=64, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, rows, depth)) * np.linspace(0.2, 3, rows)[None, :, None]).astype(F32)
    x.reshape(-1)[:3] = [1e3, -1e3, 0.5 * GRIDS["x"][0]]  # saturation both ways, a tie
    return {"x": x}


def _bitwise(got, want):
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
@pytest.mark.parametrize("signed,depth", [(False, 64), (True, 64), (False, 7), (True, 5000)])
def test_norm_after_a_cast_is_one_node_with_the_unfused_values(form, signed, depth):
    model, feeds = _model(form, depth, signed), _feeds(depth=depth)
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rms_norm"):
        plain_ops, want = ops_and_outputs(model, feeds)
    assert "GridTable" in plain_ops and "Pow" not in plain_ops  # the squares are a table of the cast's input
    assert ops.count("RoundedRMSNorm") == 1 and "GridTable" not in ops and "ReduceMeanRounded" not in ops
    assert "Mul" not in ops and "MulRounded" not in ops
    _bitwise(got, want)
    assert len(np.unique(got[0])) > min(20, depth)  # the roundings leave many distinct values


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_norm_after_a_cast_against_onnxruntime(form):
    model, feeds = _model(form, rows="rows"), _feeds(rows=6, seed=1)  # (a symbolic row count)
    ops, got = ops_and_outputs(model, feeds)
    assert ops.count("RoundedRMSNorm") == 1
    theirs = oracle_session(model)
    want = theirs.run(None, feeds)
    np.testing.assert_array_equal(got[1], want[1])
    # only the mean's summation order may differ: a row's mean moves by one code of its grid at most where it lies
    # within rounding of a half-code, so every row but one matches
    rows_equal = [np.array_equal(a, b) for a, b in zip(got[0][0], want[0][0])]
    assert sum(rows_equal) >= len(rows_equal) - 1


def test_cast_value_read_elsewhere_still_folds_and_stays():
    model, feeds = _model("dynamo", cast_reader=True), _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rms_norm"):
        _, want = ops_and_outputs(model, feeds)
    assert ops.count("RoundedRMSNorm") == 1
    _bitwise(got, want)


def test_squares_of_another_tensor_are_left_alone():
    """The table's input must be the one x rounds (x itself or its QuantizeDequantize): squares of another tensor
    of the same shape are not x's."""
    model = _model("dynamo")
    for node in model.graph.node:
        if node.op_type == "Mul" and "cast_r" in node.input:
            node.input[list(node.input).index("cast_r")] = "other_r"
    model.graph.input.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, [1, 4, 64]))
    scale, zero = GRIDS["cast"]
    model.graph.node.insert(0, helper.make_node("QuantizeLinear", ["other", "cast_s", "cast_z"], ["other_q"]))
    model.graph.node.insert(1, helper.make_node("DequantizeLinear", ["other_q", "cast_s", "cast_z"], ["other_r"]))
    feeds = {**_feeds(), "other": _feeds(seed=5)["x"]}
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rms_norm"):
        _, want = ops_and_outputs(model, feeds)
    assert "RoundedRMSNorm" not in ops
    _bitwise(got, want)


def test_squares_of_another_shape_are_a_typed_error():
    from onnx_runtime.errors import OnnxRuntimeError
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
    from onnx_runtime_ep_cpu.ops.qdq_norm import rounded_rms_norm

    table = {"chain": [":Sqrt:18"], "wiring": ["x|y"], "names": ["x"], "result": "y"}
    attrs = {**table, **{"squares_" + k: v for k, v in table.items()}, "squares_inputs": 3}
    node = Node("RoundedRMSNorm", ["x", "w", "ms", "mz", "ps", "pz", "y", "ys", "yz", "ts", "tz"], ["out"],
                name="norm", domain=FUSED_DOMAIN, opset=1, attrs=attrs)
    kernel = rounded_rms_norm(node, [None] * 11, 1)
    grid = (np.array(0.01, F32), np.array(0, np.uint8))
    x = np.ones((2, 8), F32)
    (good,) = kernel(x, np.ones(8, F32), *grid, *grid, x, *grid, *grid)
    assert good.shape == x.shape and np.isfinite(good).all()
    with pytest.raises(OnnxRuntimeError, match="input 'y'"):
        kernel(x, np.ones(8, F32), *grid, *grid, np.ones((2, 4), F32), *grid, *grid)
