"""One-pass linear (de)quantization of float32 data to and from 8- and 16-bit integers: QuantizeLinear,
DequantizeLinear, DynamicQuantizeLinear and a QuantizeLinear -> DequantizeLinear pair, per tensor or per
channel.

numpy needs a pass per step (divide, round, add the zero point, clip, cast; widen, subtract, convert,
multiply), each over a temporary; these loops do each element once. Arrays are (outer, C, inner), contiguous,
with one float32 scale and one zero point per channel C (C = 1: per tensor). The arithmetic is
QuantizeLinear's for float32: the quotient x / scale in float32, rounded half to even, plus the zero point,
saturated to [low, high] (NaN gives 0, as numpy's clip-then-cast does); dequantizing converts the exact
difference q - zero point to float32 and multiplies by the scale once.
"""

from __future__ import annotations

import numpy as np

from . import jit


@jit
def quantize_row(x, s, z, lo, hi, out):
    """out = saturate(rint(x / s) + z) to [lo, hi] for one contiguous row (float32 arithmetic; NaN gives code 0),
    a row a call: LLVM vectorizes its loop."""
    for i in range(x.shape[0]):
        v = np.rint(x[i] / s) + z
        v = lo if v < lo else v
        v = hi if v > hi else v
        out[i] = np.int32(v) if v == v else 0


@jit
def quantize(x, scale, zero, low, high, out):
    """out = saturate(rint(x / scale) + zero) per channel; ``low``/``high`` the target type's range."""
    outer, channels, _ = x.shape
    lo, hi = np.float32(low), np.float32(high)
    # One contiguous row per call: LLVM vectorizes a 1-D loop, not the innermost index of a 3-D one.
    for o in range(outer):
        for c in range(channels):
            quantize_row(x[o, c], scale[c], np.float32(zero[c]), lo, hi, out[o, c])


@jit
def _dequantize_row(q, s, z, out):
    for i in range(q.shape[0]):
        # Codes and zero points of 8- and 16-bit types are exact in float32, and so is their difference;
        # converting each straight to float32 lets LLVM vectorize the loop.
        out[i] = (np.float32(q[i]) - z) * s


@jit
def dequantize(q, scale, zero, out):
    """out = float32(q - zero) * scale per channel."""
    outer, channels, _ = q.shape
    for o in range(outer):
        for c in range(channels):
            _dequantize_row(q[o, c], scale[c], np.float32(zero[c]), out[o, c])


@jit
def fake_quantize_row(x, s, z, lo, hi, out):
    """fake_quantize of one contiguous float32 row, with float32 s, z, lo and hi."""
    for i in range(x.shape[0]):
        v = np.rint(x[i] / s) + z
        v = lo if v < lo else v
        v = hi if v > hi else v
        out[i] = (v - z) * s if v == v else (np.float32(0) - z) * s


@jit
def fake_quantize(x, scale, zero, low, high, out):
    """DequantizeLinear(QuantizeLinear(x)) with one scale and zero point: the float32 value of each rounded,
    saturated code, without the integer tensor between."""
    outer, channels, _ = x.shape
    lo, hi = np.float32(low), np.float32(high)
    for o in range(outer):
        for c in range(channels):
            fake_quantize_row(x[o, c], scale[c], np.float32(zero[c]), lo, hi, out[o, c])


_LOOKUP_CHUNK = 4096  # values whose codes grid_lookup makes before it picks their entries


@jit
def grid_lookup(x, scale, zero, low, high, table, out):
    """out[i] = table[code(x[i]) - low] for flat float32 ``x`` on a per-tensor grid: the code as QuantizeLinear
    makes it (x / scale in float32, half to even, plus the zero point, saturated; NaN the zero point's code),
    which on a grid value (code - zero) * scale is that code again. A chunk's codes first, in a loop that
    vectorizes (rint as the sum and difference of 1.5 * 2^23, half to even below 2^22: the quotient is saturated
    first, one past the codes' range on each side), then the picks: one loop of both, with np.rint's call, ran a
    value at a time (2.1 against 0.65 ns a value)."""
    codes = np.empty(min(x.shape[0], _LOOKUP_CHUNK), np.int32)
    _lookup(x, np.float32(scale), np.float32(zero), np.float32(low), np.float32(high), table, out, codes)


