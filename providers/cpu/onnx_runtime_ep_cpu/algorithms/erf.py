"""The error function for numpy, which has none: a float32 version fast enough for GELU activations and a
float64 version accurate to ~1e-15. Erf and Gelu both use them."""

from __future__ import annotations

import functools
import math

import numpy as np

# erf(x) = tanh(g(x)) with g(x) = atanh(erf(x)), an odd function that grows smoothly (like x^2 / 2 for
# large x), so g(x) ~ x * P(x^2) with a degree-6 P, where numpy's SIMD tanh does the saturating part.
# P is a weighted minimax fit of g in float64 against math.erf on [0, 4] (a linear program over a dense
# grid), weighting the error of tanh(x * P) as relative error where erf < 0.5 and absolute beyond. P has
# no real roots for x^2 >= 0, so x * P grows past tanh's saturation (~9) beyond 4 and no clamp is needed;
# huge |x| overflows to +-inf, which tanh maps to +-1. Evaluated in float32 (coefficients rounded), the
# error is <= 1.6e-7 absolute and <= 3.3e-7 relative (~4 ulp) near zero.
_ERF_TANH_P = (
    1.1283793143255703, 0.10276820219072605, -0.00018964169596231924, -0.0006217125051825625,
    8.835409827731843e-05, -5.785475768667572e-06, 1.4859524338297488e-07,
)


@functools.cache
def scaled_coefficients(scale: float) -> tuple[np.float32, ...]:
    """P's coefficients for erf(scale * x): the k-th one times scale^(2k + 1), rounded to float32 once."""
    return tuple(np.float32(c * scale ** (2 * k + 1)) for k, c in enumerate(_ERF_TANH_P))


def erf_float32(x, scale: float = 1.0) -> np.ndarray:
    """float32 erf(scale * x) as tanh(x * P(x^2)): 14 in-place passes and one tanh into a fresh array.

    Erf runs on every MLP activation of a GELU transformer, so passes and allocations are its cost;
    ``scale`` lets Gelu take erf(x / sqrt(2)) without a pass for the division.
    """
    x = np.asarray(x, dtype=np.float32)
    coefficients = scaled_coefficients(scale)
    with np.errstate(over="ignore"):  # x^2 and the series overflow to inf for huge |x|; tanh gives +-1
        square = np.square(x, out=np.empty_like(x))  # out=: a 0-d input still gets an array
        series = np.multiply(square, coefficients[-1], out=np.empty_like(x))
        for c in coefficients[-2:0:-1]:
            series += c
            series *= square
        series += coefficients[0]
        series *= x
    return np.tanh(series, out=series)


@functools.cache  # made at the first float64 erf, not at import: every GELU session imports this module
def _erf_pieces(degree: int = 18) -> list[np.ndarray]:
    """Chebyshev coefficients of erf on [i, i+1] for i = 0..5 (erf(x)/x on the first piece, for
    relative accuracy near 0), interpolated from math.erf; beyond 6, erf is 1 in float64."""
    from numpy.polynomial import chebyshev

    scalar = np.vectorize(math.erf, otypes=[np.float64])

    def first(u):
        t = 0.5 + 0.5 * u
        return scalar(t) / t

    pieces = [chebyshev.chebinterpolate(first, degree)]
    for i in range(1, 6):
        pieces.append(chebyshev.chebinterpolate(lambda u, i=i: scalar(i + 0.5 + 0.5 * u), degree))
    return pieces



def erf_float64(x: np.ndarray) -> np.ndarray:
    """Vectorized float64 erf (absolute error ~1e-15): piecewise Chebyshev series on |x|."""
    t = np.abs(x.astype(np.float64))
    y = np.where(np.isnan(t), np.nan, 1.0)
    piece = np.floor(np.where(t < 6, t, 6)).astype(np.intp, copy=False)
    from numpy.polynomial import chebyshev

    for i, coefs in enumerate(_erf_pieces()):
        mask = piece == i
        u = 2 * (t[mask] - i) - 1
        y[mask] = chebyshev.chebval(u, coefs) * (t[mask] if i == 0 else 1)
    return np.copysign(y, x)


def erf(x: np.ndarray) -> np.ndarray:
    """erf of a float array: float64 as it is, others (half precision included) computed in float32."""
    if x.dtype == np.float64:
        return erf_float64(x)
    return erf_float32(x).astype(x.dtype, copy=False)
