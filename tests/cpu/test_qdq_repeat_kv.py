"""qdq_repeat_kv.fold_repeated_kv: grouped-query attention's repeat_kv (Unsqueeze(2) -> Expand -> Reshape, the keys
then transposed) before a QDQ attention product runs as one GroupedQuantizedMatMul (ops/qdq_grouped.py) that reads
the unrepeated keys/values: the values are the unfused nodes' bit for bit, within one code of a float64
evaluation and of onnxruntime's; targets that do more than repeat the heads go the unfused way."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_helpers import ops_and_outputs, oracle_session, qdq_epilogues_without, qdq_zoo_sessions, read_only
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops.qdq_grouped import grouped_quantized_matmul
from onnx_runtime_ep_cpu.ops.qdq_linear import quantized_matmul

F32 = np.float32
DEPTH = 16


PARAMS = (read_only(0.04, F32), read_only(128, np.uint8), read_only(0.03, F32), read_only(125, np.uint8),
          read_only(0.5, F32), read_only(100, np.uint8))
ATTRS = {"quantize_a": 1, "quantize_b": 1, "dequantize": 1}
NAMES = ["a", "as", "az", "b", "bs", "bz", "ys", "yz"]


def _want(a, b):
    """float64 of the quantized math: A's and B's codes, the exact product, requantized once."""
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = PARAMS
    aq = np.clip(np.rint(a / a_scale) + a_zero.astype(F32), 0, 255) - float(a_zero)
    bq = np.clip(np.rint(b / b_scale) + b_zero.astype(F32), 0, 255) - float(b_zero)
    multiplier = np.float64(a_scale) * np.float64(b_scale) / np.float64(y_scale)
    codes = np.clip(np.rint(np.matmul(aq.astype(np.float64), bq) * multiplier) + float(y_zero), 0, 255)
    return (codes - float(y_zero)) * np.float64(y_scale)


def _grouped(group, transposed, target=None):
    attrs = {**ATTRS, "group": group, "transposed_b": int(transposed), "allowzero": 0}
    if target is not None:
        attrs["target"] = list(target)
    node = Node("GroupedQuantizedMatMul", NAMES + ["spread", "" if target is not None else "merge"], ["y"],
                name="scores", domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    return grouped_quantized_matmul(node, [None] * 10, 1)


def _plain():
    return quantized_matmul(Node("QuantizedMatMul", NAMES, ["y"], name="plain", domain=FUSED_DOMAIN, attrs=ATTRS,
                                 opset=1), [None] * 8, 1)


def _repeat(kv, group, transposed):
    full = np.repeat(kv, group, axis=1)
    return full.swapaxes(2, 3) if transposed else full


def _call(kernel, a, b, *targets):
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = PARAMS
    return kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero, *targets)[0]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("group,rows,length", [(2, 1, 17), (2, 5, 5), (3, 1, 9), (1, 2, 4)])
def test_grouped_product_is_the_repeated_product(transposed, group, rows, length):
    rng = np.random.default_rng(group * 100 + rows * 10 + length)
    heads = 2
    kv = (rng.standard_normal((1, heads, length, DEPTH)) * 2).astype(F32)
    columns = length if transposed else DEPTH
    a = (rng.standard_normal((1, heads * group, rows, DEPTH if transposed else length)) * 3).astype(F32)
    a.reshape(-1)[:2] = [1e4, 0.5 * 0.04]  # saturation, a tie
    spread = np.array([1, heads, group, length, DEPTH], np.int64)
    merge = np.array([1, heads * group, -1, DEPTH], np.int64)  # (-1: the length, as an exporter writes it)
    kernel, plain = _grouped(group, transposed), _plain()
    full = _repeat(kv, group, transposed)
    for _ in range(3):  # the checked call, then the kept one
        got = _call(kernel, a, kv, spread, merge)
    assert got.shape == (1, heads * group, rows, columns)
    np.testing.assert_array_equal(got, _call(plain, a, full))  # the same kernel, row for row
    assert np.abs(got - _want(a, full)).max() <= 0.5 * 1.001  # one output code
    fixed = _grouped(group, transposed, target=(1, heads * group, length, DEPTH))
    np.testing.assert_array_equal(_call(fixed, a, kv, spread), got)


def test_targets_that_do_more_than_repeat_go_the_unfused_way():
    rng = np.random.default_rng(5)
    kernel, plain = _grouped(2, False), _plain()
    kv = (rng.standard_normal((1, 2, 1, DEPTH)) * 2).astype(F32)
    a = (rng.standard_normal((1, 4, 3, 3)) * 2).astype(F32)
    # the Expand also broadcasts the length 1 -> 3
    spread, merge = np.array([1, 2, 2, 3, DEPTH], np.int64), np.array([1, 4, 3, DEPTH], np.int64)
    full = np.broadcast_to(kv[:, :, None], (1, 2, 2, 3, DEPTH)).reshape(1, 4, 3, DEPTH)
    np.testing.assert_array_equal(_call(kernel, a, kv, spread, merge), _call(plain, a, full))
    # a Reshape that keeps the group apart from the heads: (1, 2, 6, 16) against A of 2 heads
    a2 = (rng.standard_normal((1, 2, 3, 6)) * 2).astype(F32)
    merge2 = np.array([1, 2, 0, DEPTH], np.int64)
    with pytest.raises(OnnxRuntimeError, match="does not expand"):
        _call(kernel, a2, kv, spread, merge2)  # (0 copies 2 from the expanded shape: no such reshape)
    merge3 = np.array([1, 2, -1, DEPTH], np.int64)
    full3 = np.broadcast_to(kv[:, :, None], (1, 2, 2, 3, DEPTH)).reshape(1, 2, 6, DEPTH)
    np.testing.assert_array_equal(_call(kernel, a2, kv, spread, merge3), _call(plain, a2, full3))
    with pytest.raises(OnnxRuntimeError, match="does not expand"):
        _call(kernel, a, kv, np.array([1, 3, 2, 3, DEPTH], np.int64), merge)


def _model(form: str, transposed: bool, length=5, spread_length=None) -> onnx.ModelProto:
    """q (1, 4, rows, 16) and kv (1, 2, length, 16) rounded; kv repeated for 2 query heads each; the rounded
    product q @ kv^T (``transposed``) or probs @ kv, rounded. "torchscript": the targets with -1 and 1 for the
    length, which is symbolic; "dynamo": constant targets over a static length."""
    symbolic = form == "torchscript"
    spread_length = spread_length or (1 if symbolic else length)
    inits = [numpy_helper.from_array(np.array([2], np.int64), "axis2"),
             numpy_helper.from_array(np.array([1, 2, 2, spread_length, DEPTH], np.int64), "spread"),
             numpy_helper.from_array(np.array([1, 4, -1 if symbolic else spread_length, DEPTH], np.int64), "merge")]
    nodes: list = []

    def rounded(name, value, scale, zero):
        inits.extend([numpy_helper.from_array(np.array(scale, F32), f"{name}_s"),
                      numpy_helper.from_array(np.array(zero, np.uint8), f"{name}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [value, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                      helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_r"])])
        return f"{name}_r"

    q, kv = rounded("q", "q", 0.04, 128), rounded("kv", "kv", 0.03, 125)
    nodes += [helper.make_node("Unsqueeze", [kv, "axis2"], ["unsqueezed"]),
              helper.make_node("Expand", ["unsqueezed", "spread"], ["spread_kv"]),
              helper.make_node("Reshape", ["spread_kv", "merge"], ["repeated"])]
    b = "repeated"
    if transposed:
        nodes.append(helper.make_node("Transpose", [b], ["turned"], perm=[0, 1, 3, 2]))
        b = "turned"
    nodes.append(helper.make_node("MatMul", [q, rounded("b", b, 0.03, 125)], ["y"]))
    out = rounded("y", "y", 0.5, 100)
    nodes.append(helper.make_node("Identity", [out], ["out"]))
    length_dim = "length" if symbolic else length
    q_shape = [1, 4, "rows", DEPTH] if transposed else [1, 4, "rows", length_dim]
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, q_shape),
              helper.make_tensor_value_info("kv", TensorProto.FLOAT, [1, 2, length_dim, DEPTH])]
    graph = helper.make_graph(nodes, "repeat_kv", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                                                        None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17 if symbolic else 18)])


def _feeds(transposed: bool, rows=1, length=5, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, 4, rows, DEPTH if transposed else length)) * 2).astype(F32)
    return {"q": q, "kv": (rng.standard_normal((1, 2, length, DEPTH)) * 2).astype(F32)}


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_repeat_is_read_in_place_with_the_unfused_values(form, transposed, rows):
    model, feeds = _model(form, transposed), _feeds(transposed, rows)
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fold_repeated_kv"):
        plain_ops, want = ops_and_outputs(model, feeds)
    assert ops.count("GroupedQuantizedMatMul") == 1 and "Expand" not in ops, ops
    assert "GroupedQuantizedMatMul" not in plain_ops and "Expand" in plain_ops
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have, expected)
    assert len(np.unique(got[0])) > 10


@pytest.mark.parametrize("form", ["torchscript", "dynamo"])
def test_repeat_against_onnxruntime(form):
    for transposed in (True, False):
        model = _model(form, transposed)
        theirs = oracle_session(model)
        for rows in (1, 4):
            feeds = _feeds(transposed, rows, seed=rows)
            ops, (got,) = ops_and_outputs(model, feeds)
            (want,) = theirs.run(None, feeds)
            assert ops.count("GroupedQuantizedMatMul") == 1
            assert np.abs(got - want).max() <= 0.5 * 1.001  # one code: onnxruntime's integer kernel rounds apart
            assert np.mean(got == want) >= 0.95


def test_an_expand_over_the_length_too_keeps_its_values():
    """kv of length 1 spread to 3 by the Expand: the fused node's check sends it the unfused way."""
    model, feeds = _model("dynamo", True, length=1, spread_length=3), _feeds(True, 2, length=1)
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fold_repeated_kv"):
        _, want = ops_and_outputs(model, feeds)
    assert got[0].shape == (1, 4, 2, 3)
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have, expected)