@jit
def _lookup(x, s, z, lo, hi, table, out, codes):
    """grid_lookup's work with float32 parameters, its codes made in ``codes`` (at least a chunk, or all of x)."""
    rounder, below, above = np.float32(12582912.0), lo - z - np.float32(1), hi - z + np.float32(1)
    for first in range(0, x.shape[0], _LOOKUP_CHUNK):
        part, target = x[first:first + _LOOKUP_CHUNK], out[first:first + _LOOKUP_CHUNK]  # (views: plain indices)
        count = part.shape[0]
        for i in range(count):  # (inline: called from here, the loop ran 1.7x slower)
            q = part[i] / s
            q = below if q < below else q
            q = above if q > above else q
            v = ((q + rounder) - rounder) + z
            v = lo if v < lo else v
            v = hi if v > hi else v
            v = z if v != v else v  # NaN: the zero point's code
            codes[i] = np.int32(v - lo)
        for i in range(count):
            target[i] = table[codes[i]]


@jit
def channel_grid_lookup(x, scale, zero, low, high, table, out):
    """grid_lookup with a table per channel: out[n, c] = grid_lookup of plane x[n, c] in table[c], for float32 ``x``
    (N, C, pixels) on a per-tensor grid and ``table`` (C, codes). One buffer of codes for every plane: a 7 x 7
    plane's work is ~25 ns, less than allocating a buffer cost (1024 such planes 99 -> 54 us)."""
    codes = np.empty(min(x.shape[2], _LOOKUP_CHUNK), np.int32)
    s, z, lo, hi = np.float32(scale), np.float32(zero), np.float32(low), np.float32(high)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            _lookup(x[n, c], s, z, lo, hi, table[c], out[n, c], codes)


@jit
def value_range(x):
    """(min, max) of a flat float32 array, each widened to include 0 (DynamicQuantizeLinear's range).
    NaN is skipped, as the comparisons are false for it. Eight running pairs, one per element mod 8, then theirs:
    one pair's chain of dependent compares ran a scalar loop. A value replaces a bound only when strictly beyond
    it, so the result is the same whatever the order (starting at +0.0, a -0.0 never replaces it)."""
    zero = np.float32(0)
    l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = zero
    h0 = h1 = h2 = h3 = h4 = h5 = h6 = h7 = zero
    n = x.shape[0]
    full = n - n % 8
    for i in range(0, full, 8):
        v0, v1, v2, v3, v4, v5, v6, v7 = x[i], x[i + 1], x[i + 2], x[i + 3], x[i + 4], x[i + 5], x[i + 6], x[i + 7]
        l0, h0 = (v0 if v0 < l0 else l0), (v0 if v0 > h0 else h0)
        l1, h1 = (v1 if v1 < l1 else l1), (v1 if v1 > h1 else h1)
        l2, h2 = (v2 if v2 < l2 else l2), (v2 if v2 > h2 else h2)
        l3, h3 = (v3 if v3 < l3 else l3), (v3 if v3 > h3 else h3)
        l4, h4 = (v4 if v4 < l4 else l4), (v4 if v4 > h4 else h4)
        l5, h5 = (v5 if v5 < l5 else l5), (v5 if v5 > h5 else h5)
        l6, h6 = (v6 if v6 < l6 else l6), (v6 if v6 > h6 else h6)
        l7, h7 = (v7 if v7 < l7 else l7), (v7 if v7 > h7 else h7)
    low, high = zero, zero
    for v in (l0, l1, l2, l3, l4, l5, l6, l7):
        low = v if v < low else low
    for v in (h0, h1, h2, h3, h4, h5, h6, h7):
        high = v if v > high else high
    for i in range(full, n):
        v = x[i]
        low = v if v < low else low
        high = v if v > high else high
    return low, high


@jit
def dynamic_parameters(x):
    """DynamicQuantizeLinear's (scale, zero point) of a flat float32 array, both float32: its range
    [min(x, 0), max(x, 0)] (NaN skipped) mapped onto [0, 255], a unit range when all are zero."""
    low, high = value_range(x)
    return range_parameters(low, high)


@jit
def range_parameters(low, high):
    """dynamic_parameters of the range [low, high] (float32, value_range's: 0 within it)."""
    span = high - low if high > low else np.float32(1)
    scale = span / np.float32(255)
    zero = np.rint(np.float32(0) - low / scale)
    zero = np.float32(0) if zero < 0 else zero
    zero = np.float32(255) if zero > 255 else zero
    return scale, zero


