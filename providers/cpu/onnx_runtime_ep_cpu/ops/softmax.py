"""Softmax, LogSoftmax and Hardmax: along one axis from opset 13, over the input flattened to 2-D before.
"""

from __future__ import annotations

import math

from ..algorithms.precision import upcast
from ..algorithms.softmax import hardmax, log_softmax, softmax
from ..registry import register
from ._common import normalize_axis


def _along_axis(node, fn, default_axis: int, coerce_2d: bool):
    """Apply ``fn(x, axis)`` per axis (opset 13+) or over the input flattened to 2-D at axis (<13)."""
    axis = int(node.attr("axis", default_axis))

    def kernel(x):
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
    return _along_axis(node, softmax, 1, coerce_2d=True)


@register("Softmax", since=13)
def softmax_13(node, shapes, opset):
    return _along_axis(node, softmax, -1, coerce_2d=False)


@register("LogSoftmax", since=1)
def log_softmax_1(node, shapes, opset):
    return _along_axis(node, log_softmax, 1, coerce_2d=True)


@register("LogSoftmax", since=13)
def log_softmax_13(node, shapes, opset):
    return _along_axis(node, log_softmax, -1, coerce_2d=False)


@register("Hardmax", since=1)
def hardmax_1(node, shapes, opset):
    return _along_axis(node, hardmax, 1, coerce_2d=True)


@register("Hardmax", since=13)
def hardmax_13(node, shapes, opset):
    return _along_axis(node, hardmax, -1, coerce_2d=False)
