"""qdq_groups.group_quantized_products on an encoder's query, key and value: QDQ Linear layers whose bias Add comes
after the product's rounding (qdq_fusions.absorb_rounded_add's QuantizedMatMul with a row and a second rounding)
run as one QuantizedMatMulGroup with attribute ``rounded``; each member's block takes its own row and second
rounding (a bias-free key, as BERT's and Whisper's, none), bit for bit what the members give alone, within one code
of onnxruntime. Both torch exporters write these layers as MatMul + Add on 3-D activations (opset 17 torchscript,
18 dynamo)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from model_helpers import qdq_epilogues_without
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import generic_int8, qgemm
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import qdq_group
from onnx_runtime_ep_cpu.ops.qdq_linear import quantized_matmul

F32 = np.float32
WIDTHS = (16, 16, 8)
OFF = "group_quantized_products"
SUM_SCALES = (0.03, 0.04, 0.05)  # each member's second rounding (the rounded sum's grid)


def _model(opset: int, signed: bool, bias_free_key: bool, one_value_row: bool, rows: int = 17,
           depth: int = 24) -> onnx.ModelProto:
    """x rounded to A's grid, then per WIDTHS entry MatMul(DQ(W)) -> Q/DQ -> Add(bias row) -> Q/DQ -> Mul by 2, as
    onnxruntime's quantization tools write an encoder's q/k/v Linear layers (``bias_free_key``: the second has no
    Add; ``one_value_row``: the last member's bias is one value)."""
    rng = np.random.default_rng(opset + 2 * signed + 4 * bias_free_key)
    code = np.int8 if signed else np.uint8
    zero = (lambda z: z - 128) if signed else (lambda z: z)
    inits = [numpy_helper.from_array(np.array(2, F32), "two"), numpy_helper.from_array(np.array(0.043, F32), "a_s"),
             numpy_helper.from_array(np.array(zero(131), code), "a_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "a_s", "a_z"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "a_s", "a_z"], ["x_r"])]
    for g, width in enumerate(WIDTHS):
        inits += [numpy_helper.from_array(rng.integers(-127, 128, (depth, width)).astype(np.int8), f"w{g}"),
                  numpy_helper.from_array(np.array(0.006, F32), f"w{g}_s"),
                  numpy_helper.from_array(np.array(0, np.int8), f"w{g}_z"),
                  numpy_helper.from_array(np.array(0.02 + 0.01 * g, F32), f"y{g}_s"),
                  numpy_helper.from_array(np.array(zero(125 + g), code), f"y{g}_z"),
                  numpy_helper.from_array(np.array(SUM_SCALES[g], F32), f"s{g}_s"),
                  numpy_helper.from_array(np.array(zero(128 - g), code), f"s{g}_z")]
        nodes += [helper.make_node("DequantizeLinear", [f"w{g}", f"w{g}_s", f"w{g}_z"], [f"w{g}_r"]),
                  helper.make_node("MatMul", ["x_r", f"w{g}_r"], [f"p{g}"]),
                  helper.make_node("QuantizeLinear", [f"p{g}", f"y{g}_s", f"y{g}_z"], [f"p{g}_q"]),
                  helper.make_node("DequantizeLinear", [f"p{g}_q", f"y{g}_s", f"y{g}_z"], [f"p{g}_r"])]
        last = f"p{g}_r"
        if not (bias_free_key and g == 1):
            row = rng.uniform(-0.5, 0.5, 1 if one_value_row and g == len(WIDTHS) - 1 else width).astype(F32)
            inits.append(numpy_helper.from_array(row, f"b{g}"))
            nodes += [helper.make_node("Add", [f"p{g}_r", f"b{g}"], [f"t{g}"]),
                      helper.make_node("QuantizeLinear", [f"t{g}", f"s{g}_s", f"s{g}_z"], [f"t{g}_q"]),
                      helper.make_node("DequantizeLinear", [f"t{g}_q", f"s{g}_s", f"s{g}_z"], [f"t{g}_r"])]
            last = f"t{g}_r"
        nodes.append(helper.make_node("Mul", [last, "two"], [f"out{g}"]))
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, depth])],
                              [helper.make_tensor_value_info(f"out{g}", TensorProto.FLOAT, None)
                               for g in range(len(WIDTHS))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _feeds(model: onnx.ModelProto) -> dict:
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = (np.random.default_rng(5).standard_normal(dims) * 2).astype(F32)
    x.reshape(-1)[:2] = [1e4, -1e4]  # saturation
    return {"x": x}


def _run(model: onnx.ModelProto, feeds: dict):
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    first = session.run(None, feeds)
    again = session.run(None, feeds)  # a specialized plan's run, its kept calls
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    return session.graph_for(feeds).nodes, again


@pytest.mark.parametrize("opset", [17, 18])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("bias_free_key", [False, True])
@pytest.mark.parametrize("one_value_row", [False, True])
def test_rounded_projections_are_one_group_with_the_members_values(opset, signed, bias_free_key, one_value_row):
    model = _model(opset, signed, bias_free_key, one_value_row)
    feeds = _feeds(model)
    nodes, grouped = _run(model, feeds)
    groups = [n for n in nodes if n.op_type == "QuantizedMatMulGroup"]
    assert len(groups) == 1 and groups[0].attr("rounded", 0) == 1
    assert not any(n.op_type in ("QuantizedMatMul", "Add") for n in nodes)
    with qdq_epilogues_without(OFF):
        apart_nodes, apart = _run(model, feeds)
    assert [n.op_type for n in apart_nodes].count("QuantizedMatMul") == len(WIDTHS)
    for ours, theirs in zip(grouped, apart):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("bias_free_key", [False, True])
def test_rounded_group_against_onnxruntime(bias_free_key):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _model(18, False, bias_free_key, False)
    feeds = _feeds(model)
    _, ours = _run(model, feeds)
    theirs = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None,
                                                                                                              feeds)
    for g, (a, b) in enumerate(zip(ours, theirs)):
        # within one code of the member's last grid (times the reader's 2), mostly equal
        grid = 0.02 + 0.01 * g if bias_free_key and g == 1 else SUM_SCALES[g]
        assert np.abs(a - b).max() <= 2 * grid * 1.0001 and np.mean(a == b) >= 0.9


