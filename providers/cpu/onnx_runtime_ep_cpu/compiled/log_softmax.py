"""LogSoftmax over the rows of a float32 array in one compiled call.

A streaming model's closing LogSoftmax runs every frame on a few dozen classes; numpy's formula is six
whole-array operations and two temporaries, whose per-call cost is many times the arithmetic. The loop
reuses the softmax's row maximum and polynomial exp (transformer.py), so both agree on what a row's peak
and sum are; its numpy twin is generic.log_softmax_rows_float32_.
"""

from __future__ import annotations

import numpy as np

from .transformer import contracting_jit, exp_shifted_sum_, row_max


@contracting_jit
def log_softmax_rows_float32_(x, y):
    """y[r] = (x[r] - peak) - log(sum(exp(x[r] - peak))) over the rows of the 2-D float32 x, with peak the row's
    largest non-NaN value; y may not be x (y holds the exponentials before the result). A NaN, or a row
    without a finite maximum, gives NaN through the shift or the sum, as numpy's formula does; -inf entries
    of a row with a finite peak stay -inf."""
    for r in range(x.shape[0]):
        row, out = x[r], y[r]
        peak = row_max(row)
        log_total = np.float32(np.log(exp_shifted_sum_(row, peak, out)))
        for j in range(row.shape[0]):
            out[j] = (row[j] - peak) - log_total
