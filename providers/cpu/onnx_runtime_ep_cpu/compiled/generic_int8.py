"""numpy equivalents of the int8 loops a quantized model's first run needs (compiled/quantize.py, qgemm.py,
qgemm_tiles.py), which serve it while numba loads in the background (deferred.py, generic.py).

Integer results are exact and float32 results bit-identical to the loops': the same float32 operations in the
same order per element (numpy's float32 scalars and arrays round as LLVM's float32 does), and the integer
products as float64 matrix products, exact while every partial sum stays below 2**53 (8-bit codes: K below
2**37), wrapped to int32 as the loops' accumulators wrap. tests/cpu/kernels/test_int8_generic.py holds each
pair to that.
"""

from __future__ import annotations

import numpy as np

from .generic_rows import softmax_rows_float32_

_F32 = np.float32


def _per_channel(values: np.ndarray, dtype) -> np.ndarray:
    return values.astype(dtype).reshape(1, -1, 1)


def _codes(x, scale, zero, low, high):
    """QuantizeLinear's float32 code of each value: rint(x / scale) + zero, saturated; NaN stays NaN."""
    v = np.rint(x / scale) + zero
    return np.minimum(np.maximum(v, low), high)  # NaN propagates through both, as the loops leave it


def quantize(x, scale, zero, low, high, out):
    v = _codes(x, _per_channel(scale, _F32), _per_channel(zero, _F32), _F32(low), _F32(high))
    out[...] = np.where(np.isnan(v), _F32(0), v).astype(out.dtype)


def dequantize(q, scale, zero, out):
    out[...] = (q.astype(_F32) - _per_channel(zero, _F32)) * _per_channel(scale, _F32)


def fake_quantize(x, scale, zero, low, high, out):
    s, z = _per_channel(scale, _F32), _per_channel(zero, _F32)
    v = _codes(x, s, z, _F32(low), _F32(high))
    out[...] = np.where(np.isnan(v), (_F32(0) - z) * s, (v - z) * s)


def _rounded(v, scale, zero, low, high):
    """DequantizeLinear(QuantizeLinear(v)) in float32 (NaN: the zero point's value), as quantize.on_grid."""
    s, z = _F32(scale), _F32(zero)
    codes = _codes(v, s, z, _F32(low), _F32(high))
    return np.where(np.isnan(codes), (_F32(0) - z) * s, (codes - z) * s)


_BINARY = (np.add, np.subtract, np.multiply, np.divide)


