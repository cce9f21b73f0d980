"""Unsqueeze with constant axes keeps, per input rank, where each output dimension comes from (a decode loop's
lengths change every step): the outputs must be np.expand_dims of each call's input, for new lengths, a new
rank and negative axes, and bad axes must still be refused."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError


def _session(axes: list[int]) -> ort.InferenceSession:
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"])
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, None)], [tensor_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(np.array(axes, np.int64), "axes")], opset=13)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", "0")  # the constant axes reach the kernel
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


@pytest.mark.parametrize("axes", [[0], [0, 1], [-1], [1, -1], [2, 0]])
def test_unsqueeze_follows_each_calls_shape(axes):
    sess = _session(axes)
    rng = np.random.default_rng(0)
    for shape in [(1, 5), (1, 6), (1, 7), (1, 6), (2, 3, 4), (2, 3, 5), (1, 7)]:
        x = rng.standard_normal(shape).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        want = np.expand_dims(x, tuple(a % (x.ndim + len(axes)) for a in axes))
        assert y.shape == want.shape
        np.testing.assert_array_equal(y, want)


def test_bad_axes_are_still_refused():
    sess = _session([0, 0])
    with pytest.raises(OnnxRuntimeError, match="duplicate"):
        sess.run(None, {"x": np.ones((1, 5), np.float32)})
