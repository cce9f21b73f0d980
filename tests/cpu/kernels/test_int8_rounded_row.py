"""compiled/qgemm.requantized_product_rounded's second rounding (the bias row added to the dequantized product,
then rounded to a per-tensor grid), for a row of one value and of one value per column, against numpy's float32
evaluation of the same operations (Add, then QuantizeLinear -> DequantizeLinear)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import qgemm
from onnx_runtime_ep_cpu.compiled.qgemm_tiles import pairs_for


def _consts():
    consts = np.zeros(qgemm.CONSTS)
    consts[[qgemm.A_SCALE, qgemm.A_ZERO, qgemm.A_LOW, qgemm.A_HIGH, qgemm.A_QUANTIZE]] = (0.02, 128, 0, 255, 1)
    consts[[qgemm.Y_ZERO, qgemm.Y_LOW, qgemm.Y_HIGH, qgemm.Y_SCALE, qgemm.DEQUANTIZE]] = (128, 0, 255, 0.05, 1)
    return consts


@pytest.mark.parametrize("width", [1, 37])
def test_rounded_row_matches_numpy_float32(width):
    rng = np.random.default_rng(3)
    rows, depth, columns = 9, 24, 37
    a = (rng.standard_normal((rows, depth)) * 2).astype(np.float32)
    packed = np.ascontiguousarray(rng.integers(-100, 100, (columns, depth)).astype(np.int16))
    multiplier, offset = np.full(1, 0.02 * 0.004 / 0.05), np.zeros(1)
    row = (rng.standard_normal(width) * 3).astype(np.float32)
    after = np.array([0.07, 3, -128, 127], np.float64)  # an int8 grid
    product = np.empty((rows, columns), np.float32)
    qgemm.requantized_product(a, packed, pairs_for(packed), multiplier, offset, _consts(), product)
    out = np.empty((rows, columns), np.float32)
    qgemm.requantized_product_rounded(a, packed, pairs_for(packed), multiplier, offset, _consts(), row, after, out)
    s, z = np.float32(0.07), np.float32(3)
    total = product + row  # float32, as the Add node
    expected = (np.clip(np.rint(total / s) + z, np.float32(-128), np.float32(127)) - z) * s
    np.testing.assert_array_equal(out, expected)  # the same float32 operations on the same values
    assert len(np.unique(out)) > 10  # a real spread of codes, saturation included where the row pushes it
