"""Activations with attributes (Relu, LeakyRelu, PRelu, ThresholdedRelu, Elu, Selu, Celu, HardSigmoid) and
Gelu; those without attributes (Sigmoid, Softplus, ...) are elementwise.py's unary table.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.activations import gelu_erf, gelu_series, gelu_tanh, hard_sigmoid_of
from ..algorithms.precision import scalar
from ..registry import register
from ._common import graph_error, quiet, shape_free


@register("Relu", since=1)
def relu(node, shapes, opset):
    return shape_free(lambda x: (np.maximum(x, scalar(0, x.dtype)),))


@register("LeakyRelu", since=1)
def leaky_relu(node, shapes, opset):
    alpha = node.attr("alpha", 0.01)
    return lambda x: (np.where(x < 0, scalar(alpha, x.dtype) * x, x),)


@register("PRelu", since=1)
def prelu_1(node, shapes, opset):
    # Before opset 7 a 1-D slope holds one value per channel (axis 1), whatever the input's rank.
    def kernel(x, slope):
        if slope.ndim == 1 and slope.size > 1 and x.ndim >= 2 and slope.size == x.shape[1]:
            slope = slope.reshape(-1, *([1] * (x.ndim - 2)))
        return (np.where(x < 0, slope * x, x).astype(x.dtype, copy=False),)

    return kernel


@register("PRelu", since=7)
def prelu(node, shapes, opset):
    # The slope broadcasts onto x (unidirectional broadcasting, numpy rules).
    return lambda x, slope: (np.where(x < 0, slope * x, x).astype(x.dtype, copy=False),)


@register("ThresholdedRelu", since=10)
def thresholded_relu(node, shapes, opset):
    alpha = node.attr("alpha", 1.0)
    return lambda x: (np.where(x > scalar(alpha, x.dtype), x, scalar(0, x.dtype)),)


@register("Elu", since=1)
def elu(node, shapes, opset):
    alpha = node.attr("alpha", 1.0)

    @quiet
    def kernel(x):
        return (np.where(x < 0, scalar(alpha, x.dtype) * np.expm1(x), x),)

    return kernel


@register("Selu", since=1)
def selu(node, shapes, opset):
    alpha = node.attr("alpha", 1.6732632423543772848170429916717)
    gamma = node.attr("gamma", 1.0507009873554804934193349852946)

    @quiet
    def kernel(x):
        negative = scalar(alpha, x.dtype) * np.expm1(x)
        return (scalar(gamma, x.dtype) * np.where(x > 0, x, negative),)

    return kernel


@register("Celu", since=12)
def celu(node, shapes, opset):
    alpha = node.attr("alpha", 1.0)

    @quiet
    def kernel(x):
        a = scalar(alpha, x.dtype)
        return (np.maximum(x, 0) + np.minimum(0, a * np.expm1(x / a)),)

    return kernel


@register("HardSigmoid", since=1)
def hard_sigmoid(node, shapes, opset):
    alpha, beta = node.attr("alpha", 0.2), node.attr("beta", 0.5)
    return lambda x: (hard_sigmoid_of(x, alpha, beta),)


@register("Gelu", since=20)
def gelu(node, shapes, opset):
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise graph_error(node, "approximate", f"is {approximate!r}; expected 'none' or 'tanh'")
    fn = gelu_erf if approximate == "none" else gelu_tanh
    from ..compiled import transformer as compiled

    # The compiled loops: float32 in one pass (with its own vectorized exp), float64 in three (numpy's ~18).
    series = {np.dtype(t): gelu_series(approximate, t) for t in (np.float32, np.float64)}

    def kernel(x):
        coefficients = series.get(x.dtype)
        if coefficients is not None and x.size:
            return (compiled.gelu(compiled.as_rows(x), coefficients).reshape(x.shape),)
        with np.errstate(over="ignore", invalid="ignore"):  # huge |x| overflows; -inf * 0 is NaN as specified
            return (fn(x).astype(x.dtype, copy=False),)

    return kernel
