"""A decode step whose past length is symbolic (the specializer's template after a prefill): the lengths
the graph derives from it (Shape(past)[2] + 1 through Range and Expand, Concat(past, new)) are proven
equal, so the attention fuses with its mask and everything read after it has known shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper


def _const(name, value):
    array = np.asarray(value)
    return numpy_helper.from_array(array.astype(np.float32 if array.dtype.kind == "f" else np.int64), name)


def _decode_model():
    """One attention step as TorchScript spells it: the mask from a Range over the total length, Expanded
    to a target computed from it, the output reshaped by a target read from its own Shape."""
    nodes = [
        helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
        helper.make_node("Shape", ["past"], ["past_shape"]),
        helper.make_node("Gather", ["past_shape", "two"], ["past_len"], axis=0),
        helper.make_node("Add", ["past_len", "one"], ["total"]),
        helper.make_node("Range", ["zero", "total", "one"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["positions_f", "slope"], ["bias"]),  # an ALiBi-like bias over the keys
        helper.make_node("Unsqueeze", ["total", "zero_axis"], ["total_1d"]),
        helper.make_node("Concat", ["ones3", "total_1d"], ["mask_shape"], axis=0),
        helper.make_node("Expand", ["bias", "mask_shape"], ["mask"]),
        helper.make_node("Transpose", ["present"], ["present_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "present_t"], ["scores"]),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["weights"], axis=-1),
        helper.make_node("MatMul", ["weights", "present"], ["context"]),
        helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Shape", ["context_t"], ["context_shape"]),
        helper.make_node("Slice", ["context_shape", "zero_axis", "two_1d"], ["leading"]),
        helper.make_node("Concat", ["leading", "minus_one"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["context_t", "flat_shape"], ["y"]),
    ]
    inits = [_const("two", 2), _const("one", 1), _const("zero", 0), _const("zero_axis", [0]),
             _const("ones3", [1, 1, 1]), _const("two_1d", [2]), _const("minus_one", [-1]),
             _const("slope", -0.125), _const("scale", 0.5)]
    return make_model(
        nodes,
        [tensor_info("q", TensorProto.FLOAT, [1, 2, "seq", 4]), tensor_info("new", TensorProto.FLOAT, [1, 2, "seq", 4]),
         tensor_info("past", TensorProto.FLOAT, [1, 2, "past", 4])],
        [tensor_info("y", TensorProto.FLOAT, None), tensor_info("present", TensorProto.FLOAT, None)],
        inits, opset=17).SerializeToString()


def _feeds(seq, past, rng):
    return {"q": rng.standard_normal((1, 2, seq, 4)).astype(np.float32),
            "new": rng.standard_normal((1, 2, seq, 4)).astype(np.float32),
            "past": rng.standard_normal((1, 2, past, 4)).astype(np.float32)}


def _reference(feeds):
    present = np.concatenate((feeds["past"], feeds["new"]), 2).astype(np.float64)
    keys = feeds["past"].shape[2] + 1  # the model's mask length: past + one token (one broadcast value at a prefill)
    scores = feeds["q"].astype(np.float64) @ present.transpose(0, 1, 3, 2) * 0.5 - 0.125 * np.arange(keys)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    context = (weights / weights.sum(-1, keepdims=True)) @ present
    return context.transpose(0, 2, 1, 3).reshape(1, context.shape[2], -1)


def test_a_decode_step_with_a_symbolic_past_fuses_attention_and_folds_what_follows():
    sess = ort.InferenceSession(_decode_model(), providers=["cpu"])
    rng = np.random.default_rng(0)
    prefill = _feeds(5, 0, rng)
    np.testing.assert_allclose(sess.run(["y"], prefill)[0], _reference(prefill), rtol=1e-5, atol=1e-6)
    for past in (5, 6, 9):
        feeds = _feeds(1, past, rng)
        np.testing.assert_allclose(sess.run(["y"], feeds)[0], _reference(feeds), rtol=1e-5, atol=1e-6)
    step = sess.graph_for(_feeds(1, 12, rng))
    assert step is sess.graph_for(_feeds(1, 13, rng))  # one plan for every past length
    ops = [node.op_type for node in step.nodes]
    assert "Attention" in ops and "Softmax" not in ops, ops
    assert ops.count("Shape") == 1, ops  # the past's length alone is read at run time


ZOO = Path(os.environ.get("ONNX_RUNTIME_ZOO") or Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo")
DECODERS = [m for m in json.loads((ZOO / "manifest.json").read_text())["models"]
            if m.get("status") == "ok" and m["variant"] == "fp32" and set(m.get("calls", {})) == {"prefill", "decode"}
            ] if (ZOO / "manifest.json").is_file() else []


def _zoo_feeds(call, past=None):
    """The manifest's feeds (tests/cpu/test_zoo.py's fills), the past lengths set to ``past``."""
    rng = np.random.default_rng(0)
    feeds = {}
    for feed in call["feeds"]:
        shape, dtype = list(feed["shape"]), np.dtype(feed["dtype"])
        if past is not None and feed["fill"] == "normal" and len(shape) == 4 and "encoder" not in feed["name"]:
            shape[2] = past
        if past is not None and feed["name"] == "attention_mask":
            shape[1] = past + 1
        if feed["fill"] == "ids":
            feeds[feed["name"]] = rng.integers(0, feed["high"], size=shape).astype(dtype)
        elif feed["fill"] == "positions":
            start = feed["start"] if past is None else past
            feeds[feed["name"]] = np.ascontiguousarray(np.broadcast_to(np.arange(start, start + shape[-1]), shape),
                                                       dtype=dtype)
        elif feed["fill"] == "normal":
            feeds[feed["name"]] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[feed["name"]] = (np.ones if feed["fill"] == "ones" else np.zeros)(shape, dtype)
    return feeds


@pytest.mark.parametrize("model", DECODERS, ids=[m["name"] for m in DECODERS])
def test_zoo_decoders_decode_steps_after_a_prefill_match_onnxruntime(model):
    """A prefill then three decode steps in one session (the template serves the steps), every output
    against onnxruntime at float32 tolerance; the steps' graph holds fewer nodes than the generic one."""
    oracle = pytest.importorskip("onnxruntime")
    path = str(ZOO / model["file"])
    sess, want = ort.InferenceSession(path, providers=["cpu"]), oracle.InferenceSession(path)
    calls = [_zoo_feeds(model["calls"]["prefill"])] + [_zoo_feeds(model["calls"]["decode"], p) for p in (16, 17, 18)]
    for feeds in calls:
        for got, expected in zip(sess.run(None, feeds), want.run(None, feeds)):
            magnitude = float(np.abs(expected).max()) if expected.size else 0.0
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * magnitude + 1e-7)
    step = sess.graph_for(calls[-1])
    assert step is sess.graph_for(calls[-2])
    assert len(step.nodes) < len(sess.model.graph.nodes)


def test_a_reshape_target_that_may_be_zero_is_not_taken_as_the_length():
    """Reshape(past, [len(past), -1]) copies the input's dimension where the length is 0 (allowzero 0): a
    bare symbol in a target proves nothing about the output's dimension."""
    nodes = [
        helper.make_node("Shape", ["past"], ["shape"], start=2, end=3),
        helper.make_node("Concat", ["shape", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["past", "target"], ["flat"]),
        helper.make_node("Shape", ["flat"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("past", TensorProto.FLOAT, [1, 2, "past", 4])],
                       [tensor_info("y", TensorProto.INT64, None)], [_const("minus_one", [-1])], opset=17)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    for past in (3, 5, 0, 7):  # exact, then the template (past symbolic) for 5, 0 and 7
        got = sess.run(None, {"past": np.zeros((1, 2, past, 4), np.float32)})[0]
        np.testing.assert_array_equal(got, np.zeros((1, 2, past, 4)).reshape(past or 1, -1).shape)
