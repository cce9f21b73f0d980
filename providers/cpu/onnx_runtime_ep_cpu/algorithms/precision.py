"""The precision a kernel computes in: half-precision floats in float32 (numpy has no BLAS for them, and
float32 accumulation is more accurate), other types as they are; and the conversions between float32 and the
half-precision types, by the compiled passes of compiled/precision.py (numpy converts float16 and bfloat16
element by element in software), numpy's own for small arrays and while numba loads (deferred.py).
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType

from ..compiled.deferred import numpy_first

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = DataType.BFLOAT16.numpy  # ml_dtypes'
HALF_FLOATS = frozenset({FLOAT16, BFLOAT16})
BLAS_FLOATS = frozenset({FLOAT32, np.dtype(np.float64)})
# From how many elements a compiled loop beats numpy's conversion (a loop's call costs about a microsecond more;
# ml_dtypes widens bfloat16 as fast as the loop does)
_COMPILED_FROM = {("round", FLOAT16): 512, ("round", BFLOAT16): 2048, ("widen", FLOAT16): 2048,
                  ("narrow", FLOAT16): 1024, ("narrow", BFLOAT16): 4096}
_NEVER = 1 << 62


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision floats (float16, bfloat16) compute in float32: numpy has no fast float16
    BLAS, and float32 accumulation is more accurate; other types compute as they are."""
    dtype = np.dtype(dtype)
    return FLOAT32 if dtype.itemsize < 4 and dtype.kind not in "biu" else dtype


def upcast(x: np.ndarray) -> np.ndarray:
    """``x`` in its compute dtype (a half-precision array widened to float32; others as they are)."""
    if x.dtype in HALF_FLOATS:
        return widen(x)
    return x.astype(compute_dtype(x.dtype), copy=False)


def scalar(value, dtype):
    """An attribute scalar as a 0-d array of ``dtype``, so it does not promote the input."""
    return np.asarray(value, dtype=dtype)


def _use_compiled(size: int, conversion: str, half: np.dtype) -> bool:
    return size >= _COMPILED_FROM.get((conversion, half), _NEVER) and not numpy_first()


def _loops():
    """compiled/precision.py, imported at the first compiled conversion: numpy-served and float32-only runs never
    load it (it builds its loops, importing numba, at their first call)."""
    from ..compiled import precision

    return precision


def round_to(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` rounded to the half-precision ``dtype`` (float16 or bfloat16) and kept in x's dtype: a Cast to
    ``dtype`` and back. float32 arrays take one compiled call; others convert twice."""
    dtype = np.dtype(dtype)
    if x.dtype != FLOAT32 or not _use_compiled(x.size, "round", dtype):
        with np.errstate(over="ignore", invalid="ignore"):  # a Cast's overflow is infinite, silently
            return x.astype(dtype).astype(x.dtype)
    src = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(src)
    compiled = _loops()
    (compiled.round_to_float16 if dtype == FLOAT16 else compiled.round_to_bfloat16)(src, out)
    return out.reshape(x.shape)


def widen(x: np.ndarray) -> np.ndarray:
    """The float16 or bfloat16 array ``x`` as float32 (exact)."""
    if not _use_compiled(x.size, "widen", x.dtype):
        return x.astype(FLOAT32)
    src = np.ascontiguousarray(x).reshape(-1).view(np.int16)
    out = np.empty(src.shape, FLOAT32)
    compiled = _loops()
    (compiled.float16_to_float32 if x.dtype == FLOAT16 else compiled.bfloat16_to_float32)(src, out)
    return out.reshape(x.shape)


def narrow(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The float32 array ``x`` rounded to the half-precision ``dtype`` (float16 or bfloat16), to nearest even."""
    dtype = np.dtype(dtype)
    if x.dtype != FLOAT32 or not _use_compiled(x.size, "narrow", dtype):
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(dtype)
    src = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(src.shape, np.int16)
    compiled = _loops()
    (compiled.float32_to_float16 if dtype == FLOAT16 else compiled.float32_to_bfloat16)(src, out)
    return out.view(dtype).reshape(x.shape)


def round_all(arrays: tuple, dtype: np.dtype) -> tuple:
    """``round_to`` of each array; float32 arrays together in one compiled call over one buffer (a decoder's
    past keys and values: a call per array would cost more than its rounding), returned as views of it."""
    dtype = np.dtype(dtype)
    total = sum(x.size for x in arrays)
    if len(arrays) < 2 or any(x.dtype != FLOAT32 for x in arrays) or not _use_compiled(total, "round", dtype):
        return tuple(round_to(x, dtype) for x in arrays)
    src = np.concatenate([x.reshape(-1) for x in arrays])
    out = np.empty_like(src)
    compiled = _loops()
    (compiled.round_to_float16 if dtype == FLOAT16 else compiled.round_to_bfloat16)(src, out)
    rounded, start = [], 0
    for x in arrays:
        rounded.append(out[start:start + x.size].reshape(x.shape))
        start += x.size
    return tuple(rounded)
