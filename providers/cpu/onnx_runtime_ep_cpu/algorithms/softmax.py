"""Softmax, LogSoftmax and Hardmax along an axis; float32 softmaxes up to 64K elements in one compiled call.
"""

from __future__ import annotations

import numpy as np

from .normalization import row_sums


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax of float32 x along its last axis, up to _COMPILED_SOFTMAX elements: one compiled call
    (transformer.softmax_rows_float32_). Otherwise four passes over x: subtract the maximum into a fresh
    array, then exp, sum and scale in place. fmax ignores NaN where maximum is slow propagating it; a NaN
    still spreads over its row through the sum (in both)."""
    if x.dtype == np.float32 and axis == x.ndim - 1 and x.flags.c_contiguous and x.size <= _COMPILED_SOFTMAX:
        from ..compiled import transformer

        y = np.empty(x.shape, np.float32)
        transformer.softmax_rows_float32_(x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1]))
        return y
    with np.errstate(invalid="ignore"):  # a row of -inf (fully masked) gives NaN, as the spec's formula does
        e = np.subtract(x, np.fmax.reduce(x, axis=axis, keepdims=True))
    np.exp(e, out=e)
    if axis == x.ndim - 1 and e.flags.c_contiguous:
        total = row_sums(e.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (1,))
    else:
        total = e.sum(axis=axis, keepdims=True)
    e *= np.reciprocal(total, out=total)
    return e


# Float32 softmaxes up to this many elements run one compiled call (a CNN's closing 1000 classes).
_COMPILED_SOFTMAX = 1 << 16


def log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.zeros_like(x)
    np.put_along_axis(y, np.expand_dims(x.argmax(axis=axis), axis), 1, axis=axis)
    return y
