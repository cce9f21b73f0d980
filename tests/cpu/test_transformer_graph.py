"""A GPT-style block built the way PyTorch exports it (dynamic shapes through Shape/Gather/Concat,
masks through Range/Where, GELU through Erf), checked against onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

D, HEADS, VOCAB = 16, 2, 50


def _init(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _block_model(opset: int):
    rng = np.random.default_rng(3)
    w = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    inits = [
        _init("wte", w(VOCAB, D)), _init("ln_g", np.ones(D, np.float32)), _init("ln_b", np.zeros(D, np.float32)),
        _init("w_qkv", w(D, 3 * D)), _init("b_qkv", w(3 * D)), _init("w_o", w(D, D)), _init("w_fc", w(D, 4 * D)),
        _init("w_proj", w(4 * D, D)), _init("zero_i", np.array(0, np.int64)), _init("one_i", np.array(1, np.int64)),
        _init("axes0", np.array([0], np.int64)), _init("heads_hd", np.array([HEADS, D // HEADS], np.int64)),
        _init("neg_one", np.array([-1], np.int64)), _init("d_model", np.array([D], np.int64)),
        _init("scale", np.array(np.sqrt(D // HEADS), np.float32)), _init("sqrt2", np.array(np.sqrt(2), np.float32)),
        _init("half", np.array(0.5, np.float32)), _init("onef", np.array(1.0, np.float32)),
        _init("neg_inf", np.array(-1e9, np.float32)), _init("split3", np.array([D, D, D], np.int64)),
        _init("red_axes", np.array([-1], np.int64)),
    ]
    n = helper.make_node
    nodes = [
        n("Gather", ["wte", "ids"], ["emb"], axis=0),
        n("Shape", ["ids"], ["ids_shape"]),
        n("Gather", ["ids_shape", "one_i"], ["seq"], axis=0),
        n("Unsqueeze", ["seq", "axes0"], ["seq1"]),
        n("LayerNormalization", ["emb", "ln_g", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln", "w_qkv"], ["qkv0"]),
        n("Add", ["qkv0", "b_qkv"], ["qkv"]),
        n("Split", ["qkv", "split3"], ["q", "k", "v"], axis=-1),
        # [B, S, D] -> [B, S, H, hd] with a shape computed at run time
        n("Gather", ["ids_shape", "zero_i"], ["batch"], axis=0),
        n("Unsqueeze", ["batch", "axes0"], ["batch1"]),
        n("Concat", ["batch1", "seq1", "heads_hd"], ["qshape"], axis=0),
        *[n("Reshape", [t, "qshape"], [f"{t}4"]) for t in ("q", "k", "v")],
        n("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
        n("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        n("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["scores0"]),
        n("Div", ["scores0", "scale"], ["scores"]),
        # causal mask: col > row -> -inf
        n("Range", ["zero_i", "seq", "one_i"], ["pos"]),
        n("Unsqueeze", ["pos", "neg_one"], ["rows"]),
        n("Greater", ["pos", "rows"], ["future"]),
        n("Where", ["future", "neg_inf", "scores"], ["masked"]),
        n("Softmax", ["masked"], ["probs"], axis=-1),
        n("MatMul", ["probs", "vt"], ["ctx4"]),
        n("Transpose", ["ctx4"], ["ctx_t"], perm=[0, 2, 1, 3]),
        n("Concat", ["batch1", "seq1", "d_model"], ["dshape"], axis=0),
        n("Reshape", ["ctx_t", "dshape"], ["ctx"]),
        n("MatMul", ["ctx", "w_o"], ["attn"]),
        n("Add", ["emb", "attn"], ["h1"]),
        # MLP with exact GELU written as PyTorch exports it
        n("MatMul", ["h1", "w_fc"], ["fc"]),
        n("Div", ["fc", "sqrt2"], ["fc_s"]),
        n("Erf", ["fc_s"], ["erf"]),
        n("Add", ["erf", "onef"], ["erf1"]),
        n("Mul", ["fc", "erf1"], ["g0"]),
        n("Mul", ["g0", "half"], ["gelu"]),
        n("MatMul", ["gelu", "w_proj"], ["mlp"]),
        n("Add", ["h1", "mlp"], ["h2"]),
        n("ReduceMean", ["h2", "red_axes"] if opset >= 18 else ["h2"], ["pooled"], keepdims=0,
          **({} if opset >= 18 else {"axes": [-1]})),
        n("Cast", ["pooled"], ["pooled64"], to=TensorProto.DOUBLE),
        n("MatMul", ["h2", "wte_t"], ["logits"]),
    ]
    nodes.insert(0, n("Transpose", ["wte"], ["wte_t"], perm=[1, 0]))
    return make_model(
        nodes,
        [tensor_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [tensor_info("logits", shape=["batch", "seq", VOCAB]), tensor_info("pooled64", TensorProto.DOUBLE, None)],
        inits,
        opset=opset,
    )


@pytest.mark.parametrize("opset", [17, 18])
def test_gpt_block_matches_the_reference_evaluator_across_sequence_lengths(opset):
    from onnx.reference import ReferenceEvaluator

    model = _block_model(opset)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    oracle = ReferenceEvaluator(model)
    rng = np.random.default_rng(11)
    for batch, seq in [(1, 7), (2, 3), (1, 1)]:
        ids = rng.integers(0, VOCAB, (batch, seq)).astype(np.int64)
        logits, pooled = sess.run(None, {"ids": ids})
        want_logits, want_pooled = oracle.run(None, {"ids": ids})
        assert logits.shape == (batch, seq, VOCAB) and pooled.dtype == np.float64
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(pooled, want_pooled, rtol=1e-4, atol=1e-6)
