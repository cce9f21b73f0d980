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
}
