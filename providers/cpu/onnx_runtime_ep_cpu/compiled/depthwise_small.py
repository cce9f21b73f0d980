"""Depthwise 2-D convolution over small planes (a light CNN's late layers: 4x4 to 16x16 outputs) as sums over
channels: the input turned channels-last once (pixel-major), each output pixel the sum, over the (input pixel,
tap) pairs its window reaches inside the image, of a tap's weights times an input pixel's channels. The
inner loop runs over the channels, contiguous in both operands (vectorized); pads cost nothing (the pairs
list only what lies inside), where the plane-based loops of depthwise.py spend more on copies and edges than
on the taps of so few pixels.
"""

from __future__ import annotations

import numpy as np

from . import compiler
from .epilogue import activate

# Each multiply-add may fuse into one instruction (one rounding), as in the other depthwise loops.
_fused = compiler(fastmath={"contract"})
_U = np.uint64
_ONE, _TWO = np.uint64(1), np.uint64(2)


def window_pairs(in_shape, kernel, strides, dilations, begin, out) -> tuple[np.ndarray, np.ndarray]:
    """``(pairs, starts)``: for output pixel p (row-major), pairs k = starts[p] .. starts[p + 1] - 1 (the input
    pixel at pairs[2k], the tap at pairs[2k + 1]) are those of its window that lie inside the (unpadded)
    input, taps row-major."""
    (h, w), (kh, kw), (sh, sw), (dh, dw), (bh, bw), (oh, ow) = in_shape, kernel, strides, dilations, begin, out
    pairs, starts = [], [0]
    for oy in range(oh):
        for ox in range(ow):
            for i in range(kh):
                r = oy * sh - bh + i * dh
                if not 0 <= r < h:
                    continue
                for j in range(kw):
                    c = ox * sw - bw + j * dw
                    if 0 <= c < w:
                        pairs.append((r * w + c, i * kw + j))
            starts.append(len(pairs))
    return np.array(pairs, dtype=np.uint64).reshape(-1), np.array(starts, dtype=np.uint64)


@_fused
def depthwise_pairs(x, weights, bias, pairs, starts, bounds, y, x_t, y_t):
    """y (N, C, P) = activation(bias + the depthwise convolution of x (N, C, Q)) with one output per channel,
    all flat: ``weights`` (taps, C) channels-last, ``bias`` (C,) (zeros for none), ``bounds`` the activation
    (low, high, slope: epilogue.activation_bounds); ``x_t`` (Q * C) and ``y_t`` (P * C) scratch. Indices are
    unsigned: numba wraps a negative signed index around, and that test keeps the loops from vectorizing."""
    channels = _U(bias.shape[0])
    inputs, outputs = _U(x_t.shape[0]) // channels, _U(y_t.shape[0]) // channels
    low, high, slope = bounds[0], bounds[1], bounds[2]
    for n in range(_U(x.shape[0]) // (channels * inputs)):
        image = _U(n) * channels * inputs
        for c in range(channels):
            for q in range(inputs):
                x_t[_U(q) * channels + _U(c)] = x[image + _U(c) * inputs + _U(q)]
        for p in range(outputs):
            row = _U(p) * channels
            for c in range(channels):
                y_t[row + _U(c)] = bias[c]
            for k in range(starts[p], starts[p + 1]):
                source, tap = _U(pairs[_TWO * _U(k)]) * channels, _U(pairs[_TWO * _U(k) + _ONE]) * channels
                for c in range(channels):
                    y_t[row + _U(c)] += weights[tap + _U(c)] * x_t[source + _U(c)]
        out = _U(n) * channels * outputs
        for c in range(channels):
            for p in range(outputs):
                y[out + _U(c) * outputs + _U(p)] = activate(y_t[_U(p) * channels + _U(c)], low, high, slope)