@jit
def dynamic_quantize(x, out):
    """DynamicQuantizeLinear of a flat float32 array into ``out`` (uint8): returns (scale, zero point).

    The range is [min(x, 0), max(x, 0)] (NaN skipped), mapped onto [0, 255]; all zeros take scale 1. Scale
    and zero point are computed in float32 as numpy computes them from float32 scalars."""
    scale, zero = dynamic_parameters(x)
    for i in range(x.shape[0]):
        v = np.rint(x[i] / scale) + zero
        v = np.float32(0) if v < 0 else v
        v = np.float32(255) if v > 255 else v
        out[i] = np.int32(v) if v == v else 0
    return scale, zero


_SHORT_ROW = 16  # requantize_binary's rows shorter than this: element by element


@jit
def _operand_row(x, step, row, cols, buffer):
    """Row ``row`` of a requantize_binary operand as a contiguous 1-D array: a view of the data, or ``buffer``
    filled with the operand's one value for the row."""
    if step[1] == 1:
        start = row * step[0]
        return x[start:start + cols]
    buffer[:] = x[row * step[0]]
    return buffer


@jit
def _binary_row(x, y, za, zb, sa, sb, sc, factor, zc, lo, hi, multiply, out):
    """One contiguous row of requantize_binary: two loops without branches on the operation, so that LLVM
    vectorizes them (the zero points come off in int32, exact for 8-bit codes, and convert to float64)."""
    if multiply:
        for c in range(out.shape[0]):
            v = np.float64(np.int32(x[c]) - za) * np.float64(np.int32(y[c]) - zb) * factor
            v = np.rint(v) + zc
            v = lo if v < lo else v
            v = hi if v > hi else v
            out[c] = np.int32(v)
    else:
        for c in range(out.shape[0]):
            v = (sa * np.float64(np.int32(x[c]) - za) + sb * np.float64(np.int32(y[c]) - zb)) / sc
            v = np.rint(v) + zc
            v = lo if v < lo else v
            v = hi if v > hi else v
            out[c] = np.int32(v)


@jit
def requantize_binary(a, a_step, b, b_step, zeros, scales, low, high, multiply, out):
    """QLinearAdd (``multiply`` False) or QLinearMul of flat 8-bit operands into ``out`` viewed as (R, C):
    element (r, c) of an operand is ``x[r * step[0] + c * step[1]]`` (steps (C, 1): the full tensor; (0, 1):
    one row repeated; (1, 0): one value per row; (0, 0): a scalar). ``zeros``: int64 (a, b, c); ``scales``:
    float64 (a, b, c).

    The arithmetic is the numpy kernel's, in float64: ``(sa * (a - za) + sb * (b - zb)) / sc`` or
    ``(a - za) * (b - zb) * (sa * sb / sc)``, rounded half to even, plus zc, saturated."""
    rows, cols = out.shape
    za, zb, zc = np.int32(zeros[0]), np.int32(zeros[1]), np.float64(zeros[2])
    sa, sb, sc = scales[0], scales[1], scales[2]
    factor = sa * sb / sc
    lo, hi = np.float64(low), np.float64(high)
    if cols < _SHORT_ROW:  # a row costs a view or a fill: short rows (one value per row) go element by element
        for r in range(rows):
            a_row, b_row = r * a_step[0], r * b_step[0]
            for c in range(cols):
                x = np.float64(np.int32(a[a_row + c * a_step[1]]) - za)
                y = np.float64(np.int32(b[b_row + c * b_step[1]]) - zb)
                v = x * y * factor if multiply else (sa * x + sb * y) / sc
                v = np.rint(v) + zc
                v = lo if v < lo else v
                v = hi if v > hi else v
                out[r, c] = np.int32(v)
        return
    a_buffer = np.empty(cols if a_step[1] == 0 else 0, a.dtype)
    b_buffer = np.empty(cols if b_step[1] == 0 else 0, b.dtype)
    for r in range(rows):
        _binary_row(_operand_row(a, a_step, r, cols, a_buffer), _operand_row(b, b_step, r, cols, b_buffer), za, zb,
                    sa, sb, sc, factor, zc, lo, hi, multiply, out[r])


