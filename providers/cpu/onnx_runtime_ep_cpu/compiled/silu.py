"""SiLU (Swish: x * sigmoid(alpha * x)) of a float32 tensor in one compiled pass.

EfficientNet applies it after most of its convolutions, on whole batch-sized maps: numpy's formula is four
passes over memory with a full-size temporary each, where this loop reads each element once and writes it
once. Its exp is transformer.sigmoid_float32's polynomial, whose operations vectorize (numba's own exp is
libm's scalar one without Intel's SVML).
"""

from __future__ import annotations

import numpy as np

from .transformer import contracting_jit, sigmoid_float32


@contracting_jit
def silu_float32(x, y, alpha):
    """y = x * sigmoid(alpha * x) elementwise over flat, contiguous float32 arrays (y may be x)."""
    a = np.float32(alpha)
    for i in range(x.shape[0]):
        v = x[i]
        y[i] = v * sigmoid_float32(a * v)
