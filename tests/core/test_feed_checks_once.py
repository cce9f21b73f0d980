"""Array feeds are checked once per name, dtype and shape (a decode loop feeds the same every step); a feed of
another dtype or shape after accepted ones is still refused, naming the input, the expectation and the fix."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError


def _session() -> ort.InferenceSession:
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", TensorProto.FLOAT, ["n", 3])],
                       [tensor_info("y", TensorProto.FLOAT, None)])
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def test_accepted_feeds_skip_the_checks_and_others_are_still_refused():
    sess = _session()
    x = np.array([[-1.0, 0.5, 2.0]], np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
    with pytest.raises(InvalidArgumentError, match=r"input 'x' expects tensor\(float\), got float64 array.*astype"):
        sess.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(InvalidArgumentError, match=r"input 'x' dimension 1 must be 3"):
        sess.run(None, {"x": np.ones((1, 4), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"unknown input 'z'"):
        sess.run(None, {"x": x, "z": x})
    np.testing.assert_array_equal(sess.run(None, {"x": -x})[0], np.maximum(-x, 0))
