"""qdq_groups.group_quantized_products: QDQ products of one activation (a layer's query, key and value, its gate and
up projections) run as one QuantizedMatMulGroup, one integer product with each member requantized to its own
output grid; every output is bit for bit what the members give alone, in both torch exporters' forms (torchscript:
Gemm with transB and a bias on 2-D rows, opset 17; dynamo: MatMul of 3-D activations, opset 18)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from model_helpers import ops_and_outputs, qdq_epilogues_without
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import generic_int8, qgemm
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import qdq_group
from onnx_runtime_ep_cpu.ops.qdq_linear import quantized_matmul

F32 = np.float32
WIDTHS = (16, 8, 8)
OFF = "group_quantized_products"


def _model(form: str, signed: bool = False, per_channel: bool = False, depth: int = 24, rows: int = 5,
           other_grid: bool = False, output_member: bool = False) -> onnx.ModelProto:
    """x rounded to A's grid, read by one product per WIDTHS entry (its own int8 weight, output grid and reader,
    a Mul by 2). ``other_grid``: the last product rounds x to another grid first; ``output_member``: the first
    product's rounded output is also a graph output."""
    rng = np.random.default_rng(11)
    code = np.int8 if signed else np.uint8
    zero = (lambda z: z - 128) if signed else (lambda z: z)
    inits = [numpy_helper.from_array(np.array(2, F32), "two"),
             numpy_helper.from_array(np.array(0.043, F32), "a_s"),
             numpy_helper.from_array(np.array(zero(131), code), "a_z"),
             numpy_helper.from_array(np.array(0.051, F32), "a2_s"),
             numpy_helper.from_array(np.array(zero(120), code), "a2_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "a_s", "a_z"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "a_s", "a_z"], ["x_r"]),
             helper.make_node("QuantizeLinear", ["x", "a2_s", "a2_z"], ["x2_q"]),
             helper.make_node("DequantizeLinear", ["x2_q", "a2_s", "a2_z"], ["x2_r"])]
    outputs = []
    for g, width in enumerate(WIDTHS):
        gemm = form == "torchscript"
        shape = (width, depth) if gemm else (depth, width)
        weight = rng.integers(-127, 128, shape).astype(np.int8)
        scale = (rng.uniform(0.002, 0.01, width) if per_channel else np.array(0.006)).astype(F32)
        inits += [numpy_helper.from_array(weight, f"w{g}"), numpy_helper.from_array(scale, f"w{g}_s"),
                  numpy_helper.from_array(np.zeros(scale.shape, np.int8), f"w{g}_z"),
                  numpy_helper.from_array(np.array(0.02 + 0.01 * g, F32), f"y{g}_s"),
                  numpy_helper.from_array(np.array(zero(125 + g), code), f"y{g}_z")]
        nodes.append(helper.make_node("DequantizeLinear", [f"w{g}", f"w{g}_s", f"w{g}_z"], [f"w{g}_r"],
                                      axis=0 if gemm else 1))
        source = "x2_r" if other_grid and g == len(WIDTHS) - 1 else "x_r"
        if gemm:
            inits.append(numpy_helper.from_array(rng.uniform(-0.5, 0.5, width).astype(F32), f"b{g}"))
            nodes.append(helper.make_node("Gemm", [source, f"w{g}_r", f"b{g}"], [f"p{g}"], transB=1))
        else:
            nodes.append(helper.make_node("MatMul", [source, f"w{g}_r"], [f"p{g}"]))
        nodes += [helper.make_node("QuantizeLinear", [f"p{g}", f"y{g}_s", f"y{g}_z"], [f"p{g}_q"]),
                  helper.make_node("DequantizeLinear", [f"p{g}_q", f"y{g}_s", f"y{g}_z"], [f"p{g}_r"]),
                  helper.make_node("Mul", [f"p{g}_r", "two"], [f"out{g}"])]
        outputs.append(f"out{g}")
    if output_member:
        outputs.append("p0_r")
    x_shape = [rows, depth] if form == "torchscript" else [1, rows, depth]
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17 if form == "torchscript" else 18)])


