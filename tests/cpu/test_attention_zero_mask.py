"""An Attention's constant mask that changes no score (float zeros, boolean True, over every key) is dropped
(attention_heads.drop_zero_masks): the kernel is made without it and Y stays the float64 reference's. Masks that
matter stay: non-zero values, a False, one narrower than the keys; and ViT's dynamo export, whose folded shape
subgraph leaves a zero mask, runs its attention without one, its logits as onnxruntime's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.session import executor, steps

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"
HEADS, ROWS, KEYS, SIZE = 2, 6, 9, 8


@pytest.fixture
def attention_inputs(monkeypatch) -> list:
    """How many inputs each Attention kernel the session makes is given."""
    made: list = []
    original = steps.make_kernel

    def recording(handle, node, shapes, graph):
        if node.op_type == "Attention":
            made.append(len([name for name in node.inputs if name]))
        return original(handle, node, shapes, graph)

    monkeypatch.setattr(steps, "make_kernel", recording)
    monkeypatch.setattr(executor, "make_kernel", recording)
    return made


def _reference(q, k, v, mask) -> np.ndarray:
    scores = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2) / np.sqrt(SIZE)
    if mask.dtype == bool:
        scores = np.where(mask, scores, -np.inf)
    else:
        width = mask.shape[-1]
        scores[..., :width] += mask
        scores[..., width:] = -np.inf  # a narrow mask hides the keys past it
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v.astype(np.float64)


def _run(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    shapes = {"q": [1, HEADS, ROWS, SIZE], "k": [1, HEADS, KEYS, SIZE], "v": [1, HEADS, KEYS, SIZE]}
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"])
    inputs = [tensor_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()]
    model = make_model([node], inputs, [tensor_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(mask, "mask")], opset=23)
    rng = np.random.default_rng(mask.size)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, feeds)
    return y, _reference(feeds["q"], feeds["k"], feeds["v"], mask)


@pytest.mark.parametrize("mask,dropped", [
    (np.zeros((1, 1, ROWS, KEYS), np.float32), True),
    (np.zeros((KEYS,), np.float32), True),  # broadcast over every row
    (np.full((1, HEADS, ROWS, KEYS), -0.0, np.float32), True),
    (np.ones((1, 1, ROWS, KEYS), bool), True),
    (np.eye(ROWS, KEYS, dtype=np.float32), False),
    (np.tril(np.ones((ROWS, KEYS), bool)), False),
    (np.zeros((1, 1, ROWS, KEYS - 2), np.float32), False),  # narrower than the keys: the last two are hidden
], ids=["zeros", "zeros-row", "negative-zeros", "all-true", "values", "causal-bool", "narrow"])
def test_a_mask_that_changes_nothing_is_dropped(mask, dropped, attention_inputs):
    y, expected = _run(mask)
    np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-6)
    assert attention_inputs and set(attention_inputs) == {3 if dropped else 4}


def test_vit_dynamo_runs_attention_without_its_zero_mask(attention_inputs):
    model = ZOO / "vit.dynamo.fp32.onnx"
    if not model.is_file():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    call = next(entry for entry in json.loads((ZOO / "manifest.json").read_text())["models"]
                if entry["name"] == "vit.dynamo.fp32")["calls"]["default"]
    pixels = np.random.default_rng(0).standard_normal(call["feeds"][0]["shape"]).astype(np.float32)
    feeds = {call["feeds"][0]["name"]: pixels}
    session = ort.InferenceSession(str(model), providers=["cpu"])
    for _ in range(3):  # the first runs may go through the generic plan, before one specialized to these shapes
        (ours,) = session.run(None, feeds)
    assert attention_inputs and attention_inputs[-1] == 3
    (theirs,) = oracle.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
