"""Interpolation shared by the resampling operators (Resize, GridSample, DeformConv): the float type it
runs in, the cast back, the linear and cubic weights, and gathering the neighbours of sampling points."""

from __future__ import annotations

import itertools
import math

import numpy as np


def interp_dtype(dtype: np.dtype) -> np.dtype:
    """The float type interpolation of ``dtype`` values runs in: wide ints and float64 need float64."""
    dtype = np.dtype(dtype)
    if dtype == np.float64 or (np.issubdtype(dtype, np.integer) and dtype.itemsize >= 4):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def cast_back(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Interpolated values in the input's type: integers round half to even and saturate."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    return y.astype(dtype, copy=False)


def cubic_weights(distance: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at ``distance`` (>= 0), with coefficient ``a``."""
    d = distance
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def linear_weights(distance: np.ndarray) -> np.ndarray:
    return np.maximum(1 - distance, 0.0)


def gather_points(table: np.ndarray, lead: tuple, taps: list, sizes) -> np.ndarray:
    """Sum over every combination of per-dim taps of weight * table value at that point.

    ``table`` is (*lead, P, C): P flattened spatial positions of extent ``sizes``. ``taps[d]`` lists
    (index, weight) pairs of arrays shaped like the sampling points (*lead, *points); out-of-range
    indices contribute zero. ``lead`` holds the broadcastable index arrays of the leading dims.
    """
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    total = None
    for combo in itertools.product(*taps):
        flat = 0
        weight = 1
        for (index, w), size, stride in zip(combo, sizes, strides):
            inside = (index >= 0) & (index < size)
            flat = flat + np.clip(index, 0, size - 1) * stride
            weight = weight * np.where(inside, w, 0)
        term = table[(*lead, flat)] * weight[..., None]
        total = term if total is None else np.add(total, term, out=total)
    return total


def linear_taps(position: np.ndarray) -> list:
    low = np.floor(position)
    frac = position - low
    low = low.astype(np.int64)
    return [(low, 1 - frac), (low + 1, frac)]