def _frozen(x):
    x = np.asarray(x)
    x.flags.writeable = False
    return x


def _members(rng, depth: int, rows_of: tuple):
    """Each member's nine inputs: its weight and parameters, a bias ("" for the second), and its rounded add (a row of
    ``rows_of[g]`` values, None: none)."""
    members = []
    for g, (width, row_width) in enumerate(zip(WIDTHS, rows_of)):
        scale = rng.uniform(0.001, 0.01, width).astype(F32) if g == 1 else np.array(0.004, F32)
        member = [_frozen(rng.integers(-128, 128, (depth, width)).astype(np.int8)), _frozen(scale),
                  _frozen(np.array(1, np.int8)), _frozen(np.array(0.05 + 0.02 * g, F32)),
                  _frozen(np.array(129 + g, np.uint8)),
                  None if g == 1 else _frozen(rng.uniform(-1, 1, width).astype(F32))]
        if row_width is None:
            member += [None, None, None]
        else:
            member += [_frozen(rng.uniform(-0.7, 0.7, row_width).astype(F32)), _frozen(np.array(SUM_SCALES[g], F32)),
                       _frozen(np.array(126 + g, np.uint8))]
        members.append(member)
    return members


def _group_node(members: list) -> Node:
    """The group node over ``members`` (an absent input's name empty, as in a graph)."""
    names = ["a", "a_s", "a_z"] + ["" if x is None else f"m{i}" for i, x in enumerate(x for m in members for x in m)]
    attrs = {"quantize_a": 1, "dequantize": 1, "trans_b": [0] * len(members), "rounded": 1}
    return Node("QuantizedMatMulGroup", names, [f"y{g}" for g in range(len(members))], name="group",
                domain=FUSED_DOMAIN, attrs=attrs, opset=1)


@pytest.mark.parametrize("rows", [0, 1, 17])
@pytest.mark.parametrize("rows_of", [(16, None, 8), (1, 16, None), (16, 16, 1)])
def test_kernel_equals_each_member_alone(rows, rows_of):
    rng = np.random.default_rng(rows)
    depth = 20
    members = _members(rng, depth, rows_of)
    a_scale, a_zero = _frozen(np.array(0.07, F32)), _frozen(np.array(126, np.uint8))
    node = _group_node(members)
    kernel = qdq_group.quantized_matmul_group(node, None, 1)
    for _ in range(2):  # the first call, then its kept repeat
        a = (rng.standard_normal((1, rows, depth)) * 4).astype(F32)
        outs = kernel(a, a_scale, a_zero, *[x for m in members for x in m])
        for member, alone, out in zip(qdq_group.member_nodes(node), members, outs):
            inputs = alone if alone[6] is not None else alone[:6]
            assert len(member.inputs) == 3 + len(inputs) - (inputs[5] is None and len(inputs) == 6)
            (expected,) = quantized_matmul(member, None, 1)(a, a_scale, a_zero, *inputs)
            assert out.dtype == expected.dtype and out.shape == expected.shape and out.flags.c_contiguous
            np.testing.assert_array_equal(out, expected)


def test_numpy_twin_equals_the_loop():
    rng = np.random.default_rng(2)
    depth, rows = 33, 6
    members = _members(rng, depth, (16, None, 1))
    node = _group_node(members)
    side = qdq_group.joined(qgemm, qdq_group.member_nodes(node), np.array(0.05, F32), np.array(3, np.int8), members,
                             [False] * 3, True, True, True)
    a = (rng.standard_normal((rows, depth)) * 5).astype(F32)
    a[0, 0], a[1, 1] = np.nan, np.inf
    outs = []
    # the compiled loop itself (a first call may be served by its numpy twin) against the twin
    for run in (qgemm.requantized_group_rounded.dispatcher(), generic_int8.requantized_group_rounded):
        out = np.empty(rows * side.columns, side.out_dtype)
        run(a, side.packed, side.pairs, side.multiplier, side.offset, side.consts, side.members, side.row, side.afters,
            out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_a_rounded_add_it_does_not_take_runs_the_members():
    rng = np.random.default_rng(4)
    members = _members(rng, 12, (16, None, 8))
    members[2][6] = _frozen(np.zeros(3, F32))  # a row of neither 1 nor 8 values: the member's own typed error
    node = _group_node(members)
    kernel = qdq_group.quantized_matmul_group(node, None, 1)
    a_scale, a_zero = _frozen(np.array(0.07, F32)), _frozen(np.array(126, np.uint8))
    with pytest.raises(onnx_runtime.errors.OnnxRuntimeError, match="row"):
        kernel(np.zeros((3, 12), F32), a_scale, a_zero, *[x for m in members for x in m])
