"""Compiled loops for the small per-token kernels of a decoder step: RMS normalization (alone or after
the residual add) and the rotate-half rotary embedding.

At decode sizes (one row of a few hundred values) numpy's cost is its per-call overhead: RMS
normalization is six ufunc calls and temporaries for 256 values, where one compiled pass over the row
takes a fraction of a microsecond (numba's dispatch costs ~0.4 us with four array arguments).
Row sums keep eight partial sums: float sums cannot vectorize without reassociation (no fastmath),
and eight chains are faster and more accurate than one.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .transformer import sigmoid_float32


@jit
def _square_sum(row):
    """Sum of row^2 through eight interleaved partial sums."""
    n = row.shape[0]
    body = n - n % 8
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = row.dtype.type(0)
    for j in range(0, body, 8):
        s0 += row[j] * row[j]
        s1 += row[j + 1] * row[j + 1]
        s2 += row[j + 2] * row[j + 2]
        s3 += row[j + 3] * row[j + 3]
        s4 += row[j + 4] * row[j + 4]
        s5 += row[j + 5] * row[j + 5]
        s6 += row[j + 6] * row[j + 6]
        s7 += row[j + 7] * row[j + 7]
    total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for j in range(body, n):
        total += row[j] * row[j]
    return total


@jit
def _normalize_row(row, weight, epsilon, out):
    """out = row / sqrt(mean(row^2) + epsilon) * weight, in the numpy kernel's order of operations."""
    n = row.shape[0]
    mean_square = _square_sum(row) * row.dtype.type(1.0 / max(n, 1)) + epsilon
    denominator = np.sqrt(mean_square)
    for j in range(n):
        out[j] = row[j] / denominator * weight[j]


@jit
def rms_norm(x, weight, epsilon, out):
    """RMS normalization of each row of ``x`` (rows, n) into ``out``; ``weight`` (n,) scales the columns."""
    eps = x.dtype.type(epsilon)
    for r in range(x.shape[0]):
        _normalize_row(x[r], weight, eps, out[r])


@jit
def skip_rms_norm(a, b, weight, epsilon, out, total):
    """``total`` = a + b, and ``out`` its RMS normalization, row by row (the residual add before a norm)."""
    eps = a.dtype.type(epsilon)
    n = a.shape[1]
    for r in range(a.shape[0]):
        row = total[r]
        for j in range(n):
            row[j] = a[r, j] + b[r, j]
        _normalize_row(row, weight, eps, out[r])


@jit
def rotate_half(q, cos, sin, table_row, half, out):
    """q * cos + concat(-q[:, half:], q[:, :half]) * sin for each row of ``q`` (rows, d); row ``r`` of q
    uses row ``table_row[r]`` of ``cos`` and ``sin`` (the broadcast of the tables over batch and heads)."""
    d = q.shape[1]
    rest = d - half
    for r in range(q.shape[0]):
        c = table_row[r]
        for j in range(rest):
            out[r, j] = q[r, j] * cos[c, j] + (-q[r, half + j]) * sin[c, j]
        for j in range(rest, d):
            out[r, j] = q[r, j] * cos[c, j] + q[r, j - rest] * sin[c, j]


@jit
def swish_mul_float32(a, b, alpha, out):
    """swish_mul for float32 as a * sigmoid(alpha * a) * b, through transformer.py's vectorized sigmoid
    (libm's scalar exp cost ~4 ns an element)."""
    scale = np.float32(alpha)
    for j in range(a.shape[0]):
        out[j] = a[j] * sigmoid_float32(scale * a[j]) * b[j]


@jit
def swish_mul(a, b, alpha, out):
    """out = a / (1 + exp(-alpha * a)) * b over 1-D arrays of one length."""
    one = a.dtype.type(1)
    minus_alpha = a.dtype.type(-alpha)
    for j in range(a.shape[0]):
        out[j] = a[j] / (one + np.exp(minus_alpha * a[j])) * b[j]
