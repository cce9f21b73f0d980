"""LRN: ``x / (bias + alpha / size * (sum of squares over a channel window)) ** beta``.

numpy needs a pass over the whole array per window channel (plus the squaring and the scaling);
these loops build each output channel's base from its window's input channels while they are in
cache. The sum runs in channel order, in the input dtype, with the scale and bias in that dtype,
so the base has the same bits as numpy's. The caller raises the base to ``beta`` and divides with
numpy: its power is vectorized, where a compiled one calls libm per element (and a power built
from square roots for the usual beta = 0.75 was measured up to 4 ulp off numpy's).
"""

from __future__ import annotations

import numpy as np

from . import jit


@jit
def lrn_base(x, base, size, before, scale, bias):
    """``base[n, c, s] = bias + scale * sum(x[n, k, s] ** 2 for k in window(c))`` for x of shape
    (N, C, S), where window(c) is the channels in [c - before, c - before + size), summed in order."""
    channels = x.shape[1]
    pixels = np.uint64(x.shape[2])
    for n in range(x.shape[0]):
        for c in range(channels):
            lo = max(0, c - before)
            hi = min(channels, c - before + size)
            for s in range(pixels):
                v = x[n, lo, s]
                base[n, c, s] = v * v
            for k in range(lo + 1, hi):
                for s in range(pixels):
                    v = x[n, k, s]
                    base[n, c, s] += v * v
            for s in range(pixels):
                base[n, c, s] = bias + scale * base[n, c, s]
