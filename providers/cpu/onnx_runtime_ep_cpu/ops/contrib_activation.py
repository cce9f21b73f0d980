"""onnxruntime's contrib activations (domain com.microsoft, docs/ContribOperators.md): Gelu, BiasGelu, FastGelu,
QuickGelu, and the diffusion models' BiasAdd and BiasSplitGelu.

Half-precision inputs compute in float32, double in double; the result is rounded once to the input type.
A bias is one value per feature of the last axis.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.activations import gelu_erf, gelu_series, gelu_tanh, sigmoid
from ..algorithms.precision import upcast
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error


def _biased(node, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x (+ bias over the last axis) in the compute dtype, a fresh array when biased."""
    xc = upcast(x)
    if bias is None:
        return xc
    if bias.shape != x.shape[-1:]:
        raise argument_error(node, f"bias has shape {bias.shape}; expected ({x.shape[-1] if x.ndim else 1},), one "
                             f"value per feature of the input's last axis {x.shape}")
    return xc + bias.astype(xc.dtype, copy=False)


def _quiet_gelu(fn, x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # huge |x| overflows x^3; the limits are still right
        return fn(x)


def _gelu_kernel(node, approximate: str):
    """Gelu(x (+ bias over the last axis)): float32/float64 in the compiled loop of the ONNX Gelu (the bias added
    in its pass), other dtypes in numpy in their compute dtype, rounded once."""
    fn = gelu_erf if approximate == "none" else gelu_tanh
    series = {np.dtype(t): gelu_series(approximate, t) for t in (np.float32, np.float64)}
    from ..compiled import transformer as compiled

    def kernel(x, bias=None):
        coefficients = series.get(x.dtype)
        if coefficients is not None and x.size and x.ndim and (bias is None or (bias.dtype == x.dtype and
                                                                                bias.shape == x.shape[-1:])):
            rows = compiled.as_rows(x) if bias is None else np.ascontiguousarray(x).reshape(-1, x.shape[-1])
            return (compiled.gelu(rows, coefficients, bias=bias).reshape(x.shape),)
        return (_quiet_gelu(fn, _biased(node, x, bias)).astype(x.dtype, copy=False),)

    return kernel


@register("Gelu", domain=CONTRIB_DOMAIN, since=1)
def gelu(node, shapes, opset):
    """0.5 * x * (1 + erf(x / sqrt(2)))."""
    kernel = _gelu_kernel(node, "none")
    return lambda x: kernel(x)


@register("BiasGelu", domain=CONTRIB_DOMAIN, since=1)
def bias_gelu(node, shapes, opset):
    """Gelu(A + B), B a bias over A's last axis."""
    return _gelu_kernel(node, "none")


@register("FastGelu", domain=CONTRIB_DOMAIN, since=1)
def fast_gelu(node, shapes, opset):
    """The tanh approximation 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) of Gelu(x + bias)."""
    return _gelu_kernel(node, "tanh")


@register("QuickGelu", domain=CONTRIB_DOMAIN, since=1)
def quick_gelu(node, shapes, opset):
    """x * sigmoid(alpha * x)."""
    alpha = float(node.attr("alpha", 1.702))

    def kernel(x):
        xc = upcast(x)
        with np.errstate(over="ignore", invalid="ignore"):  # exp overflows to a 0 sigmoid; -inf * 0 is NaN
            y = xc * sigmoid(xc * xc.dtype.type(alpha))
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("BiasAdd", domain=CONTRIB_DOMAIN, since=1)
def bias_add(node, shapes, opset):
    """X + bias + skip: X and skip (N, S, C), bias (C)."""

    def kernel(x, bias, skip):
        if x.ndim != 3 or skip.shape != x.shape:
            raise argument_error(node, f"X {x.shape} and skip {skip.shape} must both be (N, S, C)")
        y = _biased(node, x, bias)
        y += skip.astype(y.dtype, copy=False)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("BiasSplitGelu", domain=CONTRIB_DOMAIN, since=1)
def bias_split_gelu(node, shapes, opset):
    """(X + bias) split in halves over the last axis: left * Gelu(right), (N, S, D / 2)."""

    def kernel(x, bias):
        if x.ndim != 3 or x.shape[-1] % 2:
            raise argument_error(node, f"X has shape {x.shape}; expected (N, S, D) with an even hidden size D")
        y = _biased(node, x, bias)
        half = x.shape[-1] // 2
        out = _quiet_gelu(gelu_erf, np.ascontiguousarray(y[..., half:]))
        out *= y[..., :half]
        return (out.astype(x.dtype, copy=False),)

    return kernel