def _feeds(model: onnx.ModelProto) -> dict:
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": (np.random.default_rng(5).standard_normal(dims) * 2).astype(F32)}


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_products_of_one_input_are_one_group_with_the_members_values(form, signed, per_channel, rows):
    model = _model(form, signed, per_channel, rows=rows)
    feeds = _feeds(model)
    ops, grouped = ops_and_outputs(model, feeds)
    assert ops.count("QuantizedMatMulGroup") == 1 and "QuantizedMatMul" not in ops
    with qdq_epilogues_without(OFF):
        apart_ops, apart = ops_and_outputs(model, feeds)
    assert apart_ops.count("QuantizedMatMul") == len(WIDTHS) and "QuantizedMatMulGroup" not in apart_ops
    for ours, theirs in zip(grouped, apart):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_group_against_onnxruntime(form):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _model(form, per_channel=True)
    feeds = _feeds(model)
    _, ours = ops_and_outputs(model, feeds)
    theirs = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None,
                                                                                                              feeds)
    for g, (a, b) in enumerate(zip(ours, theirs)):
        # within one code of the member's grid (times the reader's 2): the bound onnxruntime's integer kernels keep
        assert np.abs(a - b).max() <= 2 * (0.02 + 0.01 * g) * 1.0001


def test_another_grid_or_an_output_member_is_left_out():
    model = _model("dynamo", other_grid=True, output_member=True)
    feeds = _feeds(model)
    ops, grouped = ops_and_outputs(model, feeds)
    # the first member is a graph output and the last reads x on another grid: only the middle one is left
    assert ops.count("QuantizedMatMulGroup") == 0 and ops.count("QuantizedMatMul") == len(WIDTHS)
    model = _model("dynamo", other_grid=True)
    ops, grouped = ops_and_outputs(model, feeds)
    assert ops.count("QuantizedMatMulGroup") == 1 and ops.count("QuantizedMatMul") == 1
    with qdq_epilogues_without(OFF):
        _, apart = ops_and_outputs(model, feeds)
    for ours, theirs in zip(grouped, apart):
        np.testing.assert_array_equal(ours, theirs)


def _frozen(x):
    x = np.asarray(x)
    x.flags.writeable = False
    return x


def _members(rng, depth, trans, signed_y, bias):
    members = []
    for g, (width, t) in enumerate(zip(WIDTHS, trans)):
        weight = rng.integers(-128, 128, (width, depth) if t else (depth, width)).astype(np.int8)
        scale = rng.uniform(0.001, 0.01, width).astype(F32) if g == 1 else np.array(0.004, F32)
        zero = rng.integers(-3, 4, width).astype(np.int8) if g == 1 else np.array(1, np.int8)
        y_zero = np.array(3, np.int8) if signed_y else np.array(129 + g, np.uint8)
        members.append([_frozen(weight), _frozen(scale), _frozen(zero), _frozen(np.array(0.05 + 0.02 * g, F32)),
                        _frozen(y_zero), _frozen(rng.uniform(-1, 1, width).astype(F32)) if bias else None])
    return members


def _group_node(count: int, trans, quantize_a: bool, dequantize: bool) -> Node:
    names = ["a", "a_s", "a_z"] + [f"m{i}" for i in range(qdq_group.SLOTS * count)]
    attrs = {"quantize_a": int(quantize_a), "dequantize": int(dequantize), "trans_b": [int(t) for t in trans]}
    return Node("QuantizedMatMulGroup", names, [f"y{g}" for g in range(count)], name="group", domain=FUSED_DOMAIN,
                attrs=attrs, opset=1)


