"""QLinearGlobalAveragePool and QLinearAveragePool (domain com.microsoft, docs/ContribOperators.md), in NCHW or
(channels_last) NHWC: the exact sum of the centred codes, the mean and the rescale in one float64 factor, rounded
once."""

from __future__ import annotations

import math

import numpy as np

from ..algorithms.quantize import dequantize, quantize, round_saturate, widen
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, graph_error
from .contrib_quantization import eight_bit, float_scale, scalar
from .pool import average_pool

_F64 = np.dtype(np.float64)

# -- QLinearGlobalAveragePool, QLinearAveragePool --------------------------------------------------


def _channels_last(node) -> bool:
    value = int(node.attr("channels_last", 0))
    if value not in (0, 1):
        raise graph_error(node, "channels_last", f"is {value}; expected 0 (NCHW) or 1 (NHWC)")
    return bool(value)


def _pool_params(node, x, x_scale, x_zero_point, y_scale, y_zero_point):
    dtype = eight_bit(node, "X", x)
    if x.ndim < 3:
        raise argument_error(node, f"input 'X' has shape {x.shape}; expected (N, C, D1, ...) with a spatial dim")
    return (dtype, float_scale(node, "x_scale", x_scale), scalar(node, "x_zero_point", x_zero_point, dtype),
            float_scale(node, "y_scale", y_scale), scalar(node, "y_zero_point", y_zero_point, dtype))


@register("QLinearGlobalAveragePool", domain=CONTRIB_DOMAIN, since=1)
def qlinear_global_average_pool(node, shapes, opset):
    last = _channels_last(node)

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype, xs, xz, ys, yz = _pool_params(node, x, x_scale, x_zero_point, y_scale, y_zero_point)
        axes = tuple(range(1, x.ndim - 1)) if last else tuple(range(2, x.ndim))
        count = math.prod(x.shape[a] for a in axes)
        # The sum of (x - zero point) is exact; mean and rescale meet in one float64 factor.
        total = widen(x, xz).sum(axis=axes, keepdims=True)
        values = total * (xs.astype(_F64) / (ys.astype(_F64) * count)) if count else total * 0.0
        return (round_saturate(values, yz, dtype),)

    return kernel


@register("QLinearAveragePool", domain=CONTRIB_DOMAIN, since=1)
def qlinear_average_pool(node, shapes, opset):
    last = _channels_last(node)
    pool = average_pool(node, [None], opset)

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype, xs, xz, ys, yz = _pool_params(node, x, x_scale, x_zero_point, y_scale, y_zero_point)
        real = dequantize(x, xs, xz)
        if last:  # NHWC -> NCHW for the float pool, and back
            real = np.ascontiguousarray(np.moveaxis(real, -1, 1))
        pooled = pool(real)[0]
        if last:
            pooled = np.moveaxis(pooled, 1, -1)
        return (quantize(pooled, ys, yz, dtype),)

    return kernel
