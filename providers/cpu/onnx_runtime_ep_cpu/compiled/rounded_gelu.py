"""The erf form of GELU as a QDQ model writes it, with its activations rounded to their quantization grids
between the operators (qdq_fusions.fuse_rounded_gelu): Div(x, d) -> Erf -> Q/DQ -> Add(one) -> Q/DQ ->
Mul(x) -> Q/DQ -> Mul(h), in one pass over x.

Each step is the float32 operation its node performs, in the same order; each rounding is QuantizeLinear ->
DequantizeLinear's (quantize.fake_quantize_row: float32 division, half to even, saturation, then the code's
float32 value). Erf is the Erf kernel's series (algorithms/erf.py: tanh(t * P(t^2)), float32 coefficients,
Horner's order) with tanh taken from exp_nonpositive_float32 so that the loop vectorizes; that tanh is within
a few ulp of numpy's, so a rounded code can differ by one from the separate nodes' only where the value lies
that close to a half-integer of its grid.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .exp_float32 import exp_nonpositive_float32
from .quantize import on_grid

# The layout of ``params`` (float32): the Div's divisor, the Add's and last Mul's constants, the erf series'
# seven coefficients lowest first, then per rounding (after Erf, after the Add, after the product) its
# scale, zero point and code range.
DIVISOR, ONE, HALF = range(3)
SERIES = 3
ROUNDINGS = SERIES + 7
PARAMS = ROUNDINGS + 3 * 4


@jit
def _erf(t, c0, c1, c2, c3, c4, c5, c6):
    """erf(t) as tanh(s), s = t * P(t^2) in the Erf kernel's order; tanh(|s|) = (1 - e) / (1 + e) with
    e = exp(-2 |s|), which does not overflow."""
    q = t * t
    s = ((((((q * c6 + c5) * q + c4) * q + c3) * q + c2) * q + c1) * q + c0) * t
    e = exp_nonpositive_float32(np.float32(-2) * abs(s))
    th = (np.float32(1) - e) / (np.float32(1) + e)
    return -th if s < np.float32(0) else th


@jit
def rounded_gelu(x, params, out):
    """out = Mul(round3(x * round2(round1(erf(x / d)) + one)), h) over flat float32 ``x``; ``params`` as laid
    out above. NaN propagates as the nodes propagate it (a NaN rounds to the zero point's value)."""
    d, one, h = params[DIVISOR], params[ONE], params[HALF]
    c0, c1, c2, c3 = params[SERIES], params[SERIES + 1], params[SERIES + 2], params[SERIES + 3]
    c4, c5, c6 = params[SERIES + 4], params[SERIES + 5], params[SERIES + 6]
    r = ROUNDINGS
    s1, z1, lo1, hi1 = params[r], params[r + 1], params[r + 2], params[r + 3]
    s2, z2, lo2, hi2 = params[r + 4], params[r + 5], params[r + 6], params[r + 7]
    s3, z3, lo3, hi3 = params[r + 8], params[r + 9], params[r + 10], params[r + 11]
    for i in range(x.shape[0]):
        v = x[i]
        e = on_grid(_erf(v / d, c0, c1, c2, c3, c4, c5, c6), s1, z1, lo1, hi1)
        u = on_grid(e + one, s2, z2, lo2, hi2)
        out[i] = on_grid(v * u, s3, z3, lo3, hi3) * h
