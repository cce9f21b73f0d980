"""qdq_norms.fuse_rounded_rms_norm: a QDQ decoder's RMS normalization (Pow -> ReduceMean -> Add eps -> Sqrt ->
Div or Reciprocal -> Mul(x) -> Mul(weight), each activation rounded to its grid, as quantize_static writes it for
both torch exporters) runs as one RoundedRMSNorm node (ops/qdq_norm.py) whose values are the unfused nodes', bit
for bit; chains the pass must leave alone keep their nodes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import ops_and_outputs, oracle_session, qdq_epilogues_without
from onnx import TensorProto, helper, numpy_helper

F32 = np.float32
DEPTH = 64
# (scale, zero point) of each rounding, uint8 codes; int8 ones where ``signed``
GRIDS = {"x": (0.031, 128), "mean": (0.0157, 0), "lifted": (0.0158, 0), "root": (0.0087, 0), "inverse": (0.0121, 0),
         "normed": (0.0143, 128), "scaled": (0.019, 125), "y": (0.05, 120)}


def _rounded(name: str, value: str, signed: bool) -> tuple[list, list]:
    scale, zero = GRIDS[name]
    zero_value = np.array(zero - 128 if signed else zero, np.int8 if signed else np.uint8)
    inits = [numpy_helper.from_array(np.array(scale, F32), f"{name}_s"),
             numpy_helper.from_array(zero_value, f"{name}_z")]
    nodes = [helper.make_node("QuantizeLinear", [value, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
             helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_r"])]
    return nodes, inits


def _model(form: str, weight: bool = True, product: bool = True, signed: bool = False, rows=4,
           extra_reader: bool = False) -> onnx.ModelProto:
    """x (1, rows, 64) rounded -> the normalization in ``form`` ("torchscript": opset 17, axes attribute,
    Div(1, root); "dynamo": opset 18, axes input, Reciprocal) -> [Mul(weight)] -> [rounded, QDQ MatMul, rounded]
    -> y. ``extra_reader``: the mean is a graph output too."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(np.array(2, F32), "two"), numpy_helper.from_array(np.array(1e-6, F32), "eps"),
             numpy_helper.from_array(np.array(1, F32), "one"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array((rng.uniform(0.5, 1.5, DEPTH)).astype(F32), "gamma"),
             numpy_helper.from_array(rng.integers(-127, 128, (DEPTH, 32)).astype(np.int8), "w_q"),
             numpy_helper.from_array(np.array(0.004, F32), "w_s"), numpy_helper.from_array(np.array(0, np.int8), "w_z")]
    nodes: list = []

    def rounded(name, value):
        more_nodes, more_inits = _rounded(name, value, signed)
        nodes.extend(more_nodes)
        inits.extend(more_inits)
        return f"{name}_r"

    x = rounded("x", "x")
    nodes.append(helper.make_node("Pow", [x, "two"], ["squares"]))
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
    nodes.append(helper.make_node("Mul", [x, rounded("inverse", "inverse")], ["normed"]))
    out = rounded("normed", "normed")
    if weight:
        nodes.append(helper.make_node("Mul", ["gamma", out], ["scaled"]))
        out = "scaled"
    if product:
        nodes += [helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"]),
                  helper.make_node("MatMul", [rounded("scaled", out), "w"], ["y"])]
        out = rounded("y", "y")
    nodes.append(helper.make_node("Identity", [out], ["out"]))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("mean_r", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "rms_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               [1, rows, DEPTH])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17 if form == "torchscript" else 18)])


def _feeds(rows=4, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, rows, DEPTH)) * np.linspace(0.2, 3, rows)[None, :, None]).astype(F32)
    x.reshape(-1)[:3] = [1e3, -1e3, 0.5 * GRIDS["x"][0]]  # saturation both ways, a tie
    return {"x": x}


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
@pytest.mark.parametrize("weight,product,signed", [(True, True, False), (True, True, True), (False, False, False),
                                                   (True, False, True)])
def test_rms_norm_is_one_node_with_the_unfused_values(form, weight, product, signed):
    model, feeds = _model(form, weight, product, signed), _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rms_norm"):
        plain_ops, want = ops_and_outputs(model, feeds)
    assert ops.count("RoundedRMSNorm") == 1 and "Pow" not in ops and "GridTable" not in ops
    assert "RoundedRMSNorm" not in plain_ops and "Pow" in plain_ops
    assert "Mul" not in ops and "MulRounded" not in ops  # the weight's Mul and the product go into the node
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have.view(np.uint32), expected.view(np.uint32))  # bit for bit
    assert len(np.unique(got[0])) > 20  # the roundings leave many distinct values


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_rms_norm_against_onnxruntime(form):
    model, feeds = _model(form, product=False, rows="rows"), _feeds(rows=6, seed=1)  # (a symbolic row count)
    ops, (got,) = ops_and_outputs(model, feeds)
    assert ops.count("RoundedRMSNorm") == 1
    theirs = oracle_session(model)
    (want,) = theirs.run(None, feeds)
    # The same float32 operations; only the mean's summation order may differ, which moves a row's mean by one
    # code of its grid at most where it lies within rounding of a half-code: every value matches elsewhere.
    rows_equal = [np.array_equal(a, b) for a, b in zip(got[0], want[0])]
    assert sum(rows_equal) >= len(rows_equal) - 1


@pytest.mark.parametrize("change", ["mean_is_output", "exponent_three", "mean_of_first_axis", "weight_per_row"])
def test_what_the_pass_leaves_alone(change):
    model = _model("dynamo", product=False, extra_reader=change == "mean_is_output")
    init = {i.name: i for i in model.graph.initializer}
    if change == "exponent_three":
        init["two"].CopyFrom(numpy_helper.from_array(np.array(3, F32), "two"))
    elif change == "mean_of_first_axis":
        init["axes"].CopyFrom(numpy_helper.from_array(np.array([1], np.int64), "axes"))
    elif change == "weight_per_row":
        init["gamma"].CopyFrom(numpy_helper.from_array(np.ones((4, 1), F32), "gamma"))
    feeds = _feeds()
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_rms_norm"):
        _, want = ops_and_outputs(model, feeds)
    if change == "weight_per_row":  # the normalization folds; the weight's Mul stays a node of its own
        assert ops.count("RoundedRMSNorm") == 1 and "Mul" in ops
    else:
        assert "RoundedRMSNorm" not in ops
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have, expected)


def test_bad_weight_is_a_typed_error():
    from onnx_runtime.errors import OnnxRuntimeError
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
    from onnx_runtime_ep_cpu.ops.qdq_norm import rounded_rms_norm

    node = Node("RoundedRMSNorm", ["x", "w", "ms", "mz", "ps", "pz", "ts", "tz"], ["y"], name="norm",
                domain=FUSED_DOMAIN, opset=1,
                attrs={"chain": [":Sqrt:18"], "wiring": ["x|y"], "names": ["x"], "result": "y"})
    kernel = rounded_rms_norm(node, [None] * 8, 1)
    grid = (np.array(0.01, F32), np.array(0, np.uint8))
    with pytest.raises(OnnxRuntimeError, match="weight"):
        kernel(np.ones((2, 8), F32), np.ones(5, F32), *grid, *grid, *grid)
    with pytest.raises(OnnxRuntimeError, match="expected float32"):
        kernel(np.ones((2, 8), np.float64), np.ones(8, F32), *grid, *grid, *grid)
