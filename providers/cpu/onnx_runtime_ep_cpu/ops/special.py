"""The error function for numpy, which has none: a float32 version fast enough for GELU activations and a
float64 version accurate to ~1e-15. Erf and Gelu both use them."""

from __future__ import annotations

import math

import numpy as np
from numpy.polynomial import chebyshev

# Taylor coefficients of erf(x) * sqrt(pi) / 2 in x: (-1)^n / (n! (2n + 1)), odd powers.
_ERF_TAYLOR = [(-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(7)]
# Abramowitz & Stegun 7.1.26: |error| <= 1.5e-7, enough for float32 and narrower floats.
_AS_P = 0.3275911
_AS_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf_float32(x):
    """float32 erf (absolute error ~3.5e-7), in place over three buffers."""
    # In-place passes over three float32 buffers: Erf runs on every MLP activation of a GELU
    # transformer, so allocations and temporaries dominate its cost.
    x = np.asarray(x, dtype=np.float32)
    ax = np.abs(x)
    t = ax * np.float32(_AS_P)
    t += np.float32(1)
    np.reciprocal(t, out=t)
    erf = t * np.float32(_AS_A[-1])
    for a in reversed(_AS_A[:-1]):
        erf += np.float32(a)
        erf *= t
    gauss = np.square(ax, out=t)
    np.negative(gauss, out=gauss)
    np.exp(gauss, out=gauss)
    erf *= gauss
    np.subtract(np.float32(1), erf, out=erf)
    np.copysign(erf, x, out=erf)
    # Near zero A&S loses relative accuracy (1 - ~1); there a short Taylor series is accurate. The
    # two are blended arithmetically: boolean-mask gathers and np.where cost far more than the math.
    x2 = np.square(x)
    series = np.full_like(x, np.float32(_ERF_TAYLOR[-1]))
    for c in reversed(_ERF_TAYLOR[:-1]):
        series *= x2
        series += np.float32(c)
    series *= x
    series *= np.float32(2 / math.sqrt(math.pi))
    near_zero = np.less(ax, np.float32(0.5), out=x2, casting="unsafe")  # 1.0 where |x| < 0.5, else 0.0
    series -= erf
    np.nan_to_num(series, copy=False, nan=0.0, posinf=0.0, neginf=0.0)  # the series overflows for huge |x|
    series *= near_zero
    erf += series
    return erf


def _erf_pieces(degree: int = 18) -> list[np.ndarray]:
    """Chebyshev coefficients of erf on [i, i+1] for i = 0..5 (erf(x)/x on the first piece, for
    relative accuracy near 0), interpolated from math.erf; beyond 6, erf is 1 in float64."""
    scalar = np.vectorize(math.erf, otypes=[np.float64])

    def first(u):
        t = 0.5 + 0.5 * u
        return scalar(t) / t

    pieces = [chebyshev.chebinterpolate(first, degree)]
    for i in range(1, 6):
        pieces.append(chebyshev.chebinterpolate(lambda u, i=i: scalar(i + 0.5 + 0.5 * u), degree))
    return pieces


_ERF_PIECES = _erf_pieces()


def erf_float64(x: np.ndarray) -> np.ndarray:
    """Vectorized float64 erf (absolute error ~1e-15): piecewise Chebyshev series on |x|."""
    t = np.abs(x.astype(np.float64))
    y = np.where(np.isnan(t), np.nan, 1.0)
    piece = np.floor(np.where(t < 6, t, 6)).astype(np.intp, copy=False)
    for i, coefs in enumerate(_ERF_PIECES):
        mask = piece == i
        u = 2 * (t[mask] - i) - 1
        y[mask] = chebyshev.chebval(u, coefs) * (t[mask] if i == 0 else 1)
    return np.copysign(y, x)
