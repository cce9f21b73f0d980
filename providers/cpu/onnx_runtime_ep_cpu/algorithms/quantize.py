"""Linear (de)quantization arithmetic shared by the com.microsoft quantized operators.

Integers widen to int64 (or float64, which holds every 8-bit product sum exactly) before any
arithmetic, so sums and differences are exact; quantizing divides in float32 as QuantizeLinear does
for float32 data, rounds half to even and saturates to the target type's range. Products of 8-bit
matrices (``IntegerProduct``) accumulate in int32 through compiled/qgemm.py, which wraps exactly as the
int64 sum cast to int32 (``int_matmul``, the path for what it declines).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

_F32 = np.dtype(np.float32)


def integer_range(dtype) -> tuple[int, int]:
    return _integer_range(np.dtype(dtype))


@functools.cache
def _integer_range(dtype: np.dtype) -> tuple[int, int]:
    info = ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def widen(q: np.ndarray, zero_point=None) -> np.ndarray:
    """``q - zero_point`` exactly, as int64."""
    wide = np.asarray(q).astype(np.int64)
    if zero_point is None:
        return wide
    return wide - np.asarray(zero_point).astype(np.int64)


def dequantize(q: np.ndarray, scale, zero_point=None) -> np.ndarray:
    """``(q - zero_point) * scale`` in float32: the float32 tensor DequantizeLinear would produce."""
    centered = widen(q, zero_point).astype(_F32)
    return centered * np.asarray(scale).astype(_F32)


def round_saturate(values: np.ndarray, zero_point, dtype) -> np.ndarray:
    """``rint(values) + zero_point`` (ties to even) clamped to ``dtype``'s range, as ``dtype``."""
    low, high = integer_range(dtype)
    with np.errstate(invalid="ignore"):
        wide = np.rint(np.asarray(values, dtype=np.float64))
    if zero_point is not None:
        wide = wide + np.asarray(zero_point).astype(np.float64)
    # NaN has no integer image; 0 (the zero point's neighbourhood) is what the clip leaves of it elsewhere.
    wide = np.nan_to_num(wide, nan=0.0)
    return np.clip(wide, low, high).astype(dtype)


