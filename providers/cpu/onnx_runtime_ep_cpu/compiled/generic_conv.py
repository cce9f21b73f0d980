"""numpy equivalents of loops that convolution networks run (the per-tap convolution's epilogue, a small
Sigmoid: EfficientNet's SiLU and gates) that generic.py does not hold, with the same contract: the loop's effects
and return value, within float32 rounding (deferred.py serves them while numba loads)."""

from __future__ import annotations

import numpy as np


def _activate(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """compiled/epilogue.activate over an array: v*slope below zero, then max with low, then min with high
    (comparisons with NaN are false, so NaN passes through; the high bound wins where low > high)."""
    low, high, slope = bounds[0], bounds[1], bounds[2]
    values = np.where(values < 0, values * slope, values)
    values = np.where(values < low, low, values)
    return np.where(values > high, high, values)


def crop_bias_residual_activation(rows, y, width, bias, residual, bounds):
    images, channels, size = y.shape
    lines = size // width if width > 0 else 0
    if lines == 0 or images == 0 or channels == 0:
        return
    padded = rows.shape[2] // lines
    part = rows[:, :, :lines * padded].reshape(images, channels, lines, padded)[:, :, :, :width]
    if bias.shape[0] > 0:  # without a bias nothing is added (adding zero would turn -0.0 into +0.0)
        part = part + bias[None, :, None, None]
    if residual.shape[0] > 0:
        part = part + residual[:, :, :lines * width].reshape(images, channels, lines, width)
    y[:, :, :lines * width] = _activate(part, bounds).reshape(images, channels, lines * width)


def sigmoid_into(x, y):
    one = x.dtype.type(1)
    y[...] = one / (one + np.exp(-x))


def silu_float32(x, y, alpha):
    with np.errstate(over="ignore"):  # exp of a large -alpha*x overflows to inf: the limit 0, as the loop's
        y[...] = x / (np.float32(1) + np.exp(np.float32(-alpha) * x))


_COMPILED = "onnx_runtime_ep_cpu.compiled."
GENERIC_CONV = {
    _COMPILED + "epilogue.crop_bias_residual_activation": crop_bias_residual_activation,
    _COMPILED + "sigmoid.sigmoid_into": sigmoid_into,
    _COMPILED + "silu.silu_float32": silu_float32,
}
