"""numpy equivalents of loops that convolution networks run (the per-tap convolution's epilogue, a small
Sigmoid: EfficientNet's SiLU and gates) that generic.py does not hold, with the same contract: the loop's effects
and return value, within float32 rounding (deferred.py serves them while numba loads)."""

from __future__ import annotations

import numpy as np


def activate_in_place(values: np.ndarray, bounds: np.ndarray) -> None:
    """compiled/epilogue.activate over an array, in place: v*slope below zero, then max with low, then min with
    high (comparisons with NaN are false, so NaN passes through; the high bound wins where low > high). A step
    that is the identity for these bounds (slope 1, low -inf, high +inf) is skipped, and the others write only the
    entries they change, so a ReLU is one comparison and one masked store rather than six full-size temporaries."""
    low, high, slope = bounds[0], bounds[1], bounds[2]
    if slope != 1:
        np.multiply(values, slope, out=values, where=values < 0)
    if low > -np.inf:
        np.copyto(values, low, where=values < low)
    if high < np.inf:
        np.copyto(values, high, where=values > high)


def crop_bias_residual_activation(rows, y, width, bias, residual, bounds):
    images, channels, size = y.shape
    lines = size // width if width > 0 else 0
    if lines == 0 or images == 0 or channels == 0:
        return
    padded = rows.shape[2] // lines
    part = rows[:, :, :lines * padded].reshape(images, channels, lines, padded)[:, :, :, :width]
    out = y[:, :, :lines * width].reshape(images, channels, lines, width)  # a view: one axis split in two
    if bias.shape[0] > 0:  # without a bias nothing is added (adding zero would turn -0.0 into +0.0)
        np.add(part, bias[None, :, None, None], out=out)
        part = out
    if residual.shape[0] > 0:
        np.add(part, residual[:, :, :lines * width].reshape(images, channels, lines, width), out=out)
    elif part is not out:
        np.copyto(out, part)
    activate_in_place(out, bounds)


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
