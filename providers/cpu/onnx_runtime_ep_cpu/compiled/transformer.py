"""Compiled loops for transformer blocks: the epilogue of a matrix product (bias, residual, Gelu's
series), layer normalization and the masked softmax of attention, each a pass per row of a 2-D array
while the row sits in cache.

numba without Intel's SVML calls libm's scalar exp and tanh, several times slower than numpy's SIMD
versions. The float32 Gelu and softmax compute their own exp in operations that vectorize
(exp_float32.py), in one pass; elsewhere the transcendental step stays a numpy call between two
compiled passes (float64 Gelu: series, np.tanh, finish; attention: mask and shift, np.exp, normalize).
Float sums cannot vectorize without reassociation, so the row sums alone are compiled with it.
"""

from __future__ import annotations

import numpy as np

from . import compiler, jit
from .exp_float32 import contracting_jit, exp_nonpositive_float32, sigmoid_float32

# The row sums alone may reassociate: LLVM then vectorizes them (faster than eight interleaved partial
# sums; measured in afcca01). Their order differs from numpy's (BLAS) sums anyway; nothing else is
# reordered, and NaN/inf handling is unchanged (no nnan/ninf).
summing_jit = compiler(fastmath={"reassoc"})


@summing_jit
def row_sum(row):
    total = row.dtype.type(0)
    for j in range(row.shape[0]):
        total += row[j]
    return total


@summing_jit
def squared_deviation_sum(row, mean):
    """Sum of (row - mean)^2."""
    total = row.dtype.type(0)
    for j in range(row.shape[0]):
        d = row[j] - mean
        total += d * d
    return total


@jit
def row_max(row):
    """The largest non-NaN value of a 1-D array (-inf if none), through eight interleaved maxima: a
    comparison chain does not vectorize, eight independent ones do (measured in afcca01)."""
    n = row.shape[0]
    body = n - n % 8
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = -row.dtype.type(1) / row.dtype.type(0)
    for j in range(0, body, 8):
        v0, v1, v2, v3 = row[j], row[j + 1], row[j + 2], row[j + 3]
        v4, v5, v6, v7 = row[j + 4], row[j + 5], row[j + 6], row[j + 7]
        m0 = v0 if v0 > m0 else m0
        m1 = v1 if v1 > m1 else m1
        m2 = v2 if v2 > m2 else m2
        m3 = v3 if v3 > m3 else m3
        m4 = v4 if v4 > m4 else m4
        m5 = v5 if v5 > m5 else m5
        m6 = v6 if v6 > m6 else m6
        m7 = v7 if v7 > m7 else m7
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    m4 = m5 if m5 > m4 else m4
    m6 = m7 if m7 > m6 else m6
    m0 = m2 if m2 > m0 else m0
    m4 = m6 if m6 > m4 else m4
    peak = m4 if m4 > m0 else m0
    for j in range(body, n):
        v = row[j]
        peak = v if v > peak else peak
    return peak


@jit
def add_bias_residual_(y, bias, residual):
    """y = (y + bias) + residual in place, row by row; ``bias`` (N,) and/or ``residual`` (M, N) may be
    empty (size 0) to skip them. The order of the additions is the unfused graph's."""
    rows, cols = y.shape
    with_bias, with_residual = bias.shape[0] > 0, residual.shape[0] > 0
    for i in range(rows):
        yi = y[i]
        if with_bias:
            for j in range(cols):
                yi[j] += bias[j]
        if with_residual:
            ri = residual[i]
            for j in range(cols):
                yi[j] += ri[j]


@jit
def odd_series(x, bias, series, coefficients):
    """series = u * P(u^2) for u = x + bias (bias may be empty; x is only read), P of degree >= 1 with
    its coefficients lowest first. The operations are numpy's Horner passes of the Gelu kernels in the
    same order and precision, so np.tanh of the result matches the numpy kernel bit for bit (float64)."""
    rows, cols = x.shape
    top = coefficients.shape[0] - 1
    with_bias = bias.shape[0] > 0
    u, square = np.empty(cols, x.dtype), np.empty(cols, x.dtype)
    for i in range(rows):
        xi, si = x[i], series[i]
        if with_bias:
            for j in range(cols):
                u[j] = xi[j] + bias[j]
        else:
            for j in range(cols):
                u[j] = xi[j]
        if top == 6:  # erf's degree: one pass keeping the series in registers (half the time)
            c0, c1, c2, c3 = coefficients[0], coefficients[1], coefficients[2], coefficients[3]
            c4, c5, c6 = coefficients[4], coefficients[5], coefficients[6]
            for j in range(cols):
                v = u[j]
                q = v * v
                si[j] = ((((((q * c6 + c5) * q + c4) * q + c3) * q + c2) * q + c1) * q + c0) * v
            continue
        c = coefficients[top]
        for j in range(cols):
            square[j] = u[j] * u[j]
            si[j] = square[j] * c
        for k in range(top - 1, 0, -1):
            c = coefficients[k]
            for j in range(cols):
                si[j] = (si[j] + c) * square[j]
        c = coefficients[0]
        for j in range(cols):
            si[j] = (si[j] + c) * u[j]




