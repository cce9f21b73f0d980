"""The few-row attention over a 3-D Attention's (B, S, H * D) inputs (algorithms/tiled_attention.few_in_place)
gives Y alone to a node with one output, and Y with the keys and values as heads to a node that also asks for
present_key/present_value: both against a float64 reference, over odd head sizes, a mask and batches above one."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.algorithms import tiled_attention
from onnx_runtime_ep_cpu.compiled import deferred


def _reference(q, k, v, heads, size, mask):
    """softmax(Q K^T / sqrt(size) + mask) V in float64, per head, as (B, S, H * D)."""
    batch, length = q.shape[:2]

    def split(x):
        return x.astype(np.float64).reshape(batch, length, heads, size).transpose(0, 2, 1, 3)

    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(size)
    if mask is not None:
        scores = scores + mask.astype(np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ split(v)).transpose(0, 2, 1, 3).reshape(batch, length, heads * size), split(k), split(v)


@pytest.mark.parametrize("batch,length,heads,size,masked,outputs", [
    (1, 16, 4, 16, True, 1), (2, 7, 3, 5, False, 1), (2, 9, 2, 13, True, 3), (1, 17, 4, 16, False, 3)])
def test_few_row_attention_outputs(batch, length, heads, size, masked, outputs, monkeypatch):
    served = []
    real = tiled_attention.few_in_place

    def counted(*args):
        result = real(*args)
        served.append(result is not None)
        return result

    monkeypatch.setattr("onnx_runtime_ep_cpu.ops.transformer.few_in_place", counted)
    width = heads * size
    names = ["y", "present_key", "present_value"][:outputs]
    node = helper.make_node("Attention", ["q", "k", "v"] + (["mask"] if masked else []), names,
                            q_num_heads=heads, kv_num_heads=heads)
    inputs = [tensor_info(name, TensorProto.FLOAT, [batch, length, width]) for name in ("q", "k", "v")]
    if masked:
        inputs.append(tensor_info("mask", TensorProto.FLOAT, [batch, 1, length, length]))
    model = make_model([node], inputs, [tensor_info(name, TensorProto.FLOAT, None) for name in names], opset=23)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(length * heads + size)
    feeds = {name: rng.standard_normal((batch, length, width)).astype(np.float32) for name in ("q", "k", "v")}
    mask = None
    if masked:
        mask = np.where(rng.random((batch, 1, length, length)) < 0.3, -1e4, 0).astype(np.float32)
        mask[..., 0] = 0  # every row sees a key
        feeds["mask"] = mask
    session.run(None, feeds)  # (a first run may be numpy's while numba loads in the background)
    deferred.wait_ready(600)
    served.clear()
    results = session.run(None, feeds)
    expected = _reference(feeds["q"], feeds["k"], feeds["v"], heads, size, mask)
    assert len(results) == outputs
    for got, want in zip(results, expected):
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 2e-6 * (np.abs(want).max() + 1)
    assert served and all(served)  # the few-row loop computed them