@pytest.mark.parametrize("dequantize", [True, False])
@pytest.mark.parametrize("quantize_a", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_each_member_alone(dequantize, quantize_a, rows, bias):
    rng = np.random.default_rng(rows + 10 * bias)
    depth, trans = 20, (False, True, False)
    members = _members(rng, depth, trans, False, bias)
    a_scale, a_zero = _frozen(np.array(0.07, F32)), _frozen(np.array(126, np.uint8))
    a = (rng.standard_normal((2, rows, depth)) * 4).astype(F32) if quantize_a \
        else rng.integers(0, 256, (2, rows, depth)).astype(np.uint8)
    node = _group_node(len(WIDTHS), trans, quantize_a, dequantize)
    kernel = qdq_group.quantized_matmul_group(node, None, 1)
    for _ in range(2):  # the first call, then its kept repeat
        outs = kernel(a, a_scale, a_zero, *[x for m in members for x in m])
        for member, alone, out in zip(qdq_group.member_nodes(node), members, outs):
            (expected,) = quantized_matmul(member, None, 1)(a, a_scale, a_zero, *alone)
            assert out.dtype == expected.dtype and out.shape == expected.shape and out.flags.c_contiguous
            np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dequantize", [True, False])
def test_numpy_twin_equals_the_loop(dequantize):
    rng = np.random.default_rng(2)
    depth, rows = 33, 6
    members = _members(rng, depth, (False, False, False), True, True)
    node = _group_node(len(WIDTHS), (False,) * 3, True, dequantize)
    side = qdq_group.joined(qgemm, qdq_group.member_nodes(node), np.array(0.05, F32), np.array(3, np.int8),
                             members, [False] * 3, True, dequantize)
    a = (rng.standard_normal((rows, depth)) * 5).astype(F32)
    a[0, 0], a[1, 1] = np.nan, np.inf
    outs = []
    for run in (qgemm.requantized_group, generic_int8.requantized_group):
        out = np.empty(rows * side.columns, side.out_dtype)
        run(a, side.packed, side.pairs, side.multiplier, side.offset, side.consts, side.members, out)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_inputs_it_does_not_take_are_typed_errors():
    rng = np.random.default_rng(4)
    members = _members(rng, 12, (False,) * 3, False, False)
    node = _group_node(len(WIDTHS), (False,) * 3, True, True)
    kernel = qdq_group.quantized_matmul_group(node, None, 1)
    a_scale, a_zero = _frozen(np.array(0.07, F32)), _frozen(np.array(126, np.uint8))
    with pytest.raises(InvalidArgumentError, match="inner dimensions"):
        kernel(np.zeros((3, 13), F32), a_scale, a_zero, *[x for m in members for x in m])
    with pytest.raises(InvalidArgumentError, match="expected float32"):
        kernel(np.zeros((3, 12), np.uint8), a_scale, a_zero, *[x for m in members for x in m])
    bad = _group_node(len(WIDTHS), (False,) * 2, True, True)
    with pytest.raises(InvalidArgumentError, match="trans_b"):
        qdq_group.quantized_matmul_group(bad, None, 1)
    short = Node("QuantizedMatMulGroup", ["a", "a_s", "a_z", "b"], ["y0", "y1"], name="short", domain=FUSED_DOMAIN,
                 attrs={"trans_b": [0, 0]}, opset=1)
    with pytest.raises(InvalidArgumentError, match="per member"):
        qdq_group.quantized_matmul_group(short, None, 1)


@pytest.mark.parametrize("name", ["llama.torchscript", "llama.dynamo", "t5_decoder.torchscript",
                                  "t5_decoder.dynamo"])
def test_decoders_group_their_projections_bit_identically(qdq_decoders, name):
    built, entries, zoo_feeds = qdq_decoders
    calls = entries[name + ".fp32"]["calls"]
    for call in ("prefill", "decode"):
        feeds = zoo_feeds.make_feeds(calls[call])
        session = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
        grouped = session.run(None, feeds)
        groups = [len(n.outputs) for n in session.graph_for(feeds).nodes if n.op_type == "QuantizedMatMulGroup"]
        # llama: q/k/v and gate/up per layer; t5: the self-attention's q/k/v per layer
        assert groups == ([3, 2, 3, 2] if name.startswith("llama") else [3, 3])
        with qdq_epilogues_without(OFF):
            apart = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"]).run(None, feeds)
        for ours, theirs in zip(grouped, apart):
            np.testing.assert_array_equal(ours, theirs)
