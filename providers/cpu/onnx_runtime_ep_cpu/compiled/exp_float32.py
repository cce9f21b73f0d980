"""exp(a) for a <= 0 and the logistic sigmoid in float32, in scalar operations LLVM vectorizes (numba would call libm's
scalar expf): the exponentials of transformer.py's softmax and Gelu, the gates' sigmoid, and the constants that
vector_math.py writes the same polynomial with on 16 lanes.
"""

from __future__ import annotations

import numpy as np

from . import compiler

# Loops that may fuse multiply-adds (one rounding instead of two): faster, no less accurate (measured in 9337d6b);
# the float32 Gelu, the sigmoid and the exp are compiled with it, so every loop that calls them computes the same.
contracting_jit = compiler(fastmath={"contract"})

# exp(a) in float32 for a <= 0, in operations LLVM vectorizes (numba would call libm's scalar expf):
# a = n ln2 + r with |r| <= ln2 / 2 (n rounded by adding 1.5 * 2^23; ln2 in two parts, Cody and Waite),
# exp(r) by a degree-6 polynomial (1 + r + r^2 (C2 + C3 r + ...): C2..C6 minimize its largest relative
# error on that interval, a linear program over a dense grid), times 2^n built from its exponent bits.
# Within 1.4 ulp of the exact exp; 0 below -87 (where 2^n would leave the normal floats).
LOG2E = np.float32(1.4426950408889634)
ROUNDER = np.float32(12582912.0)
LN2_HIGH, LN2_LOW = np.float32(0.693145751953125), np.float32(1.428606765330187e-06)
EXP_C2, EXP_C3, EXP_C4 = np.float32(0.5), np.float32(0.1666666716337204), np.float32(0.04166191443800926)
EXP_C5, EXP_C6 = np.float32(0.008356703445315361), np.float32(0.0014298856258392334)
EXP_FLOOR = np.float32(-87.0)


@contracting_jit
def exp_nonpositive_float32(a):
    """exp(a) for a float32 a <= 0 by the polynomial above (NaN stays NaN)."""
    clamped = EXP_FLOOR if a < EXP_FLOOR else a
    n = (clamped * LOG2E + ROUNDER) - ROUNDER
    r = (clamped - n * LN2_HIGH) - n * LN2_LOW
    p = ((((EXP_C6 * r + EXP_C5) * r + EXP_C4) * r + EXP_C3) * r + EXP_C2) * (r * r) + r + np.float32(1)
    scale = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    return np.float32(0) if a < EXP_FLOOR else p * scale


@contracting_jit
def sigmoid_float32(z):
    """1 / (1 + exp(-z)) for a float32 z, as e / (1 + e) with e = exp(-|z|) for z < 0: no overflow, and
    the small values of a negative z keep their relative accuracy (1 + tanh(z / 2) would cancel)."""
    e = exp_nonpositive_float32(-abs(z))
    return (np.float32(1) if z >= np.float32(0) else e) / (np.float32(1) + e)
