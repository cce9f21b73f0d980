"""An Attention kernel without a causal or window frontier reads the keys' length per call: one kernel serves
every step of a decode loop whose past grows (session/steps.py ShapeKeyedKernel.shape_key), and its results
stay those of a float64 reference at every length. A frontier depends on the length: such a node still gets a
kernel per length."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.session import steps

HEADS, SIZE = 2, 8


def _model(causal: int) -> bytes:
    """y = Attention(q, k, v, mask) over (1, heads, length, size) operands whose lengths are symbolic."""
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"], is_causal=causal)
    inputs = [tensor_info("q", TensorProto.FLOAT, [1, HEADS, "queries", SIZE]),
              tensor_info("k", TensorProto.FLOAT, [1, HEADS, "keys", SIZE]),
              tensor_info("v", TensorProto.FLOAT, [1, HEADS, "keys", SIZE]),
              tensor_info("mask", TensorProto.FLOAT, [1, 1, "queries", "keys"])]
    return make_model([node], inputs, [tensor_info("y", TensorProto.FLOAT, None)], opset=23).SerializeToString()


def _reference(q, k, v, mask, causal: bool) -> np.ndarray:
    q, k, v, mask = (x.astype(np.float64) for x in (q, k, v, mask))
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(SIZE) + mask
    if causal:  # without past inputs the frontier is aligned top-left: query i sees keys 0..i
        rows, keys = scores.shape[-2:]
        scores = np.where(np.arange(keys)[None, :] > np.arange(rows)[:, None], -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


@pytest.fixture
def attention_kernels_made(monkeypatch) -> list:
    """The input shapes of every Attention kernel the session makes."""
    made: list = []
    original = steps.make_kernel

    def counting(handle, node, shapes, graph):
        if node.op_type == "Attention":
            made.append(tuple(shapes))
        return original(handle, node, shapes, graph)

    monkeypatch.setattr(steps, "make_kernel", counting)
    return made


@pytest.mark.parametrize("causal", [0, 1])
def test_a_growing_past_reuses_one_kernel_unless_a_frontier_needs_the_length(causal, attention_kernels_made):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", "0")  # the generic plan: symbolic lengths
    sess = ort.InferenceSession(_model(causal), options, providers=["cpu"])
    rng = np.random.default_rng(0)
    lengths = list(range(3, 15)) + [5, 40]  # a decode loop, a length seen before, a longer one
    for keys in lengths:
        q = rng.standard_normal((1, HEADS, 1, SIZE)).astype(np.float32)
        k, v = (rng.standard_normal((1, HEADS, keys, SIZE)).astype(np.float32) for _ in range(2))
        mask = np.where(rng.random((1, 1, 1, keys)) < 0.2, -np.inf, 0.0).astype(np.float32)
        mask[..., 0] = 0.0  # every row sees a key
        (y,) = sess.run(None, {"q": q, "k": k, "v": v, "mask": mask})
        np.testing.assert_allclose(y, _reference(q, k, v, mask, bool(causal)), rtol=1e-5, atol=1e-6)
    if causal:
        assert len(attention_kernels_made) == len(set(lengths))  # the frontier is built per length
    else:
        assert attention_kernels_made == [((1, HEADS, 1, SIZE), (1, HEADS, 3, SIZE), (1, HEADS, 3, SIZE),
                                           (1, 1, 1, 3))]
    # A query count the kernel was not made for gets its own kernel, and its results hold.
    q = rng.standard_normal((1, HEADS, 2, SIZE)).astype(np.float32)
    k, v = (rng.standard_normal((1, HEADS, 9, SIZE)).astype(np.float32) for _ in range(2))
    mask = np.zeros((1, 1, 2, 9), np.float32)
    before = len(attention_kernels_made)
    (y,) = sess.run(None, {"q": q, "k": k, "v": v, "mask": mask})
    np.testing.assert_allclose(y, _reference(q, k, v, mask, bool(causal)), rtol=1e-5, atol=1e-6)
    assert len(attention_kernels_made) == before + 1
