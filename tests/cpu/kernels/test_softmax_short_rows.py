"""Softmax's compiled rows (compiled/transformer.softmax_rows_float32_) on rows shorter than SHORT_ROW, which run
their exponentials as one loop over the block: the same bits as a row at a time (the row's largest non-NaN value,
exp_shifted_sum_, the reciprocal's product), in place or not, and within float32 rounding of the float64 formula;
-inf, +inf, NaN and huge entries as the formula gives them."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import transformer

F32 = np.float32


def _hard_rows(rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, width)) * 6).astype(F32)
    x[1, ::2] = -np.inf  # masked keys
    x[2] = -np.inf  # a row with no finite value: NaN
    x[3, -1] = np.inf  # NaN (inf - inf)
    x[4, 0] = np.nan
    x[5] *= F32(1e36)
    x[6] = F32(3e38)
    x[7] *= F32(1e-30)
    return x


def _row_at_a_time(x: np.ndarray) -> np.ndarray:
    """The long rows' steps, one row per call of the shared helpers."""
    y = np.empty_like(x)
    for r in range(x.shape[0]):
        peak = F32(transformer.row_max(x[r]))  # (float32, as inside the loop: numba would type a float as float64)
        total = transformer.exp_shifted_sum_(x[r], peak, y[r])
        y[r] *= F32(1) / F32(total)
    return y


def _exact(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        e = np.exp(x.astype(np.float64) - np.fmax.reduce(x.astype(np.float64), axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 50, transformer.SHORT_ROW - 1, transformer.SHORT_ROW, 100])
@pytest.mark.parametrize("in_place", [False, True])
def test_short_rows_same_bits_as_a_row_at_a_time(width, in_place):
    x = _hard_rows(12, width, width)
    expected = _row_at_a_time(x)
    y = x.copy() if in_place else np.empty_like(x)
    transformer.softmax_rows_float32_(y if in_place else x, y)
    np.testing.assert_array_equal(y.view(np.uint32)[~np.isnan(y)], expected.view(np.uint32)[~np.isnan(expected)])
    assert np.array_equal(np.isnan(y), np.isnan(expected))
    exact = _exact(x)
    np.testing.assert_allclose(y, exact, rtol=3e-6, atol=1e-12)  # NaN where the formula's is
    assert np.isnan(y[2]).all() and np.isnan(y[3]).all() and np.isnan(y[4]).all()


def test_short_rows_of_a_strided_output_take_the_row_loop():
    """An output that is not C-contiguous (a column slice) runs a row at a time, with the same values."""
    x = _hard_rows(10, 20, 3)
    wide = np.full((10, 40), F32(-7), F32)
    transformer.softmax_rows_float32_(x, wide[:, :20])
    expected = _row_at_a_time(x)
    assert np.array_equal(np.isnan(wide[:, :20]), np.isnan(expected))
    np.testing.assert_array_equal(np.nan_to_num(wide[:, :20]), np.nan_to_num(expected))
    assert (wide[:, 20:] == F32(-7)).all()
