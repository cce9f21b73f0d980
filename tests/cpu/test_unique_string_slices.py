"""Unique over string tensors along an axis: numpy's unique takes no axis for them, so slices are compared as
tuples. Checked against the same tensor spelled as integers (a monotone code per string), which numpy's own
unique orders the same way, and against onnxruntime."""

import numpy as np
import onnx_runtime
import pytest
from onnx import TensorProto, helper


def _model(elem_type, axis, keep_sorted):
    outputs = ["Y", "indices", "inverse_indices", "counts"]
    node = helper.make_node("Unique", ["X"], outputs, axis=axis, sorted=keep_sorted)
    graph = helper.make_graph(
        [node], "unique", [helper.make_tensor_value_info("X", elem_type, None)],
        [helper.make_tensor_value_info(o, elem_type if o == "Y" else TensorProto.INT64, None) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]).SerializeToString()


def _run(model, x):
    return onnx_runtime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"X": x})


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("keep_sorted", [0, 1])
def test_string_slices_match_the_same_tensor_as_integer_codes(axis, keep_sorted):
    rng = np.random.default_rng(abs(axis) + 7 * keep_sorted)
    vocabulary = np.array(["", "a", "ab", "b", "ba", "z\u00e9"], dtype=object)  # sorted: code order = string order
    codes = rng.integers(0, 3, size=(3, 4, 2)).astype(np.int64)
    codes = np.concatenate([codes, np.take(codes, [0, 1], axis=axis)], axis=axis)  # duplicates along axis
    strings = vocabulary[codes]
    y, first, inverse, counts = _run(_model(TensorProto.STRING, axis, keep_sorted), strings)
    y_codes, first_codes, inverse_codes, counts_codes = _run(_model(TensorProto.INT64, axis, keep_sorted), codes)
    np.testing.assert_array_equal(y, vocabulary[y_codes])
    for ours, reference in ((first, first_codes), (inverse, inverse_codes), (counts, counts_codes)):
        np.testing.assert_array_equal(ours, reference)
    assert y.shape[axis] < strings.shape[axis]  # the duplicates were found


def test_string_slices_agree_with_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    x = np.array([[["b", "a"], ["a", "a"], ["b", "a"]], [["c", "d"], ["a", "a"], ["c", "d"]]], dtype=object)
    model = _model(TensorProto.STRING, 1, 1)
    try:
        expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"X": x})
    except Exception as exc:  # noqa: BLE001  (an onnxruntime build without string Unique: nothing to compare)
        pytest.skip(f"onnxruntime does not run it: {exc}")
    for ours, theirs in zip(_run(model, x), expected):
        np.testing.assert_array_equal(ours, theirs)


def test_an_empty_axis_gives_empty_results():
    x = np.empty((2, 0, 3), dtype=object)
    y, first, inverse, counts = _run(_model(TensorProto.STRING, 1, 1), x)
    assert y.shape == (2, 0, 3) and first.size == inverse.size == counts.size == 0
