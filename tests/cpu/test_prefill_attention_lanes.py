"""A decoder's prefill attention over (B, H, S, D) heads through compiled/attention_lanes.py's 16-lane loop
(few_rows_by_head): against a float64 reference on its own (grouped-query heads, causal and per-head biases, a last
group of fewer than four rows, keys and heads that are not whole vectors), a row without a finite score refused,
a 4-D Attention node taking it for a prefill and not for a decode step's single row; and the prefill of the zoo's
decoders from both torch exporters (LLaMA with grouped-query heads, GPT-2, T5 with its position bias and
cross-attention) running it, each call's Y against float64 and the model's outputs against onnxruntime."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.algorithms import tiled_attention
from onnx_runtime_ep_cpu.compiled import attention_lanes
from onnx_runtime_ep_cpu.ops import transformer

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "benchmarks" / ".models" / "zoo"


def _reference(q, k, v, scale, bias):
    """softmax(q k^T * scale + bias) v in float64 over (B, H, S, D) q and (B, G, T, D) k, v."""
    group = q.shape[1] // k.shape[1]
    keys = np.repeat(k.astype(np.float64), group, axis=1)
    values = np.repeat(v.astype(np.float64), group, axis=1)
    scores = q.astype(np.float64) @ keys.transpose(0, 1, 3, 2) * float(scale)
    if bias.size:
        scores = scores + bias.astype(np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights @ values


def _causal(rows, keys):
    return np.triu(np.full((rows, keys), -np.inf, np.float32), keys - rows + 1).reshape(1, 1, rows, keys)


@pytest.mark.parametrize("batch,heads,kv_heads,rows,keys,size,value_size,bias", [
    (1, 4, 2, 16, 16, 16, 16, "causal"),  # the zoo's LLaMA prefill: grouped-query heads, the causal mask
    (1, 4, 4, 16, 16, 16, 16, "per_head"),  # T5: a relative-position bias per head
    (2, 3, 3, 9, 7, 24, 24, None),  # heads of a vector and a half, fewer keys than a vector, a last row alone
    (1, 8, 2, 6, 33, 64, 64, "causal"),  # keys one past two vectors, a chunk over a past
    (1, 2, 1, 5, 20, 8, 40, None),  # value heads wider than query heads, not whole vectors
])
def test_by_head_matches_float64(batch, heads, kv_heads, rows, keys, size, value_size, bias):
    rng = np.random.default_rng(rows * keys + size)
    q = rng.standard_normal((batch, heads, rows, size)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, keys, size)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, keys, value_size)).astype(np.float32)
    if bias == "causal":
        added = _causal(rows, keys)
    elif bias == "per_head":
        added = (rng.standard_normal((1, heads, rows, keys)) * 3).astype(np.float32)
    else:
        added = np.empty((0, 0, 0, 0), np.float32)
    scale = np.float32(1 / np.sqrt(size))
    y = np.full((batch, heads, rows, value_size), np.nan, np.float32)
    scratch = np.full(attention_lanes.scratch_size(size, keys), np.nan, np.float32)  # garbage must not leak in
    assert attention_lanes.few_rows_by_head(q, k, v, scale, added, y, scratch)
    expected = _reference(q, k, v, scale, added)
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())


def test_by_head_refuses_a_row_without_finite_scores():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))
    bias = np.zeros((1, 1, 8, 8), np.float32)
    bias[0, 0, 3] = -np.inf  # row 3 sees no key
    scratch = np.empty(attention_lanes.scratch_size(16, 8), np.float32)
    assert not attention_lanes.few_rows_by_head(q, k, v, np.float32(0.25), bias, np.empty_like(q), scratch)


def _counting(monkeypatch) -> list:
    calls = []
    real = transformer.few_by_head

    def counted(geo, q, k, v, scale, bias, outputs=3):
        result = real(geo, q, k, v, scale, bias, outputs)
        calls.append((q.copy(), k.copy(), v.copy(), float(scale), np.array(bias), None if result is None
                      else result[0].copy()))
        return result

    monkeypatch.setattr(transformer, "few_by_head", counted)
    return calls


@pytest.mark.parametrize("rows,keys,mask,expect_lanes", [(16, 16, False, True), (12, 32, True, True),
                                                         (1, 17, True, False)])
def test_attention_node_takes_by_head_lanes(rows, keys, mask, expect_lanes, monkeypatch):
    """A 4-D causal Attention as the decoder fusions leave it (the past concatenated before it): a prefill
    (is_causal) and a chunk over a past (a float causal mask) run the 16-lane loop; a decode step's single row
    per head keeps the scalar loop. Y against float64 either way."""
    if not tiled_attention.gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts")
    calls = _counting(monkeypatch)
    heads, kv_heads, size = 4, 2, 16
    names = ["q", "k", "v"] + (["mask"] if mask else [])
    node = helper.make_node("Attention", names, ["y"], q_num_heads=heads, kv_num_heads=kv_heads,
                            is_causal=0 if mask else 1)
    shapes = {"q": [1, heads, rows, size], "k": [1, kv_heads, keys, size], "v": [1, kv_heads, keys, size]}
    if mask:
        shapes["mask"] = [1, 1, rows, keys]
    inputs = [tensor_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    model = make_model([node], inputs, [tensor_info("y", TensorProto.FLOAT, None)], opset=23)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(rows + keys)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    if mask:
        feeds["mask"] = _causal(rows, keys)
    y, = session.run(None, feeds)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], 1 / np.sqrt(size), _causal(rows, keys))
    assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())
    assert bool(calls) == expect_lanes


def _zoo_models():
    if not (ZOO / "manifest.json").is_file():
        return []
    return [model for model in json.loads((ZOO / "manifest.json").read_text())["models"]
            if model["status"] == "ok" and model["variant"] == "fp32" and model["model"] in ("llama", "gpt2",
                                                                                          "t5_decoder")]


@pytest.mark.parametrize("model", _zoo_models(), ids=lambda model: model["name"])
def test_zoo_decoder_prefill_runs_by_head_lanes(model, monkeypatch):
    """Both exporters' decoders: their prefill's attention runs the 16-lane loop over (B, H, S, D) heads (every
    call's Y within float32 rounding of float64 over the same inputs), and the outputs agree with onnxruntime."""
    if not tiled_attention.gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts")
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo_feeds import make_feeds

    calls = _counting(monkeypatch)
    feeds = make_feeds(model["calls"]["prefill"])
    path = str(ZOO / model["file"])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    for _ in range(3):  # the first runs may go through the generic plan, before one specialized to these shapes
        ours = session.run(None, feeds)
    assert calls, f"{model['name']}: no prefill attention ran the 16-lane loop over heads"
    for q, k, v, scale, bias, y in calls:
        assert y is not None
        expected = _reference(q, k, v, scale, bias)
        assert np.abs(y - expected).max() <= 2e-6 * max(1.0, np.abs(expected).max())
    theirs = oracle.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    for mine, reference in zip(ours, theirs):
        magnitude = float(np.abs(reference).max(initial=0.0))
        assert np.all(np.abs(mine - reference) <= 1e-4 * magnitude + 1e-4 * np.abs(reference))
