"""Conversions between float32 and the half-precision types in passes the compiler vectorizes (numpy converts
float16 and bfloat16 element by element in software, 1-5 ns an element): float32 values rounded to half
precision and kept in float32 (a Cast to float16 or bfloat16 and back), half-precision values widened to
float32, and float32 values narrowed to half precision. Half-precision arrays come as their 16-bit patterns
(an int16 view: numba has no float16 arrays); everything is computed on the int32 view of the float32 values,
whose signed compares and shifts vectorize where unsigned ones did not. Results are numpy's (ml_dtypes') bit
for bit, NaN payloads aside (a NaN stays a NaN).

Rounding is to nearest, ties to even: add half a unit of the kept last place (less one, plus the kept last
bit) and drop the rest. Magnitudes from 65520 on (halfway past float16's largest finite value, 65504, ties
going to the even, infinite side) become infinite. float16's subnormals (below 2**-14) are the multiples of
2**-24: those magnitudes are rounded by adding and subtracting 0.5, whose float32 sum keeps exactly that
quantum and rounds to nearest even.
"""

from __future__ import annotations

import numpy as np

from . import jit

_ABS = np.int32(0x7FFFFFFF)
_INF = np.int32(0x7F800000)
_HALF_OVERFLOW = np.int32(0x477FF000)  # 65520.0
_HALF_SMALLEST_NORMAL = np.int32(0x38800000)  # 2**-14
_HALF_KEPT = np.int32(-0x2000)  # 0xFFFFE000: sign, exponent and float16's 10 mantissa bits
_BFLOAT_KEPT = np.int32(-0x10000)  # 0xFFFF0000
_REBIAS = np.int32(0x38000000)  # (127 - 15) << 23: float16's exponent bias to float32's
_HALF_NORMAL = np.float32(2.0 ** -14)
_HALF_QUANTUM = np.float32(2.0 ** -24)
_HALF_QUANTA = np.float32(2.0 ** 24)
_ALIGN = np.float32(0.5)


@jit
def round_to_float16(src, dst):
    """dst = float32(float16(src)) on flat float32 arrays: the rounding of the bits, then float16's
    subnormals (two passes: each vectorizes, one mixing the int and float views would not)."""
    src_bits, dst_bits = src.view(np.int32), dst.view(np.int32)
    for i in range(src_bits.shape[0]):
        bits = src_bits[i]
        magnitude = bits & _ABS
        out = (bits + np.int32(0x0FFF) + ((bits >> np.int32(13)) & np.int32(1))) & _HALF_KEPT
        out = ((bits ^ magnitude) | _INF) if magnitude >= _HALF_OVERFLOW else out
        dst_bits[i] = bits if magnitude >= _INF else out
    for i in range(src.shape[0]):
        value = src[i]
        magnitude = abs(value)
        rounded = (magnitude + _ALIGN) - _ALIGN
        dst[i] = np.copysign(rounded, value) if magnitude < _HALF_NORMAL else dst[i]


_HALF_NORMAL_BITS = np.int32(0x38800000)  # 2**-14, float16's smallest normal magnitude


@jit
def round_rows_to_float16(values, blocks, stride, length):
    """values = float32(float16(values)) in place on the first ``length`` elements of each of ``blocks`` runs
    ``stride`` apart in the flat float32 ``values`` (a bound KV cache's valid rows). The first pass rounds the
    normal magnitudes' bits and leaves float16's subnormals as they were, so that the second rounds those from
    their own values (round_to_float16's passes read a source the first one did not write)."""
    all_bits = values.view(np.int32)
    for block in range(blocks):
        start = block * stride
        bits_of = all_bits[start:start + length]
        for i in range(length):
            bits = bits_of[i]
            magnitude = bits & _ABS
            out = (bits + np.int32(0x0FFF) + ((bits >> np.int32(13)) & np.int32(1))) & _HALF_KEPT
            out = ((bits ^ magnitude) | _INF) if magnitude >= _HALF_OVERFLOW else out
            bits_of[i] = bits if magnitude >= _INF or magnitude < _HALF_NORMAL_BITS else out
        part = values[start:start + length]
        for i in range(length):
            value = part[i]
            magnitude = abs(value)
            rounded = (magnitude + _ALIGN) - _ALIGN
            part[i] = np.copysign(rounded, value) if magnitude < _HALF_NORMAL else value