@pytest.mark.parametrize("name", ["llama.torchscript", "llama.dynamo"])
def test_zoo_llama_attention_products(qdq_decoders, name):
    """Both exporters' QDQ LLaMA (4 query heads on 2 key/value heads): the four attention products read the
    presents in place in prefill and in decode calls over new lengths; outputs bit for bit those of the unfused
    nodes, within a few codes of onnxruntime's."""
    zoo_feeds = qdq_decoders[2]
    calls, theirs, ours, plain = qdq_zoo_sessions(qdq_decoders, name, "fold_repeated_kv")
    feeds = [zoo_feeds.make_feeds(calls["prefill"])]
    feeds += [zoo_feeds.make_feeds(zoo_feeds.grown(calls["decode"], extra)) for extra in range(4)]
    for feed in feeds:
        got = [ours.run(None, feed) for _ in range(2)][-1]
        nodes = ours.graph_for(feed).nodes
        ops = [n.op_type for n in nodes]
        # (qdq_attention.fuse_rounded_attention takes the grouped products into its nodes' chains)
        ops += [str(kind).split(":")[1] for n in nodes if n.op_type == "RoundedAttention" for kind in n.attr("chain")]
        with qdq_epilogues_without("fold_repeated_kv"):
            want = [plain.run(None, feed) for _ in range(2)][-1]
        plain_ops = [n.op_type for n in plain.graph_for(feed).nodes]
        # (the dynamo export's mask has an Expand of its own)
        assert ops.count("GroupedQuantizedMatMul") == 4 and ops.count("Expand") == plain_ops.count("Expand") - 4
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(got, theirs.run(None, feed)):
            assert float(np.abs(a - b).max()) <= 0.08 * max(1.0, float(np.abs(b).max()))