@contracting_jit
def gelu_float32_(x, bias, y, residual, coefficients):
    """y = u * sigmoid(2 s) (+ residual) for u = x + bias and s = u * P(u^2), float32 (M, N) rows, in one
    pass per row (sigmoid_float32 vectorizes); bias and residual may be empty, P's coefficients lowest
    first: degree 6 (the erf form's series) or 1 (the tanh form's), the two _gelu_series gives. u * sigmoid(2 s)
    is Gelu's 0.5 * u * (1 + tanh(s)) without its cancellation where tanh(s) nears -1 (the negative tail
    keeps its relative accuracy); s is odd_series' in its order."""
    rows, cols = x.shape
    top = coefficients.shape[0] - 1
    if top != 6 and top != 1:
        raise ValueError("gelu_float32_ takes a series of degree 6 (erf form) or 1 (tanh form)")
    with_bias, with_residual = bias.shape[0] > 0, residual.shape[0] > 0
    two = np.float32(2)
    u = np.empty(cols, np.float32)
    c0, c1 = coefficients[0], coefficients[1]
    for i in range(rows):
        xi, yi = x[i], y[i]
        if with_bias:
            for j in range(cols):
                u[j] = xi[j] + bias[j]
        else:
            u[:] = xi
        if top == 6:  # erf's series
            c2, c3, c4, c5, c6 = coefficients[2], coefficients[3], coefficients[4], coefficients[5], coefficients[6]
            for j in range(cols):
                v = u[j]
                q = v * v
                series = ((((((q * c6 + c5) * q + c4) * q + c3) * q + c2) * q + c1) * q + c0) * v
                yi[j] = v * sigmoid_float32(two * series)
        else:  # the tanh approximation's
            for j in range(cols):
                v = u[j]
                yi[j] = v * sigmoid_float32(two * ((v * v * c1 + c0) * v))
        if with_residual:
            ri = residual[i]
            for j in range(cols):
                yi[j] += ri[j]


@jit
def gelu_finish_(x, bias, t, residual):
    """t = ((t + 1) * u) * 0.5 in place for u = x + bias, t being tanh of the odd series (Gelu's last
    numpy passes), then + residual when it is not empty; bias and residual may be empty."""
    rows, cols = x.shape
    one, half = t.dtype.type(1), t.dtype.type(0.5)
    with_bias, with_residual = bias.shape[0] > 0, residual.shape[0] > 0
    for i in range(rows):
        xi, ti = x[i], t[i]
        if with_bias:
            for j in range(cols):
                ti[j] = ((ti[j] + one) * (xi[j] + bias[j])) * half
        else:
            for j in range(cols):
                ti[j] = ((ti[j] + one) * xi[j]) * half
        if with_residual:
            ri = residual[i]
            for j in range(cols):
                ti[j] += ri[j]


@jit
def layer_norm_rows(x, scale, bias, epsilon, y, mean_out, inv_std_out):
    """LayerNormalization over the rows of x (M, N) into y: two passes for the statistics (mean, then
    the centred sum of squares), one for ((x - mean) * inv_std) * scale + bias; bias may be empty."""
    rows, cols = x.shape
    count = x.dtype.type(cols)
    eps = x.dtype.type(epsilon)
    one = x.dtype.type(1)
    with_bias = bias.shape[0] > 0
    for i in range(rows):
        xi, yi = x[i], y[i]
        mean = row_sum(xi) / count
        inv_std = one / np.sqrt(squared_deviation_sum(xi, mean) / count + eps)
        mean_out[i] = mean
        inv_std_out[i] = inv_std
        if with_bias:
            for j in range(cols):
                yi[j] = ((xi[j] - mean) * inv_std) * scale[j] + bias[j]
        else:
            for j in range(cols):
                yi[j] = ((xi[j] - mean) * inv_std) * scale[j]


