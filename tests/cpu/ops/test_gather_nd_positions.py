"""GatherND with read-only indices (a constant, or a shape value a plan keeps) reuses their flat positions while
the data's shape stays: the results must be numpy's fancy indexing of each call's data, for new data, a new
data shape and indices that are negative (which take the general path)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper


def _session(indices: np.ndarray) -> ort.InferenceSession:
    node = helper.make_node("GatherND", ["x", "indices"], ["y"])
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, ["a", "b", "c"])],
                       [tensor_info("y", TensorProto.FLOAT, None)], [numpy_helper.from_array(indices, "indices")])
    options = ort.SessionOptions()
    options.add_session_config_entry("session.specialize_shapes", "0")  # the constant indices reach the kernel
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


@pytest.mark.parametrize("indices", [
    np.array([[[0, 1], [2, 0]], [[1, 1], [0, 0]]], np.int64),  # pairs: rows of the last axis
    np.array([[0, 1, 2], [2, 0, 1]], np.int64),  # full coordinates: elements
    np.array([[-1, 0], [0, -2]], np.int64),  # negative: counted from the end
])
def test_gather_nd_with_constant_indices_follows_each_calls_data(indices):
    sess = _session(indices)
    rng = np.random.default_rng(0)
    for shape in [(3, 2, 4), (3, 2, 4), (3, 3, 5), (3, 2, 4)]:
        x = rng.standard_normal(shape).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, x[tuple(indices[..., axis] for axis in range(indices.shape[-1]))])
