"""A small float32 Gemm (a few rows by a small constant weight matrix, plus a bias row) in one compiled call.

A streaming model's classifier (64 features into a dozen classes, every frame) costs BLAS's call, a bias add and
the kernel's checks, several times its arithmetic; these loops do the product and the bias in one call that a
kernel keeps bound (ops/linalg.py). Rows by transposed weights (Gemm's transB, w N x K) sum each output as one dot
product of two contiguous rows; rows by w K x N add each row of w times a's entry into the output row. Sums may
round differently from BLAS's (as BLAS's own blockings do). No numpy twins: the kernel serves BLAS's path until
numba is loaded.
"""

from __future__ import annotations

import numpy as np

from . import compiler

_reassociating = compiler(fastmath={"reassoc", "contract"})


@_reassociating
def rows_by_transposed_bias_(a, w, bias, y):
    """y = a @ w.T, plus ``bias`` (N,) where it is not empty; a (M, K), w (N, K), y (M, N), all float32 and
    C-contiguous."""
    rows, depth = a.shape
    with_bias = bias.shape[0] > 0
    for j in range(y.shape[1]):
        wj = w[j]
        term = bias[j] if with_bias else np.float32(0.0)
        for r in range(rows):
            ar = a[r]
            total = np.float32(0.0)
            for k in range(depth):
                total += ar[k] * wj[k]
            y[r, j] = total + term


@_reassociating
def rows_by_weights_bias_(a, w, bias, y):
    """y = a @ w, plus ``bias`` (N,) where it is not empty; a (M, K), w (K, N), y (M, N), all float32 and
    C-contiguous."""
    rows, depth = a.shape
    n = y.shape[1]
    for r in range(rows):
        yr, ar = y[r], a[r]
        for j in range(n):
            yr[j] = np.float32(0.0)
        for k in range(depth):
            ark, wk = ar[k], w[k]
            for j in range(n):
                yr[j] += ark * wk[j]
        if bias.shape[0] > 0:
            for j in range(n):
                yr[j] += bias[j]
