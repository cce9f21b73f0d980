"""qdq_attention.fuse_rounded_attention: a QDQ decoder's attention from the scores' product to the context's
(scores product -> GridTable scale and/or AddRounded mask or position bias -> Softmax -> context product, as
quantize_static writes it for both torch exporters) runs as one RoundedAttention node (ops/qdq_attention.py,
compiled/rounded_attention.py) whose values are the unfused nodes', bit for bit, within a few codes of
onnxruntime's; calls it does not take (a mask that enlarges the scores, other dtypes) run the chain's own kernels."""
from __future__ import annotations

import numpy as np
import pytest
from model_helpers import ops_and_outputs, oracle_session, qdq_epilogues_without, qdq_zoo_sessions
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu.compiled import rounded_attention as loop
from onnx_runtime_ep_cpu.compiled.generic_int8 import GENERIC_INT8

F32 = np.float32
HEADS, DEPTH = 4, 16
# (scale, zero point) of each rounding, uint8 codes
GRIDS = {"q": (0.031, 128), "k": (0.029, 127), "v": (0.027, 129), "mask": (0.5, 255), "scores": (0.11, 120),
         "scaled": (0.027, 121), "masked": (0.05, 200), "probs": (1 / 255, 0), "out": (0.013, 126)}


def _model(kv_heads: int = HEADS, mask_batch: int = 1):
    """The QDQ attention of q (1, 4, R, 16) against keys and values of ``kv_heads`` heads repeated to four
    (unsqueeze, expand, reshape: repeat_kv) with a (mask_batch, 1, R, L) mask, quantize_static's spelling."""
    inits, nodes = [numpy_helper.from_array(np.array(0.25, F32), "scale")], []

    def rounded(name, value, grid=None):
        scale, zero = GRIDS[grid or name]
        inits.extend([numpy_helper.from_array(np.array(scale, F32), f"{name}_s"),
                      numpy_helper.from_array(np.array(zero, np.uint8), f"{name}_z")])
        nodes.extend([helper.make_node("QuantizeLinear", [value, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
                      helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_r"])])
        return f"{name}_r"

    def repeated(name, value):
        if kv_heads == HEADS:
            return value
        group = HEADS // kv_heads
        inits.extend([numpy_helper.from_array(np.array([2], np.int64), f"{name}_axis"),
                      numpy_helper.from_array(np.array([1, kv_heads, group, 1, 1], np.int64), f"{name}_spread"),
                      numpy_helper.from_array(np.array([1, HEADS, -1, DEPTH], np.int64), f"{name}_shape")])
        nodes.extend([helper.make_node("Unsqueeze", [value, f"{name}_axis"], [f"{name}_u"]),
                      helper.make_node("Expand", [f"{name}_u", f"{name}_spread"], [f"{name}_e"]),
                      helper.make_node("Reshape", [f"{name}_e", f"{name}_shape"], [f"{name}_rep"])])
        return rounded(f"{name}_rep", f"{name}_rep", name)

    q, k, v, mask = rounded("q", "q"), repeated("k", rounded("k", "k")), repeated("v", rounded("v", "v")), \
        rounded("mask", "mask")
    nodes.append(helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", [q, rounded("kt", "kt", "k")], ["scores"]))
    nodes.append(helper.make_node("Mul", [rounded("scores", "scores"), "scale"], ["scaled"]))
    nodes.append(helper.make_node("Add", [rounded("scaled", "scaled"), mask], ["masked"]))
    nodes.append(helper.make_node("Softmax", [rounded("masked", "masked")], ["probs"], axis=-1))
    nodes.append(helper.make_node("MatMul", [rounded("probs", "probs"), v], ["out"]))
    nodes.append(helper.make_node("Identity", [rounded("out", "out")], ["y"]))
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, HEADS, "rows", DEPTH]),
              helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, kv_heads, "length", DEPTH]),
              helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, kv_heads, "length", DEPTH]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, [mask_batch, 1, "rows", "length"])]
    graph = helper.make_graph(nodes, "attention", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _feeds(rows: int, length: int, kv_heads: int = HEADS, mask_batch: int = 1, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, HEADS, rows, DEPTH)) * 2).astype(F32)
    q.reshape(-1)[:2] = [1e3, 0.5 * GRIDS["q"][0]]  # saturation, a tie
    mask = np.where(rng.random((mask_batch, 1, rows, length)) < 0.2, F32(-100), F32(0)).astype(F32)
    return {"q": q, "k": (rng.standard_normal((1, kv_heads, length, DEPTH)) * 2).astype(F32),
            "v": (rng.standard_normal((1, kv_heads, length, DEPTH)) * 2).astype(F32), "mask": mask}