@jit
def requantize(acc, bias, multiplier, zero, low, high, out):
    """out = saturate(rint((acc + bias[c]) * multiplier[c]) + zero) for an (outer, C, inner) accumulator
    (integers held as int32, float32 or float64), in float64: an integer product's requantization, the
    bias and multiplier per channel C (length 1: per tensor)."""
    outer, channels, inner = acc.shape
    one_bias = bias.shape[0] == 1
    one_multiplier = multiplier.shape[0] == 1
    lo, hi, z = np.float64(low), np.float64(high), np.float64(zero)
    for o in range(outer):
        for c in range(channels):
            b = bias[0] if one_bias else bias[c]
            m = multiplier[0] if one_multiplier else multiplier[c]
            for i in range(inner):
                v = np.rint((np.float64(acc[o, c, i]) + b) * m) + z
                v = lo if v < lo else v
                v = hi if v > hi else v
                out[o, c, i] = np.int64(v)


@jit
def quantize_centred(x, scale, zero, low, high, out):
    """out = QuantizeLinear(x) - zero for flat float32 ``x`` into a float ``out``: the exact integer a
    DequantizeLinear would multiply by the scale (NaN gives code 0)."""
    s, z, lo, hi = np.float32(scale), np.float32(zero), np.float32(low), np.float32(high)
    for i in range(x.shape[0]):
        v = np.rint(x[i] / s) + z
        v = lo if v < lo else v
        v = hi if v > hi else v
        out[i] = v - z if v == v else -z


@jit
def requantized_code(value, multiplier, offset, zero, low, high):
    """The code rint(value * multiplier + offset) + zero saturated to [low, high], in float64 (NaN, from a NaN
    offset, takes code 0 as QuantizeLinear's)."""
    v = np.rint(value * multiplier + offset) + zero
    v = low if v < low else v
    v = high if v > high else v
    return v if v == v else 0.0


@jit
def requantize_affine(acc, multiplier, offset, zero, low, high, scale, dequantize, out):
    """A QDQ group's output from its exact accumulator, (outer, C, inner) (integers held as int32, float32 or
    float64): code = saturate(rint(acc * multiplier[c] + offset[c]) + zero) in float64, per channel C; with
    ``dequantize`` the code's float32 value (code - zero) * scale, as DequantizeLinear gives it (an 8-bit
    difference times a float32 scale is exact in float64, so it rounds once, to the float32 product)."""
    outer, channels, inner = acc.shape
    lo, hi, z, s = np.float64(low), np.float64(high), np.float64(zero), np.float64(scale)
    for o in range(outer):
        if inner == 1:  # one value per channel (a matrix product's columns): the channels are the loop
            for c in range(channels):
                v = requantized_code(np.float64(acc[o, c, 0]), multiplier[c], offset[c], z, lo, hi)
                out[o, c, 0] = (v - z) * s if dequantize else v
            continue
        for c in range(channels):
            m, b = multiplier[c], offset[c]
            for i in range(inner):
                v = requantized_code(np.float64(acc[o, c, i]), m, b, z, lo, hi)
                out[o, c, i] = (v - z) * s if dequantize else v


@jit
def softmax_codes(x, table, y_scale, y_zero, low, high, out):
    """QLinearSoftmax of (R, C) 8-bit rows ``x``: e = table[max(row) - x] (table[d] = exp(-d * x_scale), float64),
    p = e / sum(e) rounded to float32, then QuantizeLinear with y_scale and y_zero (float32 division, half to
    even, saturated to [low, high])."""
    rows, cols = x.shape
    e = np.empty(cols)
    s, z, lo, hi = np.float32(y_scale), np.float32(y_zero), np.float32(low), np.float32(high)
    for r in range(rows):
        top = np.int64(x[r, 0])
        for c in range(cols):
            top = max(top, np.int64(x[r, c]))
        total = 0.0
        for c in range(cols):
            v = table[top - np.int64(x[r, c])]
            e[c] = v
            total += v
        for c in range(cols):
            v = np.rint(np.float32(e[c] / total) / s) + z
            v = lo if v < lo else v
            out[r, c] = hi if v > hi else v


@jit
def on_grid(v, s, z, lo, hi):
    """fake_quantize_row's value for one float32 ``v``: DequantizeLinear(QuantizeLinear(v)), NaN to the zero
    point's value."""
    q = np.rint(v / s) + z
    q = lo if q < lo else q
    q = hi if q > hi else q
    return (q - z) * s if q == q else (np.float32(0) - z) * s