def quantize(values: np.ndarray, scale, zero_point, dtype) -> np.ndarray:
    """QuantizeLinear of float32 ``values``: ``values / scale`` in float32, then rounded and saturated."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        quotient = np.asarray(values).astype(_F32) / np.asarray(scale).astype(_F32)
    return round_saturate(quotient, zero_point, dtype)


def lookup_table(dtype, x_scale, x_zero_point, fn, y_scale, y_zero_point) -> np.ndarray:
    """quantize(fn(dequantize(q))) for every value q of the 8-bit ``dtype``, indexed by q's byte."""
    dtype = np.dtype(dtype)
    codes = np.arange(256, dtype=np.uint8).view(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        values = np.asarray(fn(dequantize(codes, x_scale, x_zero_point)), dtype=_F32)
    return quantize(values, y_scale, y_zero_point, dtype)


def apply_table(table: np.ndarray, q: np.ndarray) -> np.ndarray:
    """table[code] for each 8-bit code of ``q`` (indexed by the code's byte): a 256-entry table of 8-bit codes by
    one compiled pass (lookup_codes_into), any other table by numpy's indexing."""
    q = np.asarray(q)
    if table.dtype.itemsize != 1 or table.size != 256 or not q.size:
        return table[q.view(np.uint8)]
    out = np.empty(q.shape, table.dtype)
    lookup_codes_into(table, np.ascontiguousarray(q).reshape(1, -1), out.reshape(1, -1), 0)
    return out


_CODE_LOOKUP: list = []  # the compiled loop this host runs, imported at the first lookup


def lookup_codes_into(table: np.ndarray, codes: np.ndarray, rows: np.ndarray, at: int) -> None:
    """rows[:, at:at + width] = table[codes] for a 256-entry table of 8-bit codes, 2-D C-contiguous 8-bit ``codes``
    (rows, width) and 8-bit ``rows``: 64 codes a vpermi2b pair where AVX-512 VBMI is, a code at a time elsewhere
    (compiled/code_lookup.py), into place (a QLinearConcat's part of its output)."""
    if not _CODE_LOOKUP:
        from ..compiled import code_lookup

        _CODE_LOOKUP.append(code_lookup.code_lookup_lanes if code_lookup.VBMI else code_lookup.code_lookup_rows)
    _CODE_LOOKUP[0](table.view(np.uint8), codes.view(np.uint8), rows.view(np.uint8), at)


def dynamic_uint8(x: np.ndarray) -> tuple[np.float32, np.uint8, np.ndarray]:
    """DynamicQuantizeLinear: (scale, zero point, quantized x) over a range widened to include 0."""
    x = x.astype(_F32, copy=False)
    if x.size:
        from ..compiled import quantize as compiled

        q = np.empty(x.shape, np.uint8)
        scale, zero_point = compiled.dynamic_quantize(np.ascontiguousarray(x).reshape(-1), q.reshape(-1))
        return _F32.type(scale), np.uint8(zero_point), q
    # Empty: the range [0, 0], which takes a unit range as all zeros do (compiled.dynamic_quantize).
    return _F32.type(1) / _F32.type(255), np.uint8(0), x.astype(np.uint8)


def int_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An integer matrix product (broadcast over batch dims) as int32 accumulation would give it.

    float64 holds every partial sum of 8- and 16-bit products exactly for any realistic depth, and
    goes through BLAS; the result wraps through int64 as a 32-bit accumulator would.
    """
    product = np.matmul(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    return np.asarray(product).astype(np.int64).astype(np.int32)


_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


class IntegerProduct:
    """``(A - a_zero) @ (B - b_zero)`` in int32 through compiled/qgemm.py, for 8-bit A (..., M, K) and a 2-D
    8-bit B (K, N); B with its zero points subtracted is packed once per set of constant inputs. A stacked B
    (..., K, N) with per-tensor zero points (attention's products) is packed per call.

    A's zero point is per tensor or, for a matrix A, per row (M,); B's per tensor or per column (N,).
    ``__call__`` returns None for anything else (other zero-point shapes, other types), which callers compute with
    ``int_matmul`` instead.
    """

    __slots__ = ("_prepared", "_qgemm")

    def __init__(self):
        from ..compiled import qgemm
        from .prepared import Prepared

        self._prepared = Prepared()
        self._qgemm = qgemm  # numba loads with the first kernel that needs it

    def __call__(self, a: np.ndarray, b: np.ndarray, a_zero=None, b_zero=None,
                 trans_b: bool = False) -> np.ndarray | None:
        """The int32 product, or None where this path does not apply. ``trans_b``: B is given as (N, K)."""
        if a.dtype not in _EIGHT_BIT or b.dtype not in _EIGHT_BIT or a.ndim < 1:
            return None
        if b.ndim > 2 and not trans_b:
            return _batched(a, b, a_zero, b_zero)
        if b.ndim != 2:
            return None
        depth = b.shape[1] if trans_b else b.shape[0]
        if a.shape[-1] != depth:
            return None
        rows_zero = _zeros(a_zero)
        if rows_zero is None or (rows_zero.size > 1 and (a.ndim != 2 or rows_zero.size != a.shape[0])):
            return None
        packed = self.packed(b, b_zero, trans_b)
        if packed is None:
            return None
        columns = packed.shape[0]
        flat = np.ascontiguousarray(a).reshape(-1, depth)
        out = np.empty((flat.shape[0], columns), np.int32)
        self._qgemm.product(flat, rows_zero, packed, self._qgemm.pairs_for(packed), out)
        return out.reshape(a.shape[:-1] + (columns,))

    def packed(self, b: np.ndarray, b_zero=None, trans_b: bool = False) -> np.ndarray | None:
        """8-bit matrix B (K, N), or (N, K) with ``trans_b``, as int16 (N, K) with its per-tensor or per-column
        zero points subtracted, made once per constant B (qgemm.compact: only its pairs where the tiles run, an
        (N, 0) stand-in here); None for other zero-point shapes."""
        columns, depth = b.shape if trans_b else b.shape[::-1]
        b_zeros = _zeros(b_zero)
        if b_zeros is None or b_zeros.size not in (1, columns):
            return None
        qgemm = self._qgemm

        def pack():
            packed = np.empty((columns, depth), np.int16)
            qgemm.pack_columns(b.T if trans_b else b, b_zeros, packed)
            return qgemm.compact(packed)

        # Keyed on the zero points' values: callers pass them reshaped (a new array object on every call).
        return self._prepared.get((trans_b, b_zeros.tobytes()), (b,), pack)


def _batched(a, b, a_zero, b_zero) -> np.ndarray | None:
    """Products of stacked matrices, (..., M, K) @ (..., K, N) broadcast over the leading dims, per-tensor zero
    points only (None otherwise)."""
    zeros = [_zeros(z) for z in (a_zero, b_zero)]
    if a.ndim < 2 or any(z is None or z.size != 1 for z in zeros) or a.shape[-1] != b.shape[-2]:
        return None
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        return None
    from ..compiled import qgemm

    rows, depth, columns = a.shape[-2], a.shape[-1], b.shape[-1]
    left = np.ascontiguousarray(np.broadcast_to(a, batch + (rows, depth))).reshape(-1, rows, depth)
    right = np.ascontiguousarray(np.broadcast_to(b, batch + (depth, columns))).reshape(-1, depth, columns)
    out = np.empty((left.shape[0], rows, columns), np.int32)
    qgemm.batched_product(left, int(zeros[0][0]), right, int(zeros[1][0]), out)
    return out.reshape(batch + (rows, columns))


def _zeros(zero_point) -> np.ndarray | None:
    """A zero point as a flat int32 array (0 when absent); None when it is not a vector or scalar of integers."""
    if zero_point is None:
        return np.zeros(1, np.int32)
    zero_point = np.asarray(zero_point)
    if zero_point.dtype.kind not in "iu" or zero_point.size == 0:
        return None
    if zero_point.ndim > 1 and zero_point.size != max(zero_point.shape):
        return None
    return zero_point.reshape(-1).astype(np.int32)