@pytest.mark.parametrize("kv_heads", [HEADS, 2])
@pytest.mark.parametrize("rows,length", [(1, 9), (5, 5), (3, 40)])
def test_attention_is_one_node_with_the_unfused_values(kv_heads, rows, length):
    model, feeds = _model(kv_heads), _feeds(rows, length, kv_heads)
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_attention"):
        plain_ops, want = ops_and_outputs(model, feeds)
    assert ops.count("RoundedAttention") == 1 and "Softmax" not in ops and "Transpose" not in ops, ops
    assert "RoundedAttention" not in plain_ops and "Softmax" in plain_ops
    if kv_heads != HEADS:
        assert "Expand" not in ops and plain_ops.count("GroupedQuantizedMatMul") == 2, plain_ops
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))  # bit for bit
    assert len(np.unique(got[0])) > 20
    (theirs,) = oracle_session(model).run(None, feeds)
    # onnxruntime's integer kernels round the products apart: a value near a half-code lands one code over, and
    # a code of the scores moves the weights
    codes = np.abs(got[0] - theirs) / F32(GRIDS["out"][0])
    assert codes.max() <= 4.01 and np.mean(codes <= 1.01) >= 0.9, (codes.max(), np.mean(codes <= 1.01))


@pytest.mark.parametrize("rows,length,compiled", [(16, 16, True), (50, 50, True), (72, 72, False)])
def test_a_long_attention_runs_the_chains_kernels(monkeypatch, rows, length, compiled):
    # (past MOST_SCORES scores per head the chain's kernels run, whose products split across threads; whisper's
    # 50 x 50 encoder attention stays in the one call; the values are the same either way)
    from onnx_runtime_ep_cpu.ops import qdq_attention

    calls = []

    class Counted(qdq_attention.EntryOnce):
        def run(self, arguments):
            calls.append(arguments[0].shape)
            return super().run(arguments)

    monkeypatch.setattr(qdq_attention, "EntryOnce", Counted)
    assert (rows * length <= qdq_attention.MOST_SCORES) == compiled
    model, feeds = _model(), _feeds(rows, length)
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_attention"):
        _, want = ops_and_outputs(model, feeds)
    assert ops.count("RoundedAttention") == 1 and bool(calls) == compiled, (ops, calls)
    np.testing.assert_array_equal(got[0].view(np.uint32), want[0].view(np.uint32))


def test_a_mask_that_enlarges_the_scores_keeps_the_nodes():
    # (the node's shape rule is MatMul's over q and the values: a mask that the graph shows broadcasting the scores
    # over a second batch keeps the nodes)
    model, feeds = _model(mask_batch=2), _feeds(3, 7, mask_batch=2)
    ops, got = ops_and_outputs(model, feeds)
    with qdq_epilogues_without("fuse_rounded_attention"):
        _, want = ops_and_outputs(model, feeds)
    assert "RoundedAttention" not in ops and got[0].shape == (2, HEADS, 3, DEPTH)
    np.testing.assert_array_equal(got[0], want[0])


def test_a_call_whose_mask_enlarges_the_scores_is_a_typed_error():
    model = _model()
    model.graph.input[3].type.tensor_type.shape.dim[0].dim_param = "mask_batch"
    feeds = _feeds(3, 7, mask_batch=2)
    ops, _ = ops_and_outputs(model, _feeds(3, 7))
    assert ops.count("RoundedAttention") == 1
    import onnx_runtime

    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    with pytest.raises(OnnxRuntimeError, match="broadcast the scores"):
        session.run(None, feeds)


def test_bad_inputs_are_the_nodes_typed_errors():
    import onnx_runtime

    model, feeds = _model(), _feeds(2, 6)
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    session.run(None, feeds)
    with pytest.raises(OnnxRuntimeError, match="broadcast|shape|dimension"):
        session.run(None, {**feeds, "k": feeds["k"][:, :, :, :DEPTH - 1].copy()})


