"""Shape-only steps (what a plan computes from the feeds' shapes alone: the positions and masks of a decode step
whose lengths stay symbolic) run once per shapes of the feeds they read; later runs with those shapes reuse the
values (session/steps.py ShapeValues). The results must stay those of the graph, for every sequence of shapes."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.session.steps import ShapeValues


def _model() -> bytes:
    """present = Concat(past, x); y = present * (position + 1) * (1 where the position is in the past, else 2),
    positions a Range over Shape(present), compared with Shape(past), as exporters build causal masks."""
    constants = {
        "one_index": np.array(1, np.int64), "zero": np.array(0, np.int64), "step": np.array(1, np.int64),
        "axes": np.array([0, 2], np.int64), "low": np.array(1.0, np.float32), "high": np.array(2.0, np.float32),
        "unit": np.array(1.0, np.float32),
    }
    nodes = [
        helper.make_node("Shape", ["past"], ["past_shape"]),
        helper.make_node("Gather", ["past_shape", "one_index"], ["past_len"], axis=0),
        # The Range's limit is read off Concat's output, as T5's relative positions are: its shape too is
        # fixed by the feeds' shapes.
        helper.make_node("Concat", ["past", "x"], ["present"], axis=1),
        helper.make_node("Shape", ["present"], ["present_shape"]),
        helper.make_node("Gather", ["present_shape", "one_index"], ["total"], axis=0),
        helper.make_node("Range", ["zero", "total", "step"], ["positions"]),
        helper.make_node("Cast", ["positions"], ["positions_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["positions_f", "unit"], ["weights"]),
        helper.make_node("Less", ["positions", "past_len"], ["in_past"]),
        helper.make_node("Where", ["in_past", "low", "high"], ["mask"]),
        helper.make_node("Mul", ["weights", "mask"], ["scale"]),
        helper.make_node("Unsqueeze", ["scale", "axes"], ["scale3"]),
        helper.make_node("Mul", ["present", "scale3"], ["y"]),
    ]
    model = make_model(
        nodes,
        [tensor_info("x", TensorProto.FLOAT, [1, "seq", 4]), tensor_info("past", TensorProto.FLOAT, [1, "past", 4])],
        [tensor_info("y", TensorProto.FLOAT, None), tensor_info("present", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in constants.items()])
    return model.SerializeToString()


def _expected(x: np.ndarray, past: np.ndarray) -> np.ndarray:
    present = np.concatenate((past, x), 1).astype(np.float64)
    positions = np.arange(present.shape[1], dtype=np.float64)
    scale = (positions + 1) * np.where(positions < past.shape[1], 1.0, 2.0)
    return present * scale[None, :, None]


def _session(specialize: str, folder) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", specialize)
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / "shape_values")
    return ort.InferenceSession(_model(), options, providers=["cpu"])


@pytest.mark.parametrize("specialize", ["0", "1"])
def test_shape_only_steps_run_once_per_shapes_and_results_hold(specialize, tmp_path):
    sess = _session(specialize, tmp_path)
    rng = np.random.default_rng(0)
    # A prefill, decode steps repeating a length, new lengths, and a length seen before coming back.
    for seq, past in [(3, 0), (1, 5), (1, 5), (1, 5), (1, 6), (1, 6), (1, 5), (2, 5), (1, 6)]:
        x = rng.standard_normal((1, seq, 4)).astype(np.float32)
        past_value = rng.standard_normal((1, past, 4)).astype(np.float32)
        y, present = sess.run(None, {"x": x, "past": past_value})
        np.testing.assert_allclose(y, _expected(x, past_value), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(present, np.concatenate((past_value, x), 1))
        assert y.flags.writeable and present.flags.writeable  # outputs are the caller's, never kept values
    calls = sess.profile_summary().get("Range", (0.0, 0))[1]
    # Distinct (seq, past) pairs: (3, 0), (1, 5), (1, 6), (2, 5), each computed once (where a specialization
    # folded the Range away entirely for an exact signature, fewer).
    assert 1 <= calls <= 4, sess.profile_summary()
    sess.end_profiling()


def test_kept_values_are_not_mixed_across_shapes(tmp_path, monkeypatch):
    monkeypatch.setattr(ShapeValues, "LIMIT", 16)
    sess = _session("0", tmp_path)
    rng = np.random.default_rng(1)
    lengths = [(1, p) for p in range(1, 40)] * 2  # more than the cache holds: it starts over, results hold
    for seq, past in lengths:
        x = rng.standard_normal((1, seq, 4)).astype(np.float32)
        past_value = rng.standard_normal((1, past, 4)).astype(np.float32)
        y, _ = sess.run(None, {"x": x, "past": past_value})
        np.testing.assert_allclose(y, _expected(x, past_value), rtol=1e-6, atol=1e-6)
    sess.end_profiling()


def test_a_shape_that_values_decide_is_not_kept(tmp_path):
    """Shape(NonZero(x > 0)) depends on x's values: runs with one shape and other values must see their own."""
    nodes = [
        helper.make_node("Greater", ["x", "zero"], ["positive"]),
        helper.make_node("NonZero", ["positive"], ["where"]),
        helper.make_node("Shape", ["where"], ["where_shape"]),
        helper.make_node("Gather", ["where_shape", "one_index"], ["count"], axis=0),
        helper.make_node("Cast", ["count"], ["count_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "count_f"], ["y"]),
    ]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["n"])], [tensor_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(np.array(0, np.float32), "zero"),
                        numpy_helper.from_array(np.array(1, np.int64), "one_index")])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    rng = np.random.default_rng(2)
    for _ in range(6):
        x = rng.standard_normal(8).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, x * np.float32((x > 0).sum()))
