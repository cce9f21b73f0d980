"""compiled/attention_lanes.py's 16-lane few-row attention against a float64 reference: keys and value heads that
are and are not whole vectors, a last group of fewer than four query rows, grouped-query heads, per-head and
broadcast biases; a row without a finite score is refused; and an encoder-sized Attention node takes it (and a
decode step's one row per head does not)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.algorithms import tiled_attention
from onnx_runtime_ep_cpu.compiled import attention_lanes


def _reference(q, k, v, scale, bias):
    """softmax(q k^T * scale + bias) v in float64 over (B, S, H, D) q and (B, T, G, D) k, v; bias (B', H', M', T)."""
    group = q.shape[2] // k.shape[2]
    queries = q.astype(np.float64).transpose(0, 2, 1, 3)
    keys = np.repeat(k.astype(np.float64).transpose(0, 2, 1, 3), group, axis=1)
    values = np.repeat(v.astype(np.float64).transpose(0, 2, 1, 3), group, axis=1)
    scores = queries @ keys.transpose(0, 1, 3, 2) * scale
    if bias.size:
        scores = scores + bias.astype(np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ values).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("batch,rows,keys,heads,kv_heads,size,value_size,bias_shape", [
    (1, 16, 16, 4, 4, 16, 16, (1, 4, 16, 16)),  # T5's per-head relative-position bias
    (1, 17, 17, 4, 4, 16, 16, None),  # ViT: a class token past whole vectors of keys, one row in the last group
    (2, 50, 50, 4, 4, 16, 16, (2, 1, 1, 50)),  # a key-padding mask per batch
    (1, 6, 33, 8, 2, 64, 64, None),  # grouped-query heads, keys one past two vectors
    (1, 9, 7, 3, 3, 24, 24, (1, 1, 9, 7)),  # heads of a vector and a half, fewer keys than a vector
    (1, 5, 20, 2, 1, 8, 40, None),  # value heads wider than query heads, not whole vectors
])
def test_lanes_match_float64(batch, rows, keys, heads, kv_heads, size, value_size, bias_shape):
    rng = np.random.default_rng(rows * keys + size)
    q = rng.standard_normal((batch, rows, heads, size)).astype(np.float32)
    k = rng.standard_normal((batch, keys, kv_heads, size)).astype(np.float32)
    v = rng.standard_normal((batch, keys, kv_heads, value_size)).astype(np.float32)
    bias = np.empty((0, 0, 0, 0), np.float32) if bias_shape is None else\
        (rng.standard_normal(bias_shape) * 3).astype(np.float32)
    scale = np.float32(1 / np.sqrt(size))
    y = np.full((batch, rows, heads, value_size), np.nan, np.float32)
    scratch = np.full(attention_lanes.scratch_size(size, keys), np.nan, np.float32)  # garbage must not leak in
    assert attention_lanes.few_rows_in_lanes(q, k, v, scale, bias, y, scratch)
    expected = _reference(q, k, v, scale, bias)
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())


def test_lanes_refuse_a_row_without_finite_scores():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 8, 2, 16)).astype(np.float32) for _ in range(3))
    bias = np.zeros((1, 1, 8, 8), np.float32)
    bias[0, 0, 5] = -np.inf  # row 5 sees no key
    y = np.empty_like(q)
    scratch = np.empty(attention_lanes.scratch_size(16, 8), np.float32)
    assert not attention_lanes.few_rows_in_lanes(q, k, v, np.float32(0.25), bias, y, scratch)


@pytest.mark.parametrize("length,heads,size,past,expect_lanes", [(50, 4, 16, False, True), (16, 4, 16, False, True),
                                                                  (1, 4, 16, True, False)])
def test_attention_node_takes_lanes(length, heads, size, past, expect_lanes, monkeypatch):
    """An encoder's Attention (whisper's 50 positions, heads of 16) runs the 16-lane loop, beyond the scalar loop's
    reach; a decode step's single row per head keeps the scalar loop. Y against float64 either way."""
    if not tiled_attention.gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts")
    calls = []
    loaded = list(tiled_attention.few_rows_loops()) + tiled_attention.FEW_ROWS[2:]

    def counting(real, name):
        def counted(*args):
            calls.append(name)
            return real(*args)
        return counted

    monkeypatch.setattr(tiled_attention, "FEW_ROWS",
                        [counting(loaded[0], "lanes"), counting(loaded[1], "scalar"), *loaded[2:]])
    width, keys = heads * size, length + (15 if past else 0)
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=heads, kv_num_heads=heads)
    inputs = [tensor_info("q", TensorProto.FLOAT, [1, length, width])] +\
        [tensor_info(name, TensorProto.FLOAT, [1, keys, width]) for name in ("k", "v")]
    model = make_model([node], inputs, [tensor_info("y", TensorProto.FLOAT, None)], opset=23)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(length)
    feeds = {"q": rng.standard_normal((1, length, width)).astype(np.float32)}
    feeds.update({name: rng.standard_normal((1, keys, width)).astype(np.float32) for name in ("k", "v")})
    y, = session.run(None, feeds)
    split = [feeds[name].reshape(1, -1, heads, size) for name in ("q", "k", "v")]
    expected = _reference(*split, 1 / np.sqrt(size), np.empty(0)).reshape(1, length, width)
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())
    assert calls and set(calls) == {"lanes" if expect_lanes else "scalar"}