@jit
def round_to_bfloat16(src, dst):
    """dst = float32(bfloat16(src)) on flat float32 arrays (bfloat16 keeps float32's exponent range: the
    largest finite values carry into infinity by themselves)."""
    src_bits, dst_bits = src.view(np.int32), dst.view(np.int32)
    for i in range(src_bits.shape[0]):
        bits = src_bits[i]
        out = (bits + np.int32(0x7FFF) + ((bits >> np.int32(16)) & np.int32(1))) & _BFLOAT_KEPT
        dst_bits[i] = bits if bits & _ABS > _INF else out


@jit
def float16_to_float32(src, dst):
    """dst = float32(src) for the float16 bit patterns ``src`` (int16) into the flat float32 ``dst``: the
    exponent rebiased (infinities and NaN keep theirs), then the subnormals as their multiples of 2**-24."""
    dst_bits = dst.view(np.int32)
    for i in range(src.shape[0]):
        half = np.int32(src[i]) & np.int32(0xFFFF)
        sign = (half & np.int32(0x8000)) << np.int32(16)
        rest = half & np.int32(0x7FFF)
        special = sign | _INF | ((rest & np.int32(0x3FF)) << np.int32(13))
        dst_bits[i] = special if rest >= np.int32(0x7C00) else sign | ((rest << np.int32(13)) + _REBIAS)
    for i in range(src.shape[0]):
        half = np.int32(src[i]) & np.int32(0xFFFF)
        rest = half & np.int32(0x7FFF)
        small = np.float32(rest) * _HALF_QUANTUM
        small = -small if half & np.int32(0x8000) else small
        dst[i] = small if rest < np.int32(0x400) else dst[i]


@jit
def float32_to_float16(src, dst):
    """dst = the float16 bit patterns (int16) of the flat float32 ``src``, rounded to nearest even; a NaN's
    kept payload bits as numpy keeps them (a NaN whose kept bits are zero stays a NaN)."""
    src_bits = src.view(np.int32)
    for i in range(src_bits.shape[0]):
        bits = src_bits[i]
        sign = (bits >> np.int32(16)) & np.int32(0x8000)
        magnitude = bits & _ABS
        out = ((magnitude + np.int32(0x0FFF) + ((magnitude >> np.int32(13)) & np.int32(1))) >> np.int32(13)) \
            - np.int32(0x1C000)
        out = np.int32(0x7C00) if magnitude >= _HALF_OVERFLOW else out
        payload = np.int32(0x7C00) + ((magnitude & np.int32(0x7FFFFF)) >> np.int32(13))
        payload = np.int32(0x7C01) if payload == np.int32(0x7C00) else payload
        out = payload if magnitude > _INF else out
        quanta = np.int32(((abs(src[i]) + _ALIGN) - _ALIGN) * _HALF_QUANTA)
        out = quanta if magnitude < _HALF_SMALLEST_NORMAL else out
        dst[i] = np.int16(sign | out)


@jit
def bfloat16_to_float32(src, dst):
    """dst = float32(src) for the bfloat16 bit patterns ``src`` (int16) into the flat float32 ``dst``."""
    dst_bits = dst.view(np.int32)
    for i in range(src.shape[0]):
        dst_bits[i] = np.int32(src[i]) << np.int32(16)


@jit
def float32_to_bfloat16(src, dst):
    """dst = the bfloat16 bit patterns (int16) of the flat float32 ``src``, rounded to nearest even; NaN quiet."""
    src_bits = src.view(np.int32)
    for i in range(src_bits.shape[0]):
        bits = src_bits[i]
        out = (bits + np.int32(0x7FFF) + ((bits >> np.int32(16)) & np.int32(1))) >> np.int32(16)
        nan = (bits >> np.int32(16)) | np.int32(0x40)
        dst[i] = np.int16(nan if bits & _ABS > _INF else out)
