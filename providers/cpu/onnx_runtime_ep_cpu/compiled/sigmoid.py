"""The logistic sigmoid of a small float32/float64 tensor in one compiled pass. On a streaming model's tensors
(a gate's hidden row, one probability) numpy's four whole-array operations and the np.errstate around them
cost many times the arithmetic; the loop raises no floating-point warnings (inf and NaN pass through as in
numpy's formula), so it needs no errstate either.
"""

from __future__ import annotations

import numpy as np

from . import jit


@jit
def sigmoid_into(x, y):
    """y = 1 / (1 + exp(-x)) elementwise, in x's dtype (flat, contiguous arrays of one dtype)."""
    one = np.ones(1, dtype=x.dtype)[0]
    for i in range(x.size):
        y[i] = one / (one + np.exp(-x[i]))