@jit
def mask_and_shift_(scores, scale, mask, first_row):
    """scores (H, M, T) = scores * scale + mask[first_row + i, :T] for row i (mask empty for none), minus
    each row's maximum, in place. False when some row's maximum is not finite (a fully masked row, inf
    or NaN): the caller then takes its general path."""
    heads, rows, cols = scores.shape
    with_mask = mask.shape[0] > 0
    lowest = -scores.dtype.type(1) / scores.dtype.type(0)
    for h in range(heads):
        for i in range(rows):
            si = scores[h, i]
            if with_mask:
                mi = mask[first_row + i]
                for j in range(cols):
                    si[j] = si[j] * scale + mi[j]
            else:
                for j in range(cols):
                    si[j] = si[j] * scale
            peak = row_max(si)
            if not (abs(peak) < -lowest):
                return False
            for j in range(cols):
                si[j] -= peak
    return True


@jit
def key_extents(mask, block, gap):
    """For each block of ``block`` rows of the additive mask (M, T): one past the last key that some row of
    the block does not hide. Key j is hidden from row i when mask[i, j] is below the row's largest mask
    value by more than ``gap`` (the caller's bound for a weight that underflows to zero whatever the
    scores; inf hides nothing). The keys beyond get zero weight, so their scores need no product (a
    causal mask leaves the first of four blocks a quarter of the keys)."""
    rows, cols = mask.shape
    extents = np.zeros((rows + block - 1) // block, np.int64)
    for i in range(rows):
        mi = mask[i]
        peak = row_max(mi)
        # Plus float32 rounding of scores near the peak (masks of large magnitude); NaN (a row without a
        # finite mask value) hides nothing.
        floor = peak - (gap + 1e-6 * abs(peak))
        end = 0
        for j in range(cols):  # a select per key: vectorizes, unlike a scan that stops early
            end = end if mi[j] < floor else j + 1
        b = i // block
        extents[b] = end if end > extents[b] else extents[b]
    return extents


@summing_jit
def largest_row_norm(x):
    """The largest Euclidean norm of the rows of x (M, N), summed in float64; inf when some value is
    not finite."""
    best = 0.0
    for i in range(x.shape[0]):
        total = 0.0
        xi = x[i]
        for j in range(x.shape[1]):
            total += np.float64(xi[j]) * np.float64(xi[j])
        if not total < np.inf:
            return np.inf
        best = total if total > best else best
    return np.sqrt(best)


@summing_jit
def largest_column_norm(x):
    """The largest Euclidean norm of the columns of the matrices x[a] (A, D, T), summed in float64; inf
    when some value is not finite."""
    best = 0.0
    totals = np.empty(x.shape[2], np.float64)
    for a in range(x.shape[0]):
        totals[:] = 0.0
        for d in range(x.shape[1]):
            xd = x[a, d]
            for j in range(x.shape[2]):
                totals[j] += np.float64(xd[j]) * np.float64(xd[j])
        for j in range(x.shape[2]):
            total = totals[j]
            if not total < np.inf:
                return np.inf
            best = total if total > best else best
    return np.sqrt(best)


@jit
def divide_by_row_sums_(weights, y):
    """y[i] /= sum(weights[i]) for weights (M, T) and y (M, D): softmax's normalization applied after
    the product with V, on fewer elements than the weights."""
    for i in range(weights.shape[0]):
        total = row_sum(weights[i])
        yi = y[i]
        for j in range(yi.shape[0]):
            yi[j] /= total


# -- callers' entry points -------------------------------------------------------------------------


def _empty(dtype, ndim: int) -> np.ndarray:
    """The "none" operand of the loops: empty, of the operands' dtype (no extra compiled signature)."""
    return np.empty((0,) * ndim, dtype)


_ROW_FLOATS = 8192  # the longest row as_rows makes (the loops' row scratch stays in the L1 cache)


def as_rows(x: np.ndarray) -> np.ndarray:
    """x's elements as a C-contiguous 2-D array of rows for elementwise loops: one row up to _ROW_FLOATS, else rows
    of the largest power of two from 64 to _ROW_FLOATS dividing its size (no scalar remainder in the vectorized loop,
    where a Conv1d output's rows of 100 frames leave one each), else rows along its last axis, short ones one row."""
    x = np.ascontiguousarray(x)
    if x.size <= _ROW_FLOATS:
        return x.reshape(1, -1)
    length = min(x.size & -x.size, _ROW_FLOATS)  # (the largest power of two dividing the size)
    if length >= 64:
        return x.reshape(-1, length)
    if x.ndim >= 2 and x.shape[-1] >= 64:
        return x.reshape(-1, x.shape[-1])
    return x.reshape(1, -1)


def gelu(x: np.ndarray, coefficients: np.ndarray, bias=None, residual=None, out=None) -> np.ndarray:
    """0.5 * u * (1 + tanh(u * P(u^2))) (+ residual) for u = x + bias over a 2-D C-contiguous x. float32
    takes one pass (gelu_float32_) into ``out`` (x itself may be it) or a fresh array; float64 three
    (series, numpy's tanh, finish) into a fresh array.

    One thread: Gelu follows a BLAS product, and numpy's BLAS keeps a worker spinning for ~0.1 s after
    it, so a helper thread of workers.py posted here would fight it for the second core (and then
    spin through the next product): split in two, each waits for the other's time slices (measured in
    9337d6b)."""
    dtype = x.dtype
    bias = _empty(dtype, 1) if bias is None else bias
    if dtype == np.float32:
        y = np.empty(x.shape, dtype) if out is None else out
        gelu_float32_(x, bias, y, _empty(dtype, 2) if residual is None else residual, coefficients)
        return y
    y = np.empty(x.shape, dtype)  # the finish reads x after the series has been written
    odd_series(x, bias, y, coefficients)
    np.tanh(y, out=y)
    gelu_finish_(x, bias, y, _empty(dtype, 2) if residual is None else residual)
    return y


def add_bias_residual(y: np.ndarray, bias=None, residual=None) -> np.ndarray:
    """(y + bias) + residual in place on the 2-D C-contiguous y; returns y."""
    add_bias_residual_(y, _empty(y.dtype, 1) if bias is None else bias,
                       _empty(y.dtype, 2) if residual is None else residual)
    return y


def layer_norm(x: np.ndarray, scale: np.ndarray, bias, epsilon: float):
    """(y, mean, inv_std) of LayerNormalization over the rows of the 2-D C-contiguous x; mean and
    inv_std are (M, 1)."""
    y = np.empty(x.shape, x.dtype)
    mean, inv_std = np.empty((x.shape[0], 1), x.dtype), np.empty((x.shape[0], 1), x.dtype)
    layer_norm_rows(x, scale, _empty(x.dtype, 1) if bias is None else bias, epsilon, y, mean.reshape(-1),
                    inv_std.reshape(-1))
    return y, mean, inv_std


@contracting_jit
def exp_shifted_sum_(x, peak, out):
    """out = exp(x - peak) by exp_nonpositive_float32 (float32 1-D, x <= peak), and its sum. ``out`` may be
    x, but the loop vectorizes only over distinct arrays (the same array twice ran unvectorized; 954b7b9)."""
    for j in range(x.shape[0]):
        out[j] = exp_nonpositive_float32(x[j] - peak)
    return row_sum(out)


@contracting_jit
def softmax_rows_float32_(x, y):
    """y[r] = softmax(x[r]) over the rows of the 2-D float32 x (y may be x, slower): the row's largest non-NaN
    value, exp(x - that) by exp_nonpositive_float32 with the row's sum, then each times the sum's
    reciprocal. A NaN, or a row without a finite maximum, gives NaN through the sum, as numpy's formula
    does. One compiled call for what numpy runs as six, whose code is out of cache when a CNN's closing
    Softmax follows its classifier (measured in 0f966df). Rows shorter than SHORT_ROW take the same steps
    in three passes, so the exponentials run as one long loop (softmax_short_rows_)."""
    if x.shape[1] < SHORT_ROW:
        softmax_short_rows_(x, y)
        return
    for r in range(x.shape[0]):
        row, out = x[r], y[r]
        scale = np.float32(1) / exp_shifted_sum_(row, row_max(row), out)
        for j in range(row.shape[0]):
            out[j] *= scale


# Rows shorter than this run softmax_rows_float32_'s exponentials as one loop over the whole block: LLVM's
# vector loop (16 lanes, four interleaved) never starts on a row shorter than 64 values, so the polynomial
# ran a value at a time on attention's short rows.
SHORT_ROW = 64


@contracting_jit
def softmax_short_rows_(x, y):
    """softmax_rows_float32_ for short rows (``y`` may be x): each row's shift by its largest non-NaN value into
    one buffer, exp_nonpositive_float32 over that buffer as one loop, then each row times its sum's reciprocal:
    the same operations on each value, in the same order, as a row at a time."""
    rows, n = x.shape
    block = np.empty(rows * n, np.float32)
    for r in range(rows):  # (x[r, j], not a view of the row per row: a view costs more than a short row's work)
        peak = row_max(x[r])
        for j in range(n):
            block[r * n + j] = x[r, j] - peak
    for i in range(block.shape[0]):
        block[i] = exp_nonpositive_float32(block[i])
    for r in range(rows):
        scale = np.float32(1) / row_sum(block[r * n:(r + 1) * n])
        for j in range(n):
            y[r, j] = block[r * n + j] * scale