def rounded_binary(a, b, op, scale, zero, low, high, out):
    n = out.shape[0]
    a = a if a.shape[0] in (1, n) else np.tile(a, n // a.shape[0])
    b = b if b.shape[0] in (1, n) else np.tile(b, n // b.shape[0])
    out[...] = _rounded(_BINARY[op](a, b), scale, zero, low, high)


def rounded_concat(a, b, scale, zero, low, high, out):
    out[...] = _rounded(np.concatenate([a, b], axis=1), scale, zero, low, high)


def _grid_index(x, scale, zero, low, high):
    """grid_lookup's table index of each value: its code less ``low``, NaN the zero point's."""
    s, z = _F32(scale), _F32(zero)
    v = _codes(x, s, z, _F32(low), _F32(high))
    return (np.where(np.isnan(v), z, v) - _F32(low)).astype(np.int64)


def grid_lookup(x, scale, zero, low, high, table, out):
    out[...] = table[_grid_index(x, scale, zero, low, high)]


def code_lookup_rows(table, codes, out, at):
    out[:, at:at + codes.shape[1]] = table[codes]


def channel_grid_lookup(x, scale, zero, low, high, table, out):
    out[...] = table[np.arange(x.shape[1])[None, :, None], _grid_index(x, scale, zero, low, high)]


def dynamic_parameters(x):
    """compiled/quantize.dynamic_parameters: the float32 (scale, zero point) of a flat float32 array."""
    low = _F32(np.fmin.reduce(x, initial=_F32(0)))  # fmin skips NaN, as the loop's comparisons do
    high = _F32(np.fmax.reduce(x, initial=_F32(0)))
    span = high - low if high > low else _F32(1)
    scale = span / _F32(255)
    zero = np.rint(_F32(0) - low / scale)
    return scale, _F32(min(max(zero, _F32(0)), _F32(255)))


def dynamic_quantize(x, out):
    scale, zero = dynamic_parameters(x)
    v = _codes(x, scale, zero, _F32(0), _F32(255))
    out[...] = np.where(np.isnan(v), 0, v).astype(out.dtype)
    return scale, zero


def pack_columns(b, zero, out):
    out[...] = b.T.astype(np.int16) - zero.astype(np.int16).reshape(-1, 1)


def pack_pairs(packed, out):
    columns, depth = packed.shape
    padded = np.zeros((2 * out.shape[0], out.shape[1]), np.int16)
    padded[:depth, :columns] = packed.T
    out[...] = padded.reshape(out.shape[0], 2, out.shape[1]).transpose(0, 2, 1)


_NO_PAIRS = np.zeros((0, 0, 2), np.int16)


def _product(centred: np.ndarray, packed: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """The int32 sums of centred (M, K) times packed (N, K) rows: exact in float64, wrapped as int32 adds wrap.
    Where qgemm_tiles.compact kept only the pairs, packed is an (N, 0) stub and the rows come from them."""
    depth = centred.shape[1]
    if packed.shape[1] != depth:
        packed = pairs.transpose(1, 0, 2).reshape(pairs.shape[1], -1)[:packed.shape[0], :depth]
    exact = centred.astype(np.float64) @ packed.T.astype(np.float64)
    return exact.astype(np.int64).astype(np.int32)


def _rescaled(acc, a_scale, b_scales, bias, out):
    y = (acc.astype(np.float64) * (np.float64(a_scale) * b_scales)).astype(_F32)
    out[...] = y + bias if bias.shape[0] > 0 else y


def product(a, zero, packed, pairs, out):
    zeros = zero.astype(np.int16).reshape(-1, 1) if zero.shape[0] > 1 else np.int16(zero[0])
    out[...] = _product(a.astype(np.int16) - zeros, packed, pairs)


def scaled_product(a, a_zero, packed, pairs, a_scale, b_scales, bias, out):
    _rescaled(_product(a.astype(np.int16) - np.int16(a_zero), packed, pairs), a_scale, b_scales, bias, out)


def dynamic_scaled_product(a, packed, pairs, b_scales, bias, out):
    scale, zero = dynamic_parameters(a.reshape(-1))
    v = _codes(a, scale, zero, _F32(0), _F32(255))
    centred = np.where(np.isnan(v), -zero, v - zero).astype(np.int16)
    _rescaled(_product(centred, packed, pairs), np.float64(scale), b_scales, bias, out)


def dynamic_scaled_group(a, packed, pairs, b_scales, bias, out):
    count, rows, width = out.shape
    joined = np.empty((rows, count * width), _F32)
    dynamic_scaled_product(a, packed, pairs, b_scales, bias, joined)
    out[...] = joined.reshape(rows, count, width).transpose(1, 0, 2)


# compiled/qgemm.py's ``consts`` layout (A's parameters, the output's, B's) and requantized_product_rounded's
# ``after``, repeated here so that this module imports no loop module.
A_SCALE, A_ZERO, A_LOW, A_HIGH, A_QUANTIZE, Y_ZERO, Y_LOW, Y_HIGH, Y_SCALE, DEQUANTIZE = range(10)
B_SCALE, B_ZERO, B_LOW, B_HIGH, B_QUANTIZE = range(10, 15)
AFTER_SCALE, AFTER_ZERO, AFTER_LOW, AFTER_HIGH, AFTER_ON = range(5)


def _centred_codes(x, scale, zero, low, high, quantize):
    """qgemm's centred int16 codes: 8-bit codes minus the zero point, or float32 data quantized first (NaN: code
    0)."""
    if not quantize:
        return x.astype(np.int16) - np.int16(zero)
    z = _F32(zero)
    v = _codes(x, _F32(scale), z, _F32(low), _F32(high))
    return (np.where(np.isnan(v), _F32(0), v) - z).astype(np.int16)


def _a_codes(a, consts):
    return _centred_codes(a, consts[A_SCALE], consts[A_ZERO], consts[A_LOW], consts[A_HIGH], consts[A_QUANTIZE] != 0)


def _requantized_codes(acc, multiplier, offset, consts):
    """requantize_affine's codes per column (or per tensor), in float64: saturated, NaN giving 0."""
    v = np.rint(acc.astype(np.float64) * multiplier + offset) + np.float64(consts[Y_ZERO])
    v = np.minimum(np.maximum(v, np.float64(consts[Y_LOW])), np.float64(consts[Y_HIGH]))
    return np.where(np.isnan(v), 0.0, v)


def _finish(acc, multiplier, offset, consts, out):
    """The codes, or with ``consts[DEQUANTIZE]`` their float32 values."""
    v = _requantized_codes(acc, multiplier, offset, consts)
    out[...] = (v - np.float64(consts[Y_ZERO])) * np.float64(consts[Y_SCALE]) if consts[DEQUANTIZE] != 0 else v


def requantized_product(a, packed, pairs, multiplier, offset, consts, out):
    _finish(_product(_a_codes(a, consts), packed, pairs), multiplier, offset, consts, out)


def requantized_group(a, packed, pairs, multiplier, offset, consts, members, out):
    acc = _product(_a_codes(a, consts), packed, pairs).astype(np.float64)
    rows = acc.shape[0]
    v = np.rint(acc * multiplier + offset)
    for first, width, zero, low, high, scale in members:
        first, width = int(first), int(width)
        codes = np.minimum(np.maximum(v[:, first:first + width] + zero, low), high)
        codes = np.where(np.isnan(codes), 0.0, codes)
        block = (codes - zero) * scale if consts[DEQUANTIZE] != 0 else codes
        out[rows * first:rows * (first + width)] = block.reshape(-1)


def requantized_group_rounded(a, packed, pairs, multiplier, offset, consts, members, row, afters, out):
    requantized_group(a, packed, pairs, multiplier, offset, consts, members, out)
    rows = a.shape[0]
    for (first, width, *_), after in zip(members, afters):
        if after[AFTER_ON] == 0:
            continue
        first, width = int(first), int(width)
        block = out[rows * first:rows * (first + width)].reshape(rows, width)
        s, z = _F32(after[AFTER_SCALE]), _F32(after[AFTER_ZERO])
        v = _codes(block + row[first:first + width], s, z, _F32(after[AFTER_LOW]), _F32(after[AFTER_HIGH]))
        block[...] = np.where(np.isnan(v), (_F32(0) - z) * s, (v - z) * s)


def requantized_product_rounded(a, packed, pairs, multiplier, offset, consts, row, after, out):
    requantized_product(a, packed, pairs, multiplier, offset, consts, out)
    s, z = _F32(after[AFTER_SCALE]), _F32(after[AFTER_ZERO])
    summed = out + row
    v = _codes(summed, s, z, _F32(after[AFTER_LOW]), _F32(after[AFTER_HIGH]))
    out[...] = np.where(np.isnan(v), (_F32(0) - z) * s, (v - z) * s)


def requantized_batched_product(a, b, multiplier, offset, consts, out):
    for i in range(a.shape[0]):
        packed = _centred_codes(b[i].T, consts[B_SCALE], consts[B_ZERO], consts[B_LOW], consts[B_HIGH],
                                consts[B_QUANTIZE] != 0)
        _finish(_product(_a_codes(a[i], consts), packed, _NO_PAIRS), multiplier, offset, consts, out[i])


def _operand(x, step, rows, cols):
    """requantize_binary's operand as (rows, cols) int32: element (r, c) is x[r * step[0] + c * step[1]]."""
    at = np.arange(rows)[:, None] * int(step[0]) + np.arange(cols)[None, :] * int(step[1])
    return x[at].astype(np.int32)


def requantize(acc, bias, multiplier, zero, low, high, out):
    v = np.rint((acc.astype(np.float64) + bias.reshape(1, -1, 1)) * multiplier.reshape(1, -1, 1)) + np.float64(zero)
    out[...] = np.minimum(np.maximum(v, np.float64(low)), np.float64(high))


def requantize_binary(a, a_step, b, b_step, zeros, scales, low, high, multiply, out):
    rows, cols = out.shape
    x = (_operand(a, a_step, rows, cols) - np.int32(zeros[0])).astype(np.float64)
    y = (_operand(b, b_step, rows, cols) - np.int32(zeros[1])).astype(np.float64)
    sa, sb, sc = scales[0], scales[1], scales[2]
    v = x * y * (sa * sb / sc) if multiply else (sa * x + sb * y) / sc
    v = np.rint(v) + np.float64(zeros[2])
    out[...] = np.minimum(np.maximum(v, np.float64(low)), np.float64(high))


def softmax_codes(x, table, y_scale, y_zero, low, high, out):
    e = table[x.astype(np.int64).max(axis=1, keepdims=True) - x.astype(np.int64)]
    total = np.cumsum(e, axis=1)[:, -1:]  # summed left to right, as the loop does
    p = (e / total).astype(_F32)
    out[...] = _codes(p, _F32(y_scale), _F32(y_zero), _F32(low), _F32(high))


def qgemm(a, a_zero, packed, pairs, c, multiplier, zero, low, high, quantized, out):
    acc = _product(a.astype(np.int16) - np.int16(a_zero), packed, pairs)
    if c.shape[0]:
        acc = (acc.astype(np.int64) + c.astype(np.int64)).astype(np.int32)  # wraps as the int32 sum does
    v = acc.astype(np.float64) * multiplier
    if quantized:
        v = np.rint(v) + np.float64(zero)
        v = np.where(np.isnan(v), 0.0, np.minimum(np.maximum(v, np.float64(low)), np.float64(high)))
    out[...] = v


X_ZERO, X_SCALE, BIAS_ZERO, BIAS_SCALE, C_ZERO, C_SCALE, C_LOW, C_HIGH = range(8)  # qgemm's ``add`` layout


def requantized_product_add(a, packed, pairs, multiplier, offset, consts, bias, add, out):
    codes = _requantized_codes(_product(_a_codes(a, consts), packed, pairs), multiplier, offset, consts)
    x = (codes.astype(np.int64) - np.int64(add[X_ZERO])).astype(np.float64)
    y = (bias.astype(np.int64) - np.int64(add[BIAS_ZERO])).astype(np.float64)
    v = np.rint((add[X_SCALE] * x + add[BIAS_SCALE] * y) / add[C_SCALE]) + add[C_ZERO]
    out[...] = np.minimum(np.maximum(v, add[C_LOW]), add[C_HIGH])


def rounded_gelu(x, params, out):
    """compiled/rounded_gelu.rounded_gelu with the erf series' tanh from numpy (the Erf kernel's), where the loop
    takes its own vectorizable tanh: within a few ulp, so a code may differ by one where a value lies that close
    to a half-integer of its grid (the loop's own bound against the separate nodes)."""
    d, one, h = params[0], params[1], params[2]
    coefficients, rounds = params[3:10], params[10:22].reshape(3, 4)
    with np.errstate(all="ignore"):
        t = x / d
        square = t * t
        series = np.full_like(t, coefficients[6])
        for c in coefficients[5::-1]:
            series = series * square + c
        e = _rounded(np.tanh(series * t), *rounds[0])
        u = _rounded(e + one, *rounds[1])
        out[...] = _rounded(x * u, *rounds[2]) * h


def rounded_rms_norm(x, weight, params, table, out):
    """compiled/rounded_norm.rounded_rms_norm: the mean as generic.plane_means takes it (numpy's sum, divided once)."""
    rounded_rms_rows(x, (x * x).sum(axis=1) / x.shape[1], weight, params, table, out)


def rounded_rms_rows(x, means, weight, params, table, out):
    """compiled/rounded_norm.rounded_rms_rows: the roundings and the table entry as the loop takes them."""
    m = _rounded(means, *params[0:4])
    s, z, low, high = _F32(params[4]), _F32(params[5]), _F32(params[6]), _F32(params[7])
    v = _codes(m, s, z, low, high)
    factor = table[(np.where(np.isnan(v), z, v) - low).astype(np.int64)]
    y = _rounded(x * factor[:, None], *params[8:12])
    out[...] = y * weight if weight.shape[0] == x.shape[1] else y


def rounded_rotary(x, cos, sin, table_row, half, params, rounded_sum, out):
    """compiled/rounded_rotary.rounded_rotary: each rounding and sum as the loop takes them."""
    c, s = cos[table_row], sin[table_row]
    turned = np.concatenate((_rounded(-x[:, half:], *params[4:8]), x[:, :half]), axis=1)
    y = _rounded(x * c, *params[0:4]) + _rounded(_rounded(turned, *params[8:12]) * s, *params[12:16])
    out[...] = _rounded(y, *params[16:20]) if rounded_sum else y


def rounded_attention(q, k, v, add0, add1, group, tables, steps, params, out):
    """compiled/rounded_attention.rounded_attention: the same codes, sums, steps and requantizations; the Softmax
    is generic.py's (numpy's exp: within float32 rounding of the loop's, so a probability on a rounding boundary
    may take the next code)."""
    def centred(x, at):
        s, z = _F32(params[at]), _F32(params[at + 1])
        c = _codes(x, s, z, _F32(params[at + 2]), _F32(params[at + 3]))
        return (np.where(np.isnan(c), _F32(0), c) - z).astype(np.int64)

    def finished(acc, at):
        z = params[at + 1]
        c = np.minimum(np.maximum(np.rint(acc.astype(np.float64) * params[at]) + z, params[at + 2]), params[at + 3])
        return ((c - z) * params[at + 4]).astype(_F32)

    keys = np.repeat(centred(k, 4), group, axis=1)  # (Q, K: compiled/rounded_attention.py's layout)
    values = np.repeat(centred(v, 12), group, axis=1)
    scores = finished(centred(q, 0) @ keys.swapaxes(2, 3), 16)
    addends = (add0, add1)
    for kind, index, s, z, low, high in steps:
        if kind == 0:
            c = _codes(scores, s, z, low, high)
            scores = tables[int(index)][(np.where(np.isnan(c), z, c) - low).astype(np.int64)]
        else:
            scores = _rounded(scores + addends[int(index)], s, z, low, high)
    weights = np.empty_like(scores)
    softmax_rows_float32_(scores.reshape(-1, scores.shape[-1]), weights.reshape(-1, scores.shape[-1]))
    out[...] = finished(centred(weights, 8) @ values, 21)


_COMPILED = "onnx_runtime_ep_cpu.compiled."
def quantized_conv(x, pad, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, packed, pairs, multiplier,
                   offset, consts, out):
    """compiled/dynamic_conv.quantized_conv: the padded input's patch rows (row (b, r, q), column (c, i, j))
    through requantized_product, written (N, M, OH * OW)."""
    batch, channels, height, width = x.shape
    padded = np.full((batch, channels, height + top + bottom, width + left + right), pad, x.dtype)
    padded[:, :, top:top + height, left:left + width] = x
    taps = [padded[:, :, i * dh:i * dh + (oh - 1) * sh + 1:sh, j * dw:j * dw + (ow - 1) * sw + 1:sw]
            for i in range(kh) for j in range(kw)]
    rows = np.stack(taps, axis=2).transpose(0, 3, 4, 1, 2).reshape(batch * oh * ow, channels * kh * kw)
    y = np.empty((batch * oh * ow, out.shape[1]), out.dtype)
    requantized_product(rows, packed, pairs, multiplier, offset, consts, y)
    out[...] = y.reshape(batch, oh * ow, -1).transpose(0, 2, 1)


GENERIC_INT8 = {
    _COMPILED + "rounded_gelu.rounded_gelu": rounded_gelu,
    _COMPILED + "rounded_norm.rounded_rms_norm": rounded_rms_norm,
    _COMPILED + "rounded_norm.rounded_rms_rows": rounded_rms_rows,
    _COMPILED + "rounded_rotary.rounded_rotary": rounded_rotary,
    _COMPILED + "rounded_attention.rounded_attention": rounded_attention,
    _COMPILED + "quantize.quantize": quantize,
    _COMPILED + "quantize.dequantize": dequantize,
    _COMPILED + "quantize.fake_quantize": fake_quantize,
    _COMPILED + "quantize.grid_lookup": grid_lookup,
    _COMPILED + "quantize.channel_grid_lookup": channel_grid_lookup,
    _COMPILED + "code_lookup.code_lookup_rows": code_lookup_rows,
    _COMPILED + "code_lookup.code_lookup_lanes": code_lookup_rows,
    _COMPILED + "quantize.rounded_binary": rounded_binary,
    _COMPILED + "quantize.rounded_concat": rounded_concat,
    _COMPILED + "quantize.dynamic_quantize": dynamic_quantize,
    _COMPILED + "qgemm.pack_columns": pack_columns,
    _COMPILED + "qgemm_tiles.pack_pairs": pack_pairs,
    _COMPILED + "qgemm.product": product,
    _COMPILED + "qgemm.scaled_product": scaled_product,
    _COMPILED + "qgemm.dynamic_scaled_product": dynamic_scaled_product,
    _COMPILED + "qgemm.dynamic_scaled_group": dynamic_scaled_group,
    _COMPILED + "qgemm.requantized_product": requantized_product,
    _COMPILED + "qgemm.requantized_product_rounded": requantized_product_rounded,
    _COMPILED + "qgemm.requantized_group": requantized_group,
    _COMPILED + "qgemm.requantized_group_rounded": requantized_group_rounded,
    _COMPILED + "qgemm.requantized_batched_product": requantized_batched_product,
    _COMPILED + "quantize.requantize": requantize,
    _COMPILED + "quantize.requantize_binary": requantize_binary,
    _COMPILED + "quantize.softmax_codes": softmax_codes,
    _COMPILED + "qgemm.qgemm": qgemm,
    _COMPILED + "qgemm.requantized_product_add": requantized_product_add,
    _COMPILED + "dynamic_conv.quantized_conv": quantized_conv,
}
