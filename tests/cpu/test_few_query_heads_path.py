"""A decode step's Attention over (B, H, S, D) operands takes the few-query compiled call without moving heads,
reading a contiguous 4-D float mask as it lies and copying one that is not. Checked against a float64 reference for
masks of each lead shape (one for all heads, one per head), contiguous and strided, with masked keys, on a loop whose
keys' length grows; and that the call is the few-query one."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.compiled import decoder

HEADS, SIZE = 4, 16


def _model(mask_heads: int) -> bytes:
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"])
    inputs = [tensor_info("q", TensorProto.FLOAT, [1, HEADS, 1, SIZE]),
              tensor_info("k", TensorProto.FLOAT, [1, HEADS, "keys", SIZE]),
              tensor_info("v", TensorProto.FLOAT, [1, HEADS, "keys", SIZE]),
              tensor_info("mask", TensorProto.FLOAT, [1, mask_heads, 1, "keys"])]
    return make_model([node], inputs, [tensor_info("y", TensorProto.FLOAT, None)], opset=23).SerializeToString()


def _reference(q, k, v, mask):
    q, k, v, mask = (x.astype(np.float64) for x in (q, k, v, mask))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(SIZE) + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("mask_heads", [1, HEADS])
@pytest.mark.parametrize("strided", [False, True])
def test_few_query_attention_on_head_operands_matches_float64(mask_heads, strided, monkeypatch):
    calls = []
    few = decoder.few_query_attention_prefix_float32

    def counted(*args):
        calls.append(args[5].flags.c_contiguous)  # the bias the call reads
        return few(*args)

    monkeypatch.setattr(decoder, "few_query_attention_prefix_float32", counted)
    sess = ort.InferenceSession(_model(mask_heads), providers=["cpu"])
    rng = np.random.default_rng(mask_heads + 2 * strided)
    for keys in range(3, 12):
        q = rng.standard_normal((1, HEADS, 1, SIZE)).astype(np.float32)
        k = rng.standard_normal((1, HEADS, keys, SIZE)).astype(np.float32)
        v = rng.standard_normal((1, HEADS, keys, SIZE)).astype(np.float32)
        wide = np.zeros((1, mask_heads, 1, 2 * keys), np.float32)
        wide[..., 1::2] = 7  # what a strided view must not read
        mask = wide[..., ::2] if strided else np.ascontiguousarray(wide[..., ::2])
        mask[..., keys // 2] = -np.inf  # one key masked out
        y = sess.run(None, {"q": q, "k": k, "v": v, "mask": mask})[0]
        np.testing.assert_allclose(y, _reference(q, k, v, mask), rtol=2e-5, atol=2e-6)
    assert calls and all(calls)  # the few-query call served, always reading a contiguous bias
