"""One-pass epilogues of convolution and batch normalization: a per-channel affine map or bias,
a residual, and an activation applied to each element once, instead of one numpy pass per term.

Arrays are (N, C, P): batch, channels, pixels (contiguous). The activation is a code with a
two-element ``params`` array of the data's dtype (Clip's bounds; LeakyRelu's slope first), chosen
outside the inner loop so each loop stays branch-free. The
arithmetic is numpy's: the same operations in the same order, in the array's dtype, and NaN
propagates through every activation as through np.maximum/np.minimum.
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


@jit
def bias_residual_activation(y, bias, residual, kind, params):
    """y = activation(y + bias[c] + residual) in place; an empty ``bias`` or ``residual`` is skipped
    (one compiled loop for every combination: the branches sit outside the pixel loops)."""
    with_bias, with_residual = bias.shape[0] > 0, residual.shape[0] > 0
    for n in range(y.shape[0]):
        for c in range(y.shape[1]):
            row = y[n, c]
            if with_bias:
                b = bias[c]
                if with_residual:
                    z = residual[n, c]
                    for p in range(row.shape[0]):
                        row[p] = row[p] + b + z[p]
                else:
                    for p in range(row.shape[0]):
                        row[p] = row[p] + b
            elif with_residual:
                z = residual[n, c]
                for p in range(row.shape[0]):
                    row[p] = row[p] + z[p]
            _activate_row(row, kind, params)


def absent(dtype, rank: int) -> np.ndarray:
    """The empty stand-in for an omitted ``bias`` (rank 1) or ``residual`` (rank 3)."""
    return np.empty((0,) * rank, dtype=dtype)
