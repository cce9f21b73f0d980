"""compiled/transformer.as_rows hands the elementwise Gelu loops long rows whose length leaves the vectorized inner
loop no scalar remainder: one row up to _ROW_FLOATS elements (a Conv1d output of 64 channels x 100 frames), rows
of a power of two dividing larger sizes, else rows along the last axis; the Gelu node's values against float64 on
each kind (erf and tanh forms), and the same bits as rows along the last axis."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.algorithms.activations import gelu_series
from onnx_runtime_ep_cpu.compiled import transformer


@pytest.mark.parametrize("shape,rows", [
    ((1, 64, 100), (1, 6400)),  # Whisper's first Gelu: one row, not 64 rows of 100
    ((2, 64, 100), (25, 512)),
    ((3, 5, 7), (1, 105)),
    ((9001, 3), (1, 27003)),  # no power-of-two divisor of 64 or more, last axis short: one long row
    ((97, 101), (97, 101)),  # odd sizes past one row: rows along the last axis
    ((89, 2, 71), (178, 71)),
    ((101, 100), (101, 100)),  # 10100 = 4 x 2525
])
def test_rows_leave_no_remainder_where_they_can(shape, rows):
    assert transformer.as_rows(np.zeros(shape, np.float32)).shape == rows


def _gelu_float64(x, approximate):
    x = x.astype(np.float64)
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("shape", [(1, 64, 100), (2, 64, 100), (101, 100), (3, 5, 7)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_over_these_rows_matches_float64_and_the_last_axis_rows(shape, approximate):
    x = (np.random.default_rng(sum(shape)).standard_normal(shape) * 3).astype(np.float32)
    node = helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, shape)], [tensor_info("y", TensorProto.FLOAT)],
                       opset=20)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    expected = _gelu_float64(x, approximate)
    assert np.abs(y - expected).max() <= 4e-7 * max(1.0, np.abs(expected).max())
    by_last_axis = transformer.gelu(x.reshape(-1, shape[-1]), gelu_series(approximate, np.float32))
    assert np.array_equal(y, by_last_axis.reshape(shape))