@jit
def _binary_rows(op, a, b, s, z, lo, hi, out):
    """out[r, j] = rounded(a[r, j] op b[r, j]) over 2-D arrays of which ``a`` or ``b`` may have one row
    (repeated). Rounded as each value is made: a second pass over ``out`` in place would be one whose
    input and output LLVM cannot tell apart, and not vectorized."""
    ra, rb = a.shape[0] - 1, b.shape[0] - 1
    for r in range(out.shape[0]):
        x, y, o = a[min(r, ra)], b[min(r, rb)], out[r]
        # one loop per operator: LLVM vectorizes each
        if op == 0:
            for j in range(o.shape[0]):
                o[j] = on_grid(x[j] + y[j], s, z, lo, hi)
        elif op == 1:
            for j in range(o.shape[0]):
                o[j] = on_grid(x[j] - y[j], s, z, lo, hi)
        elif op == 2:
            for j in range(o.shape[0]):
                o[j] = on_grid(x[j] * y[j], s, z, lo, hi)
        else:
            for j in range(o.shape[0]):
                o[j] = on_grid(x[j] / y[j], s, z, lo, hi)


@jit
def rounded_binary(a, b, op, scale, zero, low, high, out):
    """A float32 Add/Sub/Mul/Div (``op`` 0-3) whose result is rounded to a per-tensor grid, as the operator then
    QuantizeDequantize give it (qdq_epilogues.py). Flat arrays: ``out`` has the size of the larger operand; the
    smaller one repeats over it (its shape is the larger's trailing dimensions, or one value)."""
    s, z, lo, hi = np.float32(scale), np.float32(zero), np.float32(low), np.float32(high)
    n, na, nb = out.shape[0], a.shape[0], b.shape[0]
    if na == 1 and nb > 1:  # one value: a row of it as wide as the output
        row = np.full(nb, a[0], np.float32)
        _binary_rows(op, row.reshape((1, nb)), b.reshape((1, nb)), s, z, lo, hi, out.reshape((1, n)))
    elif nb == 1 and na > 1:
        row = np.full(na, b[0], np.float32)
        _binary_rows(op, a.reshape((1, na)), row.reshape((1, na)), s, z, lo, hi, out.reshape((1, n)))
    else:
        width = min(na, nb)
        _binary_rows(op, a.reshape((na // width, width)), b.reshape((nb // width, width)), s, z, lo, hi,
                     out.reshape((n // width, width)))


@jit
def rounded_concat(a, b, scale, zero, low, high, out):
    """Concat of two float32 blocks per outer index, (outer, A) and (outer, B) into (outer, A + B), each value
    rounded to a per-tensor grid on the way (qdq_epilogues.py)."""
    s, z, lo, hi = np.float32(scale), np.float32(zero), np.float32(low), np.float32(high)
    width = a.shape[1]
    for o in range(out.shape[0]):
        fake_quantize_row(a[o], s, z, lo, hi, out[o, :width])
        fake_quantize_row(b[o], s, z, lo, hi, out[o, width:])


@jit
def dequantized_sum(a, b, params, relu, signed, out):
    """out = QuantizeLinear([Relu](DequantizeLinear(a) + DequantizeLinear(b))) over flat codes' bytes (uint8 arrays;
    int8 codes viewed as bytes where ``signed``), in the nodes' float32 operations (ops/qdq_add.py):
    (a - a_zero) * a_scale + (b - b_zero) * b_scale, max with 0 (NaN passes), then quantize_row's rounding and
    saturation to [low, high], stored as the code's byte. ``params`` float32: a_scale, a_zero, b_scale, b_zero,
    y_scale, y_zero, low, high."""
    if signed:
        _dequantized_sum(a.view(np.int8), b.view(np.int8), params, relu, out)
    else:
        _dequantized_sum(a, b, params, relu, out)


@jit
def _dequantized_sum(a, b, params, relu, out):
    a_scale, a_zero, b_scale, b_zero = params[0], params[1], params[2], params[3]
    y_scale, y_zero, low, high = params[4], params[5], params[6], params[7]
    for i in range(a.shape[0]):
        v = (np.float32(a[i]) - a_zero) * a_scale + (np.float32(b[i]) - b_zero) * b_scale
        if relu:
            v = np.float32(0) if v < 0 else v
        v = np.rint(v / y_scale) + y_zero
        v = low if v < low else v
        v = high if v > high else v
        out[i] = (np.int32(v) if v == v else 0) & 255
