"""The precision a kernel computes in: half-precision floats in float32 (numpy has no BLAS for them, and
float32 accumulation is more accurate), other types as they are.
"""

from __future__ import annotations

import numpy as np


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision floats (float16, bfloat16) compute in float32: numpy has no fast float16
    BLAS, and float32 accumulation is more accurate; other types compute as they are."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind not in "biu" else dtype


def upcast(x: np.ndarray) -> np.ndarray:
    return x.astype(compute_dtype(x.dtype), copy=False)


BLAS_FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


FLOAT32 = np.dtype(np.float32)


def scalar(value, dtype):
    """An attribute scalar as a 0-d array of ``dtype``, so it does not promote the input."""
    return np.asarray(value, dtype=dtype)


def round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` rounded to the half-precision ``dtype`` (float16 or bfloat16) and kept in x's dtype: a Cast to
    ``dtype`` and back. float32 arrays take one compiled pass; others convert twice."""
    dtype = np.dtype(dtype)
    if x.dtype != FLOAT32 or dtype.itemsize != 2:
        return x.astype(dtype).astype(x.dtype)
    from ..compiled import precision  # numba loads only for models that round

    src = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(src)
    if dtype == np.float16:
        precision.round_to_float16_normal(src.view(np.int32), out.view(np.int32))
        precision.round_to_float16_subnormal(src, out)
    else:
        precision.round_to_bfloat16(src.view(np.int32), out.view(np.int32))
    return out.reshape(x.shape)
