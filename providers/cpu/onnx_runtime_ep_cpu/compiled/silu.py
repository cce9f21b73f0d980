"""SiLU (Swish: x * sigmoid(alpha * x)) of a float32 tensor in one compiled pass.

EfficientNet applies it after most of its convolutions, on whole batch-sized maps: numpy's formula is four
passes over memory with a full-size temporary each, where this loop reads each element once and writes it
once. Its exp is exp_float32.sigmoid_float32's polynomial on 16-lane vectors (vector_math.sigmoid_lanes; numba's
own exp is libm's scalar one without Intel's SVML).
"""

from __future__ import annotations

import numpy as np

from . import jit
from .vector_math import sigmoid_lanes


@jit
def silu_float32(x, y, alpha):
    """y = x * sigmoid(alpha * x) elementwise over flat, contiguous float32 arrays (y may be x)."""
    sigmoid_lanes(x, y, np.float32(alpha), True)
