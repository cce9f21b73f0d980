"""GatherElements with read-only indices (a constant, or a value a plan derives from shapes alone, as DeBERTa's
relative-position indices are) gathers by flat positions worked out once per data shape, instead of
np.take_along_axis's index grids on every call. The results must equal a plain loop over the indices for every
call's data, for new data shapes, negative indices and indices shorter than the data off the axis; indices out
of range still fail with the node's error."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper


def _reference(x: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
    """GatherElements by its definition, one element at a time, in float64."""
    out = np.empty(indices.shape, np.float64)
    for position in np.ndindex(indices.shape):
        source = list(position)
        index = int(indices[position])
        source[axis] = index + x.shape[axis] if index < 0 else index
        out[position] = x[tuple(source)]
    return out


def _deberta_positions_session() -> ort.InferenceSession:
    """DeBERTa's c2p gather as both torch exporters spell it: the relative positions i - j of the query rows
    (Range over the sequence length read from the scores' shape), shifted by the span, clipped into [0, 2 span),
    broadcast over the heads with Expand, then GatherElements along the last axis of (heads, rows, 2 span)."""
    span = 4
    consts = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in
              [("zero", 0), ("one", 1), ("span", span), ("top", 2 * span - 1), ("axis0", [0]), ("axis1", [1]),
               ("dim0", [0]), ("dim1", [1])]]
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "dim1"], ["rows1"], axis=0),
        helper.make_node("Squeeze", ["rows1", "axis0"], ["rows"]),
        helper.make_node("Range", ["zero", "rows", "one"], ["positions"]),
        helper.make_node("Unsqueeze", ["positions", "axis1"], ["query"]),
        helper.make_node("Unsqueeze", ["positions", "axis0"], ["key"]),
        helper.make_node("Sub", ["query", "key"], ["relative"]),
        helper.make_node("Add", ["relative", "span"], ["shifted"]),
        helper.make_node("Clip", ["shifted", "zero", "top"], ["clipped"]),
        helper.make_node("Gather", ["shape", "dim0"], ["heads"], axis=0),
        helper.make_node("Concat", ["heads", "rows1", "rows1"], ["grid"], axis=0),
        helper.make_node("Expand", ["clipped", "grid"], ["indices"]),
        helper.make_node("GatherElements", ["x", "indices"], ["y"], axis=-1),
    ]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["heads", "rows", 2 * span])],
                       [tensor_info("y", TensorProto.FLOAT, None)], consts)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


def _deberta_indices(heads: int, rows: int, span: int = 4) -> np.ndarray:
    relative = np.arange(rows)[:, None] - np.arange(rows)[None, :]
    return np.broadcast_to(np.clip(relative + span, 0, 2 * span - 1), (heads, rows, rows))


def test_deberta_relative_positions_gather_once_per_shape(monkeypatch):
    sess = _deberta_positions_session()
    rng = np.random.default_rng(0)
    grids = 0
    real = np.take_along_axis

    def counted(*args, **kwargs):
        nonlocal grids
        grids += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "take_along_axis", counted)
    shapes = [(4, 6), (4, 6), (2, 5), (4, 6), (2, 5), (4, 6)]
    for call, (heads, rows) in enumerate(shapes):
        if call == 3:  # each shape has run: its plan's indices are kept values from here on
            grids = 0
        x = rng.standard_normal((heads, rows, 8)).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y.astype(np.float64), _reference(x, _deberta_indices(heads, rows), 2))
    assert grids == 0  # the later calls by the kept flat positions


def _constant_session(indices: np.ndarray, axis: int) -> ort.InferenceSession:
    node = helper.make_node("GatherElements", ["x", "indices"], ["y"], axis=axis)
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, ["a", "b", "c"])],
                       [tensor_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(indices, "indices")])
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", "0")  # the constant indices reach the kernel
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


@pytest.mark.parametrize(("indices", "axis"), [
    (np.array([[[0, 2], [1, 1]], [[2, 0], [0, 1]]], np.int64), 2),  # shorter than the data off the axis
    (np.array([[[-1, 0, -3]], [[1, -2, 0]]], np.int32), 1),  # negative, counted from the end; int32
    (np.array([[[1, 0, 1, 0]]], np.int64), 0),  # along the first axis, one row of a larger batch
])
def test_constant_indices_follow_each_calls_data(indices, axis):
    sess = _constant_session(indices, axis)
    rng = np.random.default_rng(1)
    for shape in [(2, 3, 4), (2, 3, 4), (3, 3, 5), (2, 3, 4)]:
        x = rng.standard_normal(shape).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y.astype(np.float64), _reference(x, indices, axis))


def test_constant_indices_out_of_range_name_the_rule():
    sess = _constant_session(np.array([[[0, 4]]], np.int64), 2)
    with pytest.raises(Exception, match=r"out of range.*\[-n, n\)"):
        sess.run(None, {"x": np.zeros((1, 1, 4), np.float32)})
