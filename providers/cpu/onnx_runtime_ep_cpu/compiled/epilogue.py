"""One-pass epilogues of convolution and batch normalization: a per-channel affine map or bias,
a residual, and an activation applied to each element once, instead of one numpy pass per term.

Arrays are (N, C, P): batch, channels, pixels (contiguous). The activation is a code with a
two-element ``params`` array of the data's dtype (Clip's bounds; LeakyRelu's slope first), chosen
outside the inner loop so each loop stays branch-free; the conv epilogues take it as
activation_bounds (low, high, slope), built once per node. The arithmetic is numpy's: the same
operations in the same order, in the array's dtype, and NaN propagates through every activation as
through np.maximum/np.minimum.
"""

from __future__ import annotations

import numpy as np

from . import jit

NONE, RELU, CLIP, LEAKY_RELU = 0, 1, 2, 3


@jit
def _activate_row(row, kind, params):
    # Comparisons are false for NaN, so NaN passes through as with np.maximum; Clip is max-then-min,
    # so the upper bound wins where low > high.
    if kind == RELU:
        for p in range(row.shape[0]):
            v = row[p]
            row[p] = 0 if v < 0 else v
    elif kind == CLIP:
        lo, hi = params[0], params[1]
        for p in range(row.shape[0]):
            v = row[p]
            v = lo if v < lo else v
            row[p] = hi if v > hi else v
    elif kind == LEAKY_RELU:
        slope = params[0]
        for p in range(row.shape[0]):
            v = row[p]
            row[p] = v * slope if v < 0 else v


@jit
def channel_affine(x, factor, shift, out, kind, params):
    """out = activation(x * factor[c] + shift[c]); ``out`` may be ``x``."""
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            f, s = factor[c], shift[c]
            src, dst = x[n, c], out[n, c]
            for p in range(src.shape[0]):
                dst[p] = src[p] * f + s
            _activate_row(dst, kind, params)


def activation_bounds(kind: int, params, dtype) -> np.ndarray:
    """The activation as (low, high, slope), the form the one-pass loops (and gemm.py's microkernel)
    apply: v*slope below zero, then max with low, then min with high. Each step is the identity for
    the activations that do not use it (slope 1 multiplies exactly)."""
    low, high, slope = -np.inf, np.inf, 1.0
    if kind == RELU:
        low = 0.0
    elif kind == CLIP:
        low, high = params[0], params[1]
    elif kind == LEAKY_RELU:
        slope = params[0]
    return np.array([low, high, slope], dtype=dtype)


@jit
def activate(v, low, high, slope):
    # Comparisons are false for NaN, so NaN passes through as with np.maximum; Clip is max-then-min,
    # so the high bound wins where low > high.
    v = v * slope if v < 0 else v
    v = low if v < low else v
    return high if v > high else v


@jit
def _finish_in_place(row, first, count, with_bias, bias, residual, bounds):
    """row[first + p] = activation(row[first + p] + bias + residual[first + p]) for p < count. Without a
    bias nothing is added for it (adding zero would turn -0.0 into +0.0); an empty ``residual`` is
    skipped. Unsigned indices and a row that is not also passed as a source keep each loop vectorized."""
    low, high, slope = bounds[0], bounds[1], bounds[2]
    first = np.uint64(first)
    if with_bias and residual.shape[0] > 0:
        for p in range(count):
            q = first + np.uint64(p)
            row[q] = activate(row[q] + bias + residual[q], low, high, slope)
    elif with_bias:
        for p in range(count):
            q = first + np.uint64(p)
            row[q] = activate(row[q] + bias, low, high, slope)
    elif residual.shape[0] > 0:
        for p in range(count):
            q = first + np.uint64(p)
            row[q] = activate(row[q] + residual[q], low, high, slope)
    else:
        for p in range(count):
            q = first + np.uint64(p)
            row[q] = activate(row[q], low, high, slope)


@jit
def _finish_crop(row, source, lines, width, padded, with_bias, bias, residual, bounds):
    """row[r*width + q] = activation(source[r*padded + q] + bias + residual[r*width + q]) for the first
    ``width`` of each of ``lines`` padded lines: as _finish_in_place, from another array."""
    low, high, slope = bounds[0], bounds[1], bounds[2]
    for r in range(lines):
        at, start = np.uint64(r * width), np.uint64(r * padded)
        if with_bias and residual.shape[0] > 0:
            for p in range(width):
                q = np.uint64(p)
                row[at + q] = activate(source[start + q] + bias + residual[at + q], low, high, slope)
        elif with_bias:
            for p in range(width):
                q = np.uint64(p)
                row[at + q] = activate(source[start + q] + bias, low, high, slope)
        elif residual.shape[0] > 0:
            for p in range(width):
                q = np.uint64(p)
                row[at + q] = activate(source[start + q] + residual[at + q], low, high, slope)
        else:
            for p in range(width):
                q = np.uint64(p)
                row[at + q] = activate(source[start + q], low, high, slope)


@jit
def bias_residual_activation(y, bias, residual, bounds, first, end):
    """y = activation(y + bias[c] + residual) in place for pixels first .. end of every (N, C) row,
    so a convolution can finish each block of output rows while it is still in cache; an empty
    ``bias`` or ``residual`` is skipped (one compiled loop for every combination). ``bounds``: the
    activation, from activation_bounds."""
    with_bias, with_residual = bias.shape[0] > 0, residual.shape[0] > 0
    none = bias[:0]
    for n in range(y.shape[0]):
        for c in range(y.shape[1]):
            b = bias[c] if with_bias else y.dtype.type(0)
            z = residual[n, c] if with_residual else none
            _finish_in_place(y[n, c], first, end - first, with_bias, b, z, bounds)


@jit
def crop_bias_residual_activation(rows, y, width, bias, residual, bounds):
    """y[n, c, r*width + q] = activation(rows[n, c, r*Wp + q] + bias[c] + residual[n, c, r*width + q]):
    the padded-row results (N, C, OH*Wp) of a convolution by taps cropped to the (N, C, OH*width)
    output and finished in the same pass; an empty ``bias`` or ``residual`` is skipped."""
    with_bias, with_residual = bias.shape[0] > 0, residual.shape[0] > 0
    lines = y.shape[2] // width if width > 0 else 0
    padded = rows.shape[2] // lines if lines > 0 else 0
    none = bias[:0]
    for n in range(y.shape[0]):
        for c in range(y.shape[1]):
            b = bias[c] if with_bias else y.dtype.type(0)
            z = residual[n, c] if with_residual else none
            _finish_crop(y[n, c], rows[n, c], lines, width, padded, with_bias, b, z, bounds)


def absent(dtype, rank: int) -> np.ndarray:
    """The empty stand-in for an omitted ``bias`` (rank 1) or ``residual`` (rank 3)."""
    return np.empty((0,) * rank, dtype=dtype)
