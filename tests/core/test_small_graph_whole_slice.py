"""elimination: a Slice that takes every element in order (start 0, step 1, end int64's largest) is bypassed, as
torch's STFT export writes them; any other Slice stays. Outputs against numpy's slicing."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

INT64_MAX = np.iinfo(np.int64).max


@pytest.mark.parametrize("starts, ends, axes, steps, whole", [
    ([0], [INT64_MAX], [2], [1], True),        # to int64's largest: past any end
    ([0, 0], [INT64_MAX, INT64_MAX], [1, 2], None, True),  # two axes, steps omitted
    ([0, 0], [3, 7], [1, 2], None, False),     # to the static lengths: left for inference to read
    ([0], [6], [2], [1], False),               # stops one short
    ([1], [INT64_MAX], [2], [1], False),       # starts past 0
    ([0], [INT64_MAX], [2], [2], False),       # every other element
    ([-1], [-INT64_MAX], [2], [-1], False),    # reversed
])
def test_a_slice_over_whole_axes_is_bypassed_and_others_stay(starts, ends, axes, steps, whole):
    names = ["starts", "ends", "axes"] + (["steps"] if steps is not None else [])
    values = [starts, ends, axes] + ([steps] if steps is not None else [])
    constants = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in zip(names, values)]
    nodes = [helper.make_node("Slice", ["x", *names], ["sliced"]), helper.make_node("Relu", ["sliced"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [2, 3, 7])], [tensor_info("y")], constants)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 3, 7)).astype(np.float32)
    index = [slice(None)] * 3
    for start, end, axis, step in zip(starts, ends, axes, steps or [1] * len(starts)):
        index[axis] = slice(start, None if abs(end) >= INT64_MAX else end, step)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x[tuple(index)], 0))
    ops = [node.op_type for node in session.graph_for({"x": x}).nodes]
    assert ("Slice" not in ops) == whole, ops
