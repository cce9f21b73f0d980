"""Range's element count over integers is ceil((limit - start) / delta) in exact arithmetic: int64 operands whose
difference wraps in the compute type gave a count of billions (fuzz seed 59: a 32 GiB allocation) where the exact
range is empty or short."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper

CASES = [(9 * 10**18, -9 * 10**18, 2**62), (-9 * 10**18, 9 * 10**18, -(2**62)), (-9 * 10**18, 9 * 10**18, 2**62),
         (2**62 + 5, 2**62 + 11, 2), (-(2**63), -(2**63) + 3, 1)]


def _session():
    names = ("start", "limit", "delta")
    graph = helper.make_graph([helper.make_node("Range", list(names), ["y"])], "range",
                              [helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in names],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("start, limit, delta", CASES)
def test_integer_range_counts_exactly(start, limit, delta):
    (y,) = _session().run(None, {"start": np.array(start, np.int64), "limit": np.array(limit, np.int64),
                                 "delta": np.array(delta, np.int64)})
    count = max(-((start - limit) // delta), 0)
    assert y.dtype == np.int64 and y.shape == (count,)
    assert [int(v) for v in y] == [start + i * delta for i in range(count)]
