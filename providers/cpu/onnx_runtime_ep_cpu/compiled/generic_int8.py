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


def _product(centred: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """The int32 sums of centred (M, K) times packed (N, K) rows: exact in float64, wrapped as int32 adds wrap."""
    exact = centred.astype(np.float64) @ packed.T.astype(np.float64)
    return exact.astype(np.int64).astype(np.int32)


def _rescaled(acc, a_scale, b_scales, bias, out):
    y = (acc.astype(np.float64) * (np.float64(a_scale) * b_scales)).astype(_F32)
    out[...] = y + bias if bias.shape[0] > 0 else y


def product(a, zero, packed, pairs, out):
    zeros = zero.astype(np.int16).reshape(-1, 1) if zero.shape[0] > 1 else np.int16(zero[0])
    out[...] = _product(a.astype(np.int16) - zeros, packed)


def scaled_product(a, a_zero, packed, pairs, a_scale, b_scales, bias, out):
    _rescaled(_product(a.astype(np.int16) - np.int16(a_zero), packed), a_scale, b_scales, bias, out)


def dynamic_scaled_product(a, packed, pairs, b_scales, bias, out):
    scale, zero = dynamic_parameters(a.reshape(-1))
    v = _codes(a, scale, zero, _F32(0), _F32(255))
    centred = np.where(np.isnan(v), -zero, v - zero).astype(np.int16)
    _rescaled(_product(centred, packed), np.float64(scale), b_scales, bias, out)


# compiled/qgemm.py's ``consts`` layout (A's parameters, the output's, B's) and requantized_product_rounded's
# ``after``, repeated here so that this module imports no loop module.
A_SCALE, A_ZERO, A_LOW, A_HIGH, A_QUANTIZE, Y_ZERO, Y_LOW, Y_HIGH, Y_SCALE, DEQUANTIZE = range(10)
B_SCALE, B_ZERO, B_LOW, B_HIGH, B_QUANTIZE = range(10, 15)
AFTER_SCALE, AFTER_ZERO, AFTER_LOW, AFTER_HIGH = range(4)


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


def _finish(acc, multiplier, offset, consts, out):
    """requantize_affine per column (or per tensor) in float64: the saturated codes (NaN: 0), or their float32
    values."""
    z, lo, hi = np.float64(consts[Y_ZERO]), np.float64(consts[Y_LOW]), np.float64(consts[Y_HIGH])
    v = np.rint(acc.astype(np.float64) * multiplier + offset) + z
    v = np.minimum(np.maximum(v, lo), hi)
    v = np.where(np.isnan(v), 0.0, v)
    out[...] = (v - z) * np.float64(consts[Y_SCALE]) if consts[DEQUANTIZE] != 0 else v


def requantized_product(a, packed, pairs, multiplier, offset, consts, out):
    _finish(_product(_a_codes(a, consts), packed), multiplier, offset, consts, out)


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
        _finish(_product(_a_codes(a[i], consts), packed), multiplier, offset, consts, out[i])


_COMPILED = "onnx_runtime_ep_cpu.compiled."
GENERIC_INT8 = {
    _COMPILED + "quantize.quantize": quantize,
    _COMPILED + "quantize.dequantize": dequantize,
    _COMPILED + "quantize.fake_quantize": fake_quantize,
    _COMPILED + "quantize.dynamic_quantize": dynamic_quantize,
    _COMPILED + "qgemm.pack_columns": pack_columns,
    _COMPILED + "qgemm_tiles.pack_pairs": pack_pairs,
    _COMPILED + "qgemm.product": product,
    _COMPILED + "qgemm.scaled_product": scaled_product,
    _COMPILED + "qgemm.dynamic_scaled_product": dynamic_scaled_product,
    _COMPILED + "qgemm.requantized_product": requantized_product,
    _COMPILED + "qgemm.requantized_product_rounded": requantized_product_rounded,
    _COMPILED + "qgemm.requantized_batched_product": requantized_batched_product,
}