def _loop_args(rows, length, group, seed=0):
    rng = np.random.default_rng(seed)
    kv = HEADS // group
    q = (rng.standard_normal((1, HEADS, rows, DEPTH)) * 2).astype(F32)
    k = (rng.standard_normal((1, kv, length, DEPTH)) * 2).astype(F32)
    v = (rng.standard_normal((1, kv, length, DEPTH)) * 2).astype(F32)
    add0 = np.where(rng.random((1, 1, rows, length)) < 0.3, F32(-50), F32(0)).astype(F32)
    add1 = (rng.standard_normal((1, HEADS, rows, length))).astype(F32)
    params = np.zeros(loop.PARAMS)
    for at, name in ((loop.Q, "q"), (loop.K, "k"), (loop.P, "probs"), (loop.V, "v")):
        params[at:at + 4] = (F32(GRIDS[name][0]), GRIDS[name][1], 0, 255)
    for at, a, b, y in ((loop.SCORES, "q", "k", "scores"), (loop.CONTEXT, "probs", "v", "out")):
        params[at:at + 5] = (np.float64(F32(GRIDS[a][0])) * np.float64(F32(GRIDS[b][0])) / np.float64(F32(GRIDS[y][0])),
                             GRIDS[y][1], 0, 255, F32(GRIDS[y][0]))
    table = ((np.arange(256, dtype=F32) - 120) * F32(0.11) * F32(0.25)).astype(F32)
    steps = np.array([[loop.TABLE, 0, F32(0.11), 120, 0, 255], [loop.ADD, 0, 0.05, 200, 0, 255],
                      [loop.ADD, 1, 0.05, 128, 0, 255]], F32)
    return (q, k, v, add0, add1, group, table[None], steps, params, np.empty((1, HEADS, rows, DEPTH), F32))


@pytest.mark.parametrize("group", [1, 2])
def test_numpy_twin_within_one_code_of_the_loop(group):
    # The twin's Softmax is numpy's exp (generic.py), the loop's its own: a weight within float32 rounding of a
    # half-code may take the next code, which moves the context by about one code.
    args = _loop_args(7, 23, group)
    want, got = args[-1], np.empty_like(args[-1])
    loop.rounded_attention.dispatcher()(*args)
    GENERIC_INT8["onnx_runtime_ep_cpu.compiled.rounded_attention.rounded_attention"](*args[:-1], got)
    assert np.abs(got - want).max() <= 2 * F32(GRIDS["out"][0]) * 1.001
    assert np.mean(got == want) > 0.95
    assert len(np.unique(want)) > 30


@pytest.mark.parametrize("name,attentions", [("gpt2.torchscript", 2), ("gpt2.dynamo", 2), ("llama.torchscript", 2),
                                             ("llama.dynamo", 2), ("t5_decoder.torchscript", 4),
                                             ("t5_decoder.dynamo", 4)])
def test_zoo_decoder_attention(qdq_decoders, name, attentions):
    """Both exporters' QDQ GPT-2, LLaMA and T5 decoders: every attention folds in prefill and decode; outputs bit
    for bit those of the unfused nodes, within a few codes of onnxruntime's."""
    zoo_feeds = qdq_decoders[2]
    calls, theirs, ours, plain = qdq_zoo_sessions(qdq_decoders, name, "fuse_rounded_attention")
    with qdq_epilogues_without("fuse_rounded_attention"):
        for call in ("prefill", "decode"):
            plain.run(None, zoo_feeds.make_feeds(calls[call]))
    for call in ("prefill", "decode"):
        feeds = zoo_feeds.make_feeds(calls[call])
        got = [ours.run(None, feeds) for _ in range(2)][-1]
        ops = [n.op_type for n in ours.graph_for(feeds).nodes]
        assert ops.count("RoundedAttention") == attentions and "Softmax" not in ops, ops
        for a, b in zip(got, plain.run(None, feeds)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(got, theirs.run(None, feeds)):
            assert float(np.abs(a - b).max()) <= 0.08 * max(1.0, float(np.abs(b).max()))
