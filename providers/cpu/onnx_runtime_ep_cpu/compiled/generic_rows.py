"""numpy equivalents of row loops that both the float twins (generic.py) and the integer ones (generic_int8.py)
use: the row softmax of compiled/transformer.py."""

from __future__ import annotations

import numpy as np


def softmax_rows_float32_(x, y):
    peak = np.fmax.reduce(x, axis=1, initial=-np.inf)  # transformer.row_max: the largest non-NaN value
    weights = np.exp(x - peak[:, None])
    weights *= np.float32(1) / weights.sum(axis=1, keepdims=True)
    y[...] = weights
