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
