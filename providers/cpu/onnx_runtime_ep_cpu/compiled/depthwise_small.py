"""Depthwise 2-D convolution over small planes (a light CNN's late layers), two ways.

Pair sums (depthwise_pairs), for windows of many taps onto few outputs: the input turned channels-last once
(pixel-major), each output pixel the sum, over the (input pixel, tap) pairs its window reaches inside the
image, of a tap's weights times an input pixel's channels. The inner loop runs over the channels, contiguous
in both operands (vectorized); pads cost nothing (the pairs list only what lies inside), where the plane-based
loops of depthwise.py spend more on copies and edges than on the taps of so few pixels.

Flat planes (depthwise_flat), for stride-1 windows whose output is the input's size: a channel's whole plane
as one row of pixels, each tap a pass over it at the tap's offset (a copy with zero margins takes the rows
above and below the image; a mask per tap zeroes the columns that would wrap into the next row).
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


def flat_taps(in_shape, kernel, dilations, begin, dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """``(shifts, masks, margin)`` of a stride-1 window whose output has the input's shape: tap t reads the
    flat plane at p + shifts[t] (from a copy with ``margin`` zeros before and after), times masks[t, p] (1 where
    its column lies inside the image)."""
    (h, w), (kh, kw), (dh, dw), (bh, bw) = in_shape, kernel, dilations, begin
    columns = np.arange(h * w) % w
    shifts, masks = [], []
    for i in range(kh):
        for j in range(kw):
            shifts.append((i * dh - bh) * w + j * dw - bw)
            masks.append((columns + j * dw - bw >= 0) & (columns + j * dw - bw < w))
    margin = max(abs(s) for s in shifts)
    return np.array(shifts, dtype=np.int64), np.array(masks, dtype=dtype).reshape(-1), margin


@_fused
def depthwise_flat(x, weights, bias, shifts, masks, bounds, y, padded, acc):
    """y (N, C, P) = activation(bias + the depthwise convolution of x (N, C, P)) with one output per channel and
    a stride-1 window of flat_taps' ``shifts`` and ``masks``, all flat: ``weights`` (C, taps), ``bias`` (C,)
    (zeros for none), ``bounds`` (epilogue.activation_bounds); ``padded`` (P + 2 * margin, its margins zero)
    and ``acc`` (P) scratch."""
    taps, pixels, channels = _U(shifts.shape[0]), _U(acc.shape[0]), _U(bias.shape[0])
    margin = (_U(padded.shape[0]) - pixels) // _TWO
    low, high, slope = bounds[0], bounds[1], bounds[2]
    for n in range(_U(x.shape[0]) // (channels * pixels)):
        for c in range(channels):
            base = (_U(n) * channels + _U(c)) * pixels
            for p in range(pixels):
                padded[margin + _U(p)] = x[base + _U(p)]
                acc[p] = bias[c]
            for t in range(taps):
                tap = weights[_U(c) * taps + _U(t)]
                at, row = _U(np.int64(margin) + shifts[t]), _U(t) * pixels
                for p in range(pixels):
                    acc[p] += tap * padded[at + _U(p)] * masks[row + _U(p)]
            for p in range(pixels):
                y[base + _U(p)] = activate(acc[p], low, high, slope)


@_fused
def depthwise_pairs_nhwc(x, weights, bias, pairs, starts, y):
    """y (N, P, C) = bias + the depthwise convolution of x (N, Q, C), channels-last both (NhwcConv's): the pair sums
    of depthwise_pairs without its two layout changes, all flat; ``weights`` (taps, C), ``bias`` (C,) (zeros for
    none), ``pairs`` and ``starts`` window_pairs'."""
    channels, outputs = _U(bias.shape[0]), _U(starts.shape[0]) - _ONE
    images = _U(y.shape[0]) // (channels * outputs)
    inputs = _U(x.shape[0]) // (channels * images)
    for n in range(images):
        image, out = _U(n) * channels * inputs, _U(n) * channels * outputs
        for p in range(outputs):
            row = out + _U(p) * channels
            for c in range(channels):
                y[row + _U(c)] = bias[c]
            for k in range(starts[p], starts[p + 1]):
                source = image + _U(pairs[_TWO * _U(k)]) * channels
                tap = _U(pairs[_TWO * _U(k) + _ONE]) * channels
                for c in range(channels):
                    y[row + _U(c)] += weights[tap + _U(c)] * x[source + _U(c)]
