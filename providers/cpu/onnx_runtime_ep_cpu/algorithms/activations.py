"""Activation functions on numpy arrays: sigmoid and its relatives, and both forms of Gelu (with the
series the compiled loops of compiled/transformer.py evaluate).
"""

from __future__ import annotations

import math

import numpy as np

from .precision import scalar, upcast


def sigmoid(x):
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        # The same operations in one fresh buffer: a small tensor's cost is the temporaries' allocations.
        y = np.negative(x)
        np.exp(y, out=y)
        y += 1
        return np.reciprocal(y, out=y)
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.logaddexp(x, scalar(0, x.dtype))


def softsign(x):
    return x / (1 + np.abs(x))


def mish(x):
    return x * np.tanh(softplus(x))


def hard_sigmoid_of(x, alpha, beta):
    linear = scalar(alpha, x.dtype) * x + scalar(beta, x.dtype)
    # minimum/maximum rather than np.clip, which turns bfloat16 into float32
    return np.minimum(np.maximum(linear, scalar(0, x.dtype)), scalar(1, x.dtype))


def hard_swish(x):
    return x * hard_sigmoid_of(x, 1 / 6, 0.5)


def hard_swish_in_place(y: np.ndarray) -> None:
    """HardSwish (y * clip(y / 6 + 1 / 2, 0, 1)) in place: the HardSwish kernel's operations, in y's dtype."""
    gate = np.multiply(y, y.dtype.type(1 / 6))
    gate += y.dtype.type(0.5)
    np.maximum(gate, y.dtype.type(0), out=gate)
    np.minimum(gate, y.dtype.type(1), out=gate)
    with np.errstate(invalid="ignore"):  # inf * 0 is NaN, as in the HardSwish kernel
        y *= gate


def hard_swish_steps(x: np.ndarray, y: np.ndarray) -> list:
    """HardSwish of the C-contiguous float32/float64 ``x`` into ``y`` (the same array, or one of its shape and
    dtype) as ``[(loop, arguments)]``, for a segment's bound plan: hard_swish_in_place's operations in one
    compiled pass (compiled/segment_loops.py)."""
    from ..compiled.segment_loops import hard_sigmoid_into

    t = x.dtype.type
    return [(hard_sigmoid_into, (x.reshape(-1), y.reshape(-1), t(1 / 6), t(0.5), True))]


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """0.5 * x * (1 + erf(x / sqrt(2))); below float64, in float32 and in place on erf's fresh result."""
    from .erf import erf_float32, erf_float64  # (at the first Gelu: every convolution imports this module)

    if x.dtype == np.float64:
        return 0.5 * x * (1 + erf_float64(x / math.sqrt(2)))
    xc = upcast(x)
    y = erf_float32(xc, scale=1 / math.sqrt(2))
    y += np.float32(1)
    y *= xc
    y *= np.float32(0.5)
    return y


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), in place over one fresh array."""
    xc = upcast(x)
    dtype = xc.dtype.type
    y = np.square(xc, out=np.empty_like(xc))
    y *= dtype(math.sqrt(2 / math.pi) * 0.044715)
    y += dtype(math.sqrt(2 / math.pi))
    y *= xc
    np.tanh(y, out=y)
    y += dtype(1)
    y *= xc
    y *= dtype(0.5)
    return y


def gelu_series(approximate: str, dtype) -> np.ndarray | None:
    """Coefficients (lowest first) of the odd series u * P(u^2) whose tanh both Gelu kernels above take,
    for the compiled loops; None where the numpy kernel runs (other dtypes, float64's erf)."""
    from .erf import scaled_coefficients

    if dtype == np.float32 and approximate == "none":
        return np.array(scaled_coefficients(1 / math.sqrt(2)), np.float32)
    if dtype in (np.float32, np.float64) and approximate == "tanh":
        return np.array([math.sqrt(2 / math.pi), math.sqrt(2 / math.pi) * 0.044715], dtype)
    return None
