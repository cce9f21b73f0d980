"""Softmax, LogSoftmax and Hardmax: along one axis from opset 13, over the input flattened to 2-D before.
"""

from __future__ import annotations

import math

import numpy as np

from ..algorithms.bound_loop import bound_entry
from ..algorithms.precision import upcast
from ..algorithms.softmax import hardmax, log_softmax, softmax
from ..registry import register
from ._common import normalize_axis

_FLOAT32 = np.dtype(np.float32)
# Up to this many elements the compiled rows serve a float32 softmax (algorithms/softmax.py's own bound).
_ROWS_LIMIT = 1 << 16
# The log-softmax rows beat numpy's formula at the sizes measured (one row of a few classes up to a block of
# many long rows; not many rows of width one, whose outputs are all zeros), so they have no bound of their own.
_NO_LIMIT = 1 << 62


def _along_axis(node, fn, default_axis: int, coerce_2d: bool, rows=None, rows_limit: int = _ROWS_LIMIT):
    """Apply ``fn(x, axis)`` per axis (opset 13+) or over the input flattened to 2-D at axis (<13). ``rows(x2, y2)``:
    a compiled loop over the rows of a 2-D float32 array, called straight for a contiguous float32 input whose
    rows are the axis (a streaming model's closing Softmax runs every frame on a few classes)."""
    axis = int(node.attr("axis", default_axis))
    # The last rows call's (input shape, the loop's bound entry point, the 2-D rows shape, or None where the input
    # is 2-D already): a streaming model calls the node with the same shape every frame, and the checks, the
    # reshapes and the dispatcher's typing below cost several times a few classes' arithmetic.
    kept = (None, None, None)

    def kernel(x):
        nonlocal kept
        shape, entry, rows_shape = kept  # one read: another thread may keep another call meanwhile
        if x.shape == shape and x.dtype is _FLOAT32 and x.flags.c_contiguous:
            y = np.empty(shape, _FLOAT32)
            if rows_shape is None:
                entry(x, y)
            else:
                entry(x.reshape(rows_shape), y.reshape(rows_shape))
            return (y,)
        if rows is not None and x.dtype is _FLOAT32 and 0 < x.size <= rows_limit and x.flags.c_contiguous \
                and -x.ndim <= axis < x.ndim and (coerce_2d or axis % x.ndim == x.ndim - 1):
            width = math.prod(x.shape[axis % x.ndim:])
            y = np.empty(x.shape, _FLOAT32)
            x2, y2 = x.reshape(-1, width), y.reshape(-1, width)
            rows(x2, y2)
            bound = bound_entry(rows, (x2, y2))
            if bound is not None:
                kept = (x.shape, bound, None if x2.shape == x.shape else x2.shape)
            return (y,)
        if x.size == 0:
            return (x,)
        a = normalize_axis(node, axis, x.ndim)
        xc = upcast(x)
        if coerce_2d:
            y = fn(xc.reshape(math.prod(x.shape[:a]), -1), 1).reshape(x.shape)
        else:
            y = fn(xc, a)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("Softmax", since=1)
def softmax_1(node, shapes, opset):
    return _along_axis(node, softmax, 1, coerce_2d=True, rows=_softmax_rows())


@register("Softmax", since=13)
def softmax_13(node, shapes, opset):
    return _along_axis(node, softmax, -1, coerce_2d=False, rows=_softmax_rows())


def _softmax_rows():
    from ..compiled import transformer  # (numba itself loads at the loop's first call)

    return transformer.softmax_rows_float32_


@register("LogSoftmax", since=1)
def log_softmax_1(node, shapes, opset):
    return _along_axis(node, log_softmax, 1, coerce_2d=True, rows=_log_softmax_rows(), rows_limit=_NO_LIMIT)


@register("LogSoftmax", since=13)
def log_softmax_13(node, shapes, opset):
    return _along_axis(node, log_softmax, -1, coerce_2d=False, rows=_log_softmax_rows(), rows_limit=_NO_LIMIT)


def _log_softmax_rows():
    from ..compiled import log_softmax as compiled_log_softmax  # (numba itself loads at the loop's first call)

    return compiled_log_softmax.log_softmax_rows_float32_


@register("Hardmax", since=1)
def hardmax_1(node, shapes, opset):
    return _along_axis(node, hardmax, 1, coerce_2d=True)


@register("Hardmax", since=13)
def hardmax_13(node, shapes, opset):
    return _along_axis(node, hardmax, -1, coerce_2d=False)
