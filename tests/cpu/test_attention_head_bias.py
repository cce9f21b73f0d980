"""Attention with a float32 bias per query head ((1, H, M, T): T5's relative positions with its mask) takes the
compiled softmax pass per head (ops/transformer.py compiled_attention) once the keys are past the one-call small
attention: against a float64 reference and onnxruntime, for grouped-query heads, a batch, and a row a head's
bias hides entirely (the general path decides it, as before)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.compiled import transformer as compiled


def _model(batch: int, heads: int, kv_heads: int, rows: int, keys: int, size: int) -> bytes:
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in (
        ("q", [batch, heads, rows, size]), ("k", [batch, kv_heads, keys, size]), ("v", [batch, kv_heads, keys, size]),
        ("bias", [1, heads, rows, keys]))]
    node = helper.make_node("Attention", ["q", "k", "v", "bias"], ["y"])
    output = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "attention", inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10).SerializeToString()


def _reference(q, k, v, bias) -> np.ndarray:
    group = q.shape[1] // k.shape[1]
    k, v = (np.repeat(x.astype(np.float64), group, axis=1) for x in (k, v))
    scores = q.astype(np.float64) @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]) + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


@pytest.fixture
def head_passes(monkeypatch):
    """Counts compiled_attention's softmax passes (one per head on this path)."""
    calls = {"count": 0}
    original = compiled.mask_and_shift_

    def counting(scores, scale, mask, first_row):
        calls["count"] += 1
        return original(scores, scale, mask, first_row)

    monkeypatch.setattr(compiled, "mask_and_shift_", counting)
    return calls


@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 4, 4), (2, 4, 2)])
def test_a_bias_per_head_takes_the_compiled_pass_per_head(batch, heads, kv_heads, head_passes):
    rows, keys, size = 16, 300, 16
    rng = np.random.default_rng(batch + heads + kv_heads)
    q = rng.standard_normal((batch, heads, rows, size), dtype=np.float32)
    k = rng.standard_normal((batch, kv_heads, keys, size), dtype=np.float32)
    v = rng.standard_normal((batch, kv_heads, keys, size), dtype=np.float32)
    bias = (rng.standard_normal((1, heads, rows, keys)) * 2).astype(np.float32)
    bias[0, 1, :, keys // 2:] = -np.inf  # a head whose bias hides half of the keys from every row
    feeds = {"q": q, "k": k, "v": v, "bias": bias}
    model = _model(batch, heads, kv_heads, rows, keys, size)
    (ours,) = ort.InferenceSession(model, providers=["cpu"]).run(None, feeds)
    assert head_passes["count"] == batch * heads
    (theirs,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(ours, _reference(q, k, v, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_row_a_head_hides_entirely_goes_to_the_general_path(head_passes):
    batch, heads, rows, keys, size = 1, 4, 16, 300, 16
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for shape in (
        (batch, heads, rows, size), (batch, heads, keys, size), (batch, heads, keys, size)))
    bias = rng.standard_normal((1, heads, rows, keys)).astype(np.float32)
    bias[0, 2, 3] = -np.inf
    model = _model(batch, heads, heads, rows, keys, size)
    feeds = {"q": q, "k": k, "v": v, "bias": bias}
    (ours,) = ort.InferenceSession(model, providers=["cpu"]).run(None, feeds)
    assert 1 <= head_passes["count"] <= heads  # stopped at the head with the hidden row
    (theirs,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-5, atol=1e-5)
