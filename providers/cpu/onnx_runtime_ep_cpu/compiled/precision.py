"""Rounding float32 values to half precision and back: what a Cast to float16 (or bfloat16) then back to
float32 computes, in passes the compiler vectorizes (numpy converts to float16 element by element).

Round to nearest, ties to even, on the float32 bit pattern (as int32: the signed compares and shifts
vectorize where unsigned ones did not): add half a unit of the kept last place (less one, plus the kept last
bit) and clear the dropped bits. Magnitudes from 65520 on (halfway past float16's largest finite value,
65504, ties going to the even, infinite side) become infinite; infinities and NaN pass. float16's subnormals
(below 2**-14) are the multiples of 2**-24: a second pass rounds those magnitudes by adding and subtracting
0.5, whose float32 sum keeps exactly that quantum and rounds to nearest even.
"""

from __future__ import annotations

import numpy as np

from . import jit

_ABS = np.int32(0x7FFFFFFF)
_INF = np.int32(0x7F800000)
_HALF_OVERFLOW = np.int32(0x477FF000)  # 65520.0
_HALF_KEPT = np.int32(-0x2000)  # 0xFFFFE000: sign, exponent and float16's 10 mantissa bits
_BFLOAT_KEPT = np.int32(-0x10000)  # 0xFFFF0000
_HALF_NORMAL = np.float32(2.0 ** -14)
_ALIGN = np.float32(0.5)


@jit
def round_to_float16_normal(src_bits, dst_bits):
    """dst = float32(float16(src)) on the int32 views of flat float32 arrays, except below 2**-14."""
    for i in range(src_bits.shape[0]):
        bits = src_bits[i]
        magnitude = bits & _ABS
        out = (bits + np.int32(0x0FFF) + ((bits >> np.int32(13)) & np.int32(1))) & _HALF_KEPT
        out = ((bits ^ magnitude) | _INF) if magnitude >= _HALF_OVERFLOW else out
        dst_bits[i] = bits if magnitude >= _INF else out


@jit
def round_to_float16_subnormal(src, dst):
    """dst = float32(float16(src)) where |src| < 2**-14 (float16's subnormals), dst unchanged elsewhere."""
    for i in range(src.shape[0]):
        value = src[i]
        magnitude = abs(value)
        rounded = (magnitude + _ALIGN) - _ALIGN
        dst[i] = np.copysign(rounded, value) if magnitude < _HALF_NORMAL else dst[i]


@jit
def round_to_bfloat16(src_bits, dst_bits):
    """dst = float32(bfloat16(src)) on the int32 views of flat float32 arrays (bfloat16 keeps float32's
    exponent range: the largest finite values carry into infinity by themselves)."""
    for i in range(src_bits.shape[0]):
        bits = src_bits[i]
        out = (bits + np.int32(0x7FFF) + ((bits >> np.int32(16)) & np.int32(1))) & _BFLOAT_KEPT
        dst_bits[i] = bits if bits & _ABS > _INF else out
